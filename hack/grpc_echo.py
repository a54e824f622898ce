"""A gRPC-style HTTP/2 backend for the ingress tests, written with the ``h2`` library.

Cleartext with prior knowledge (h2c) or TLS with ALPN ``h2``. Each request is answered once its
stream ended: ``:status 200``, ``content-type: application/grpc``, one length-prefixed message
whose payload is JSON ``{"path", "headers", "trailers", "message"}`` (what the backend saw: the
request headers, the request trailers, the request's messages concatenated, as text), then the
trailers ``grpc-status: 0`` and ``grpc-message: echoed`` (or what the request header
``x-want-status`` asks for; with ``x-trailers-only`` the answer is one HEADERS frame with END_STREAM
carrying them, gRPC's "trailers-only" response). Tests only.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import struct
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def grpc_frame(message: bytes) -> bytes:
    """One gRPC message: uncompressed flag, 4-byte big-endian length, the message."""
    return struct.pack(">BI", 0, len(message)) + message


def grpc_messages(data: bytes) -> list[bytes]:
    """The messages of a gRPC body (raises ValueError on a cut one)."""
    out = []
    while data:
        if len(data) < 5:
            raise ValueError("a cut gRPC message prefix")
        _, size = struct.unpack(">BI", data[:5])
        if len(data) < 5 + size:
            raise ValueError("a cut gRPC message")
        out.append(data[5:5 + size])
        data = data[5 + size:]
    return out


@dataclass
class _Call:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)


class GrpcEcho:
    """``await GrpcEcho.start(tls=None)``; ``port``; ``close()``."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.errors: list[str] = []
        """Why connections ended abnormally."""

    @classmethod
    async def start(cls, tls: ssl.SSLContext | None = None, *, host: str = "127.0.0.1", port: int = 0) -> GrpcEcho:
        echo = cls()
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
        echo.server = await asyncio.start_server(echo._serve, host, port, ssl=tls)
        return echo

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        calls: dict[int, _Call] = {}
        try:
            while data := await reader.read(1 << 16):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived) and event.stream_id:
                        calls[event.stream_id] = _Call({str(k): str(v) for k, v in event.headers or ()})
                    elif isinstance(event, h2.events.DataReceived) and event.stream_id in calls:
                        calls[event.stream_id].body += event.data or b""
                        conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
                    elif isinstance(event, h2.events.TrailersReceived) and event.stream_id in calls:
                        calls[event.stream_id].trailers.update({str(k): str(v) for k, v in event.headers or ()})
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id in calls:
                        _answer(conn, event.stream_id, calls.pop(event.stream_id))
                writer.write(conn.data_to_send())
                await writer.drain()
        except (ConnectionError, h2.exceptions.ProtocolError, ssl.SSLError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            writer.close()


def _answer(conn: h2.connection.H2Connection, stream_id: int, call: _Call) -> None:
    try:
        message = b"".join(grpc_messages(bytes(call.body))).decode(errors="replace")
    except ValueError as exc:
        message = f"bad body: {exc}"
    payload = json.dumps({"path": call.headers.get(":path"), "headers": call.headers, "trailers": call.trailers,
                          "message": message}).encode()
    status = call.headers.get("x-want-status", "0")
    if call.headers.get("x-trailers-only"):  # an error answer in one HEADERS frame, as gRPC servers send
        conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc"),
                                      ("grpc-status", status), ("grpc-message", "trailers only")], end_stream=True)
        return
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    framed = grpc_frame(payload)  # small: within the initial window
    for i in range(0, len(framed), conn.max_outbound_frame_size):
        conn.send_data(stream_id, framed[i:i + conn.max_outbound_frame_size])
    conn.send_headers(stream_id, [("grpc-status", status), ("grpc-message", "echoed")], end_stream=True)
