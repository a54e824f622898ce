"""A test client for https ingress: TLS with a chosen SNI and ALPN over any stream (a direct
connection or a tunnel through a tailscaled peer's HTTP proxy), then one HTTP/1.1 or HTTP/2 request;
or, for plaintext ingress, one HTTP/1.1 request or one HTTP/2 request with prior knowledge (h2c, no
TLS: :func:`http1_request`, :func:`h2c_request`).

Tests only; the responses are read with Connection: close (HTTP/1.1) or to END_STREAM (HTTP/2).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import h2.connection
import h2.events


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    alpn: str | None = None
    certificate: bytes = b""
    """The server's leaf certificate (DER)."""
    trailers: dict[str, str] = field(default_factory=dict)
    """HTTP/2 response trailers."""
    headers_only: bool = False
    """HTTP/2: the response was one HEADERS frame with END_STREAM."""


def client_context(ca: Path, alpn: str, *, check_name: bool = True) -> ssl.SSLContext:
    """Verifies the chain against ``ca``, and the name unless ``check_name`` is False (a test that
    reads which certificate a name got, wildcards of several labels included)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = check_name
    context.set_alpn_protocols([alpn])
    return context


async def tunnel(proxy_port: int, ip: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP stream to ``ip:port`` through an HTTP proxy on 127.0.0.1 (CONNECT)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    writer.write(f"CONNECT {ip}:{port} HTTP/1.1\r\nHost: {ip}:{port}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200" not in head.split(b"\r\n", 1)[0]:
        writer.close()
        raise ConnectionError(f"CONNECT refused: {head!r}")
    return reader, writer


async def request(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], *, ca: Path, sni: str,
                  alpn: str = "http/1.1", host: str | None = None, method: str = "GET", path: str = "/",
                  body: bytes = b"", headers: tuple[tuple[str, str], ...] = (),
                  trailers: tuple[tuple[str, str], ...] = (), check_name: bool = True) -> Answer:
    """TLS to ``sni`` over ``stream`` (verified against ``ca``; the name too, unless
    ``check_name`` is False), then one request for ``host`` with extra ``headers`` and (HTTP/2
    only, after the body) ``trailers``."""
    reader, writer = stream
    await writer.start_tls(client_context(ca, alpn, check_name=check_name), server_hostname=sni)
    sslobj = writer.get_extra_info("ssl_object")
    certificate = sslobj.getpeercert(binary_form=True) or b""
    try:
        if sslobj.selected_alpn_protocol() == "h2":
            answer = await _h2(reader, writer, host or sni, method, path, body, headers, trailers)
        else:
            answer = await _http1(reader, writer, host or sni, method, path, body, headers)
    finally:
        writer.close()
    answer.alpn, answer.certificate = sslobj.selected_alpn_protocol(), certificate
    return answer


async def h2c_request(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], *, host: str,
                      method: str = "GET", path: str = "/", body: bytes = b"",
                      headers: tuple[tuple[str, str], ...] = (), trailers: tuple[tuple[str, str], ...] = (),
                      ) -> Answer:
    """One HTTP/2 request over ``stream`` in cleartext with prior knowledge (the connection
    preface first, as gRPC clients call an ``http://`` address), for ``host`` (``:authority``)."""
    reader, writer = stream
    try:
        return await _h2(reader, writer, host, method, path, body, headers, trailers, scheme="http")
    finally:
        writer.close()


async def http1_request(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], *, host: str,
                        method: str = "GET", path: str = "/", body: bytes = b"",
                        headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    """One HTTP/1.1 request over ``stream`` in cleartext, for ``host``, read to the connection's end."""
    reader, writer = stream
    try:
        return await _http1(reader, writer, host, method, path, body, headers)
    finally:
        writer.close()


async def _http1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, method: str, path: str,
                 body: bytes, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
    fields = "".join(f"{k}: {v}\r\n" for k, v in extra)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{fields}"
                 "Connection: close\r\n\r\n".encode() + body)
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    data = await reader.read()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", data
        while True:
            size_text, _, rest = rest.partition(b"\r\n")
            size = int(size_text, 16)
            if not size:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        data = out
    return Answer(int(lines[0].split()[1]), headers, data)


async def _h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, method: str, path: str,
              body: bytes, extra: tuple[tuple[str, str], ...] = (),
              trailers: tuple[tuple[str, str], ...] = (), *, scheme: str = "https") -> Answer:
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(stream_id, [(":method", method), (":path", path), (":scheme", scheme),
                                  (":authority", host), *((k.lower(), v) for k, v in extra)],
                      end_stream=not body and not trailers)
    pending = memoryview(body)
    trailers_due = bool(trailers)
    answer = Answer(0)
    chunks: list[bytes] = []
    done = False
    while not done:
        while pending and (room := min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)):
            conn.send_data(stream_id, pending[:room].tobytes(), end_stream=len(pending) <= room and not trailers)
            pending = pending[room:]
        if trailers_due and not pending:
            conn.send_headers(stream_id, list(trailers), end_stream=True)
            trailers_due = False
        writer.write(conn.data_to_send())
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the HTTP/2 connection")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                headers = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                           for k, v in event.headers or ()}
                answer.status, answer.headers = int(headers.pop(":status")), headers
                answer.headers_only = event.stream_ended is not None
            elif isinstance(event, h2.events.TrailersReceived):
                answer.trailers = {(k.decode() if isinstance(k, bytes) else k):
                                   (v.decode() if isinstance(v, bytes) else v) for k, v in event.headers or ()}
            elif isinstance(event, h2.events.DataReceived):
                chunks.append(event.data or b"")
                conn.acknowledge_received_data(event.flow_controlled_length or 0, stream_id)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                done = True
    answer.body = b"".join(chunks)
    return answer
