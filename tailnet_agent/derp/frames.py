"""DERP frame codec (sans-IO): bytes in, frames and messages out, and frame builders.

Wire format (tailscale ``derp/derp.go``): every frame is ``type:u8 | length:u32 big-endian |
payload``; the length excludes the 5-byte header. Keys are raw 32-byte Curve25519 public keys.
The handshake frames carry NaCl boxes (``crypto_box``: X25519 + XSalsa20-Poly1305) laid out as
``nonce(24) || tag(16) || ciphertext``, which is both Go's ``box.Seal(nonce[:], ...)`` output and
PyNaCl's ``Box.encrypt`` output.

Nothing here does I/O; :class:`FrameDecoder` is fed arbitrary chunks and yields whole frames.
The product uses it for the handshake and the control frames it sends (NotePreferred, Ping);
the data plane's Rust codec parses and builds every steady-state frame. The server half and a
Python steady-state codec for tests live in ``hack/derp_codec.py``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import nacl.exceptions
import nacl.public

from .errors import BadServerKey, CryptoError, FrameTooLarge, MalformedFrame

MAGIC = "DERP🔑".encode()
"""Server greeting magic, 8 bytes ``44 45 52 50 f0 9f 94 91`` (``derp.Magic``)."""
KEY_LEN = 32
NONCE_LEN = 24
FRAME_HEADER_LEN = 5
MAX_PACKET_SIZE = 64 << 10
"""Largest packet (payload after the 32-byte key) in SendPacket/RecvPacket: 64 KiB
(``derp.MaxPacketSize``; the server drops the connection above it)."""
MAX_FRAME_LEN = 1 << 20
"""Largest frame a client accepts after the handshake: 1 MiB (``Client.recvTimeout``)."""
MAX_SERVER_KEY_FRAME_LEN = 1 << 10
"""Largest ServerKey frame a client accepts: 1 KiB (``Client.recvServerKey``)."""
MAX_INFO_LEN = 1 << 20
"""Largest boxed ServerInfo/ClientInfo JSON (``derp.MaxInfoLen``)."""
PROTOCOL_VERSION = 2
"""``derp.ProtocolVersion``: 2 means RecvPacket starts with the 32-byte source key."""
PING_LEN = 8

_HEADER = struct.Struct(">BI")


class FrameType(IntEnum):
    """Frame types of ``derp/derp.go`` (mesh-only types are listed for completeness)."""

    SERVER_KEY = 0x01
    CLIENT_INFO = 0x02
    SERVER_INFO = 0x03
    SEND_PACKET = 0x04
    RECV_PACKET = 0x05
    KEEP_ALIVE = 0x06
    NOTE_PREFERRED = 0x07
    PEER_GONE = 0x08
    PEER_PRESENT = 0x09
    FORWARD_PACKET = 0x0A
    WATCH_CONNS = 0x10
    CLOSE_PEER = 0x11
    PING = 0x12
    PONG = 0x13
    HEALTH = 0x14
    RESTARTING = 0x15


# -- frames -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    """One raw frame: its type byte and payload (header stripped)."""

    type: int
    payload: bytes


def encode_frame(frame_type: int, payload: bytes = b"") -> bytes:
    """Header plus payload. Raises ``ValueError`` above ``MAX_FRAME_LEN``."""
    if len(payload) > MAX_FRAME_LEN:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_FRAME_LEN}")
    return _HEADER.pack(frame_type, len(payload)) + payload


class FrameDecoder:
    """Reassembles frames from chunks of a byte stream.

    ``max_frame_len`` (bytes, default ``MAX_FRAME_LEN`` = 1 MiB) is checked as soon as a header is
    complete, so an oversized frame is rejected before its payload is buffered. After
    :class:`FrameTooLarge` the decoder is unusable (the stream cannot be resynchronised).
    """

    def __init__(self, *, max_frame_len: int = MAX_FRAME_LEN) -> None:
        self.max_frame_len = max_frame_len
        self._buf = bytearray()
        self._failed: FrameTooLarge | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return every frame completed by it, in order."""
        self.push(data)
        frames: list[Frame] = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def push(self, data: bytes) -> None:
        """Add ``data`` without extracting frames (take them with :meth:`next_frame`)."""
        if self._failed is not None:
            raise self._failed
        self._buf += data

    def next_frame(self) -> Frame | None:
        """Pop one complete frame from the buffer, or None if more bytes are needed."""
        if self._failed is not None:
            raise self._failed
        if len(self._buf) < FRAME_HEADER_LEN:
            return None
        frame_type, length = _HEADER.unpack_from(self._buf)
        if length > self.max_frame_len:
            self._failed = FrameTooLarge(frame_type, length, self.max_frame_len)
            raise self._failed
        end = FRAME_HEADER_LEN + length
        if len(self._buf) < end:
            return None
        frame = Frame(frame_type, bytes(self._buf[FRAME_HEADER_LEN:end]))
        del self._buf[:end]
        return frame

    def pending(self) -> bytes:
        """Buffered bytes that do not yet form a whole frame."""
        return bytes(self._buf)


# -- NaCl box ----------------------------------------------------------------------------------------


def seal(private_key: bytes, peer_public: bytes, message: bytes) -> bytes:
    """``nonce || box`` from ``private_key`` to ``peer_public`` with a random nonce (``SealTo``).

    Raises :class:`CryptoError` for a peer key no box can be made with (a low-order point)."""
    try:
        box = nacl.public.Box(nacl.public.PrivateKey(private_key), nacl.public.PublicKey(peer_public))
    except nacl.exceptions.RuntimeError as exc:
        raise CryptoError(f"no NaCl box can be made with peer key {peer_public.hex()[:5]}") from exc
    return bytes(box.encrypt(message))


def open_box(private_key: bytes, peer_public: bytes, sealed: bytes) -> bytes:
    """Inverse of :func:`seal` (``OpenFrom``); raises :class:`CryptoError`."""
    if len(sealed) < NONCE_LEN:
        raise CryptoError("sealed message shorter than the 24-byte nonce")
    try:
        # Box() fails on a low-order peer key (all-zero shared secret) with nacl's RuntimeError.
        box = nacl.public.Box(nacl.public.PrivateKey(private_key), nacl.public.PublicKey(peer_public))
        return bytes(box.decrypt(sealed))
    except (nacl.exceptions.CryptoError, nacl.exceptions.RuntimeError) as exc:
        raise CryptoError(f"NaCl box did not open with peer key {peer_public.hex()[:5]}") from exc


def public_key_of(private_key: bytes) -> bytes:
    """The raw X25519 public key of a raw 32-byte private key."""
    return bytes(nacl.public.PrivateKey(private_key).public_key)


# -- handshake payloads -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientInfo:
    """JSON sealed in FrameClientInfo (``derp.ClientInfo``); no mesh key (regular client)."""

    version: int = PROTOCOL_VERSION
    """Sent as ``"version"``. Default 2."""
    can_ack_pings: bool = True
    """Sent as ``"CanAckPings"``: we answer every Ping with a Pong. Default true."""
    is_prober: bool = False
    """Sent as ``"IsProber"`` only when true."""

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {}
        if self.version:
            doc["version"] = self.version
        doc["CanAckPings"] = self.can_ack_pings
        if self.is_prober:
            doc["IsProber"] = True
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ClientInfo:
        doc = _json_object(raw, "ClientInfo")
        return cls(version=_json_int(doc, "version", "ClientInfo"), can_ack_pings=bool(doc.get("CanAckPings")),
                   is_prober=bool(doc.get("IsProber")))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerInfo:
    """JSON sealed in FrameServerInfo (``derp.ServerInfo``). Zero rates mean unspecified."""

    version: int = 0
    token_bucket_bytes_per_second: int = 0
    token_bucket_bytes_burst: int = 0

    def to_json(self) -> bytes:
        doc = {"version": self.version, "TokenBucketBytesPerSecond": self.token_bucket_bytes_per_second,
               "TokenBucketBytesBurst": self.token_bucket_bytes_burst}
        return json.dumps({k: v for k, v in doc.items() if v}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ServerInfo:
        doc = _json_object(raw, "ServerInfo")
        return cls(version=_json_int(doc, "version", "ServerInfo"),
                   token_bucket_bytes_per_second=_json_int(doc, "TokenBucketBytesPerSecond", "ServerInfo"),
                   token_bucket_bytes_burst=_json_int(doc, "TokenBucketBytesBurst", "ServerInfo"))


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise MalformedFrame(f"{what} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise MalformedFrame(f"{what} JSON is not an object")
    return doc


def _json_int(doc: dict[str, Any], name: str, what: str) -> int:
    """An integer member; absent or null is 0, anything but an integer is a malformed frame."""
    value = doc.get(name)
    if value is None or value is False:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedFrame(f"{what}.{name} is not an integer: {str(value)[:40]!r}")
    return value


def parse_server_key(frame: Frame) -> bytes:
    """The server's public key from its greeting. Trailing bytes after the key are ignored
    ("for future-proofing", as ``recvServerKey`` does)."""
    if frame.type != FrameType.SERVER_KEY:
        raise BadServerKey(f"expected ServerKey frame (0x01), got 0x{frame.type:02x}")
    if len(frame.payload) < len(MAGIC) + KEY_LEN or not frame.payload.startswith(MAGIC):
        raise BadServerKey("invalid server greeting: missing DERP magic or short key")
    return frame.payload[len(MAGIC):len(MAGIC) + KEY_LEN]


def encode_client_info(private_key: bytes, server_public: bytes, info: ClientInfo | None = None) -> bytes:
    """FrameClientInfo: our public key + ``nonce || box(info JSON)`` to the server key."""
    sealed = seal(private_key, server_public, (info or ClientInfo()).to_json())
    return encode_frame(FrameType.CLIENT_INFO, public_key_of(private_key) + sealed)


def parse_server_info(private_key: bytes, server_public: bytes, frame: Frame) -> ServerInfo:
    """Open and decode FrameServerInfo."""
    if frame.type != FrameType.SERVER_INFO:
        raise MalformedFrame(f"expected ServerInfo frame (0x03), got 0x{frame.type:02x}")
    if len(frame.payload) < NONCE_LEN:
        raise MalformedFrame("short ServerInfo frame")
    if len(frame.payload) > NONCE_LEN + MAX_INFO_LEN:
        raise MalformedFrame("long ServerInfo frame")
    return ServerInfo.from_json(open_box(private_key, server_public, frame.payload))


# -- steady-state frames ------------------------------------------------------------------------------


def encode_note_preferred(preferred: bool) -> bytes:
    """FrameNotePreferred: one byte, 1 if this is the client's home region (server stats only)."""
    return encode_frame(FrameType.NOTE_PREFERRED, b"\x01" if preferred else b"\x00")


def encode_ping(data: bytes) -> bytes:
    """FramePing with an 8-byte payload to be echoed back."""
    return encode_frame(FrameType.PING, _check_ping(data))


def _check_ping(data: bytes) -> bytes:
    if len(data) != PING_LEN:
        raise ValueError(f"ping data has {PING_LEN} bytes, not {len(data)}")
    return data
