"""Sans-IO TS2021 session: HTTP/2 (h2c with prior knowledge) inside Noise records.

After the handshake the server may first send an *early payload* (``ts2021/conn.go``): the magic
``\\xff\\xff\\xffTS``, a u32 big-endian length and JSON ``tailcfg.EarlyNoise``
(``{"nodeKeyChallenge":"chalpub:..."}``); Headscale always sends one (``hscontrol/noise.go earlyNoise``).
Everything after it is plain HTTP/2 as a client with prior knowledge, requests addressed to
``https://<host><path>`` (``ts2021/client.go``).

:class:`ControlSession` takes wire bytes and returns typed events, and queues wire bytes for
``data_to_send``. It acknowledges every received DATA frame so a long map poll never stalls on
HTTP/2 flow control, and it sends request bodies as the peer's window allows.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from .errors import ProtocolViolation
from .noise import NoiseTransport

EARLY_PAYLOAD_MAGIC = b"\xff\xff\xffTS"
EARLY_HEADER_LEN = 9  # also the size of an HTTP/2 frame header
MAX_EARLY_PAYLOAD = 10 << 20


@dataclass(frozen=True, kw_only=True)
class EarlyPayload:
    """The server's early payload (``tailcfg.EarlyNoise``)."""

    node_key_challenge: str
    """``chalpub:<hex>``; unused by the agent (it has no network lock)."""


@dataclass(frozen=True, kw_only=True)
class ResponseStarted:
    stream_id: int
    status: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ResponseData:
    stream_id: int
    data: bytes


@dataclass(frozen=True, kw_only=True)
class ResponseEnded:
    stream_id: int


@dataclass(frozen=True, kw_only=True)
class StreamReset:
    stream_id: int
    error_code: int


@dataclass(frozen=True, kw_only=True)
class ConnectionEnded:
    """The server sent GOAWAY; no new requests are possible on this session."""

    error_code: int
    last_stream_id: int


Event = EarlyPayload | ResponseStarted | ResponseData | ResponseEnded | StreamReset | ConnectionEnded


class ControlSession:
    """HTTP/2 client over a :class:`NoiseTransport`. ``host`` is the ``:authority`` of requests."""

    def __init__(self, transport: NoiseTransport, *, host: str) -> None:
        self._noise = transport
        self._host = host
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._early = bytearray()
        self._early_done = False
        self._bodies: dict[int, memoryview] = {}
        self._h2.initiate_connection()

    # -- inputs ---------------------------------------------------------------------------------

    def send_request(self, method: str, path: str, body: bytes = b"",
                     headers: tuple[tuple[str, str], ...] = ()) -> int:
        """Queue a request; returns its stream id. The body goes out as flow control allows."""
        stream_id: int = self._h2.get_next_available_stream_id()
        request_headers = [(":method", method), (":scheme", "https"), (":authority", self._host),
                           (":path", path)]
        if body:
            request_headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
        request_headers += list(headers)
        self._h2.send_headers(stream_id, request_headers, end_stream=not body)
        if body:
            self._bodies[stream_id] = memoryview(body)
            self._send_bodies()
        return stream_id

    def cancel(self, stream_id: int) -> None:
        """Reset a stream (e.g. a map poll nobody reads any more); unknown or closed ids are ignored."""
        self._bodies.pop(stream_id, None)
        with contextlib.suppress(h2.exceptions.ProtocolError):  # includes StreamClosedError
            self._h2.reset_stream(stream_id)

    def close(self) -> None:
        self._h2.close_connection()

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed ciphertext from the wire; returns what happened."""
        plaintext = self._noise.receive_data(data)
        events: list[Event] = []
        if not self._early_done:
            self._early += plaintext
            early, plaintext = self._take_early_payload()
            if early is not None:
                events.append(early)
            if not self._early_done:
                return events
        if not plaintext:
            return events
        try:
            h2_events = self._h2.receive_data(plaintext)
        except h2.exceptions.ProtocolError as exc:
            raise ProtocolViolation(f"HTTP/2: {exc}") from exc
        for ev in h2_events:
            events.extend(self._translate(ev))
        return events

    # -- outputs --------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Ciphertext to write to the wire (may be empty). Does no I/O."""
        plaintext = self._h2.data_to_send()
        return self._noise.encrypt(plaintext) if plaintext else b""

    # -- internals ------------------------------------------------------------------------------

    def _take_early_payload(self) -> tuple[EarlyPayload | None, bytes]:
        if len(self._early) < EARLY_HEADER_LEN:
            return None, b""
        if bytes(self._early[:5]) != EARLY_PAYLOAD_MAGIC:
            self._early_done = True  # plain HTTP/2 from the first byte
            return None, bytes(self._early)
        (length,) = struct.unpack_from(">I", self._early, 5)
        if length > MAX_EARLY_PAYLOAD:
            raise ProtocolViolation(f"early payload of {length} bytes is too large")
        if len(self._early) < EARLY_HEADER_LEN + length:
            return None, b""
        raw = bytes(self._early[EARLY_HEADER_LEN:EARLY_HEADER_LEN + length])
        rest = bytes(self._early[EARLY_HEADER_LEN + length:])
        self._early.clear()
        self._early_done = True
        try:
            doc: Any = json.loads(raw)
        except ValueError as exc:
            raise ProtocolViolation("early payload is not JSON") from exc
        challenge = doc.get("nodeKeyChallenge", "") if isinstance(doc, dict) else ""
        return EarlyPayload(node_key_challenge=str(challenge)), rest

    def _translate(self, ev: h2.events.Event) -> list[Event]:
        if isinstance(ev, h2.events.ResponseReceived):
            headers = {str(k): str(v) for k, v in ev.headers or []}
            status = int(headers.pop(":status", "0"))
            out: list[Event] = [ResponseStarted(stream_id=ev.stream_id or 0, status=status, headers=headers)]
            if ev.stream_ended is not None:
                out.append(ResponseEnded(stream_id=ev.stream_id or 0))
            return out
        if isinstance(ev, h2.events.DataReceived):
            stream_id = ev.stream_id or 0
            if ev.flow_controlled_length:
                # Without this the server stops after 64 KiB and the map poll hangs.
                self._h2.acknowledge_received_data(ev.flow_controlled_length, stream_id)
            out = [ResponseData(stream_id=stream_id, data=ev.data or b"")]
            if ev.stream_ended is not None:
                out.append(ResponseEnded(stream_id=stream_id))
            return out
        if isinstance(ev, h2.events.StreamEnded):
            return [ResponseEnded(stream_id=ev.stream_id or 0)]
        if isinstance(ev, h2.events.StreamReset):
            self._bodies.pop(ev.stream_id or 0, None)
            return [StreamReset(stream_id=ev.stream_id or 0, error_code=int(ev.error_code or 0))]
        if isinstance(ev, h2.events.ConnectionTerminated):
            return [ConnectionEnded(error_code=int(ev.error_code or 0), last_stream_id=ev.last_stream_id or 0)]
        if isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._send_bodies()
        return []

    def _send_bodies(self) -> None:
        for stream_id, body in list(self._bodies.items()):
            while body:
                window = min(self._h2.local_flow_control_window(stream_id), self._h2.max_outbound_frame_size)
                if window <= 0:
                    break
                chunk, body = body[:window], body[window:]
                self._h2.send_data(stream_id, bytes(chunk), end_stream=not body)
            if body:
                self._bodies[stream_id] = body
            else:
                del self._bodies[stream_id]
