"""Test tooling for DERP: the server half of the handshake and a Python steady-state codec.

The agent speaks DERP's steady state through the data plane's Rust codec only; this module is
what tests need besides it: a fake server (``encode_server_key``, ``parse_client_info``,
``encode_server_info``, ``encode_recv_packet``, ...), the server-to-client message types with
:func:`parse_message`, and :func:`recv_message` / :func:`recv_packet` / :func:`send_packet` on a
:class:`~tailnet_agent.derp.DerpConnection` in its raw mode (answering Pings with Pongs, as
Go's client does). Not shipped in the product.
"""

from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass, field
from enum import IntEnum

import structlog

from tailnet_agent.derp import DerpConnection, MalformedFrame, PacketTooLarge
from tailnet_agent.derp.frames import (
    KEY_LEN,
    MAGIC,
    MAX_PACKET_SIZE,
    NONCE_LEN,
    PING_LEN,
    PROTOCOL_VERSION,
    ClientInfo,
    Frame,
    FrameDecoder,
    FrameType,
    ServerInfo,
    _check_ping,
    encode_frame,
    open_box,
    seal,
)

log = structlog.get_logger("tests.derp")


class PeerGoneReason(IntEnum):
    """``derp.PeerGoneReasonType``."""

    DISCONNECTED = 0x00
    NOT_HERE = 0x01



def _check_key(key: bytes) -> None:
    if len(key) != KEY_LEN:
        raise ValueError(f"a public key has {KEY_LEN} bytes, not {len(key)}")



def encode_server_key(server_public: bytes) -> bytes:
    """FrameServerKey: magic + 32-byte key (server side; for tests)."""
    _check_key(server_public)
    return encode_frame(FrameType.SERVER_KEY, MAGIC + server_public)


def parse_client_info(server_private: bytes, frame: Frame) -> tuple[bytes, ClientInfo]:
    """Server side (for tests): the client's public key and its opened ClientInfo."""
    if frame.type != FrameType.CLIENT_INFO:
        raise MalformedFrame(f"expected ClientInfo frame (0x02), got 0x{frame.type:02x}")
    if len(frame.payload) < KEY_LEN + NONCE_LEN:
        raise MalformedFrame("short ClientInfo frame")
    client_public = frame.payload[:KEY_LEN]
    return client_public, ClientInfo.from_json(open_box(server_private, client_public, frame.payload[KEY_LEN:]))


def encode_server_info(server_private: bytes, client_public: bytes, info: ServerInfo | None = None) -> bytes:
    """FrameServerInfo: ``nonce || box(info JSON)`` to the client (server side; for tests)."""
    info = info or ServerInfo(version=PROTOCOL_VERSION)
    return encode_frame(FrameType.SERVER_INFO, seal(server_private, client_public, info.to_json()))


def encode_send_packet(dst_public: bytes, packet: bytes) -> bytes:
    """FrameSendPacket: 32-byte destination key + packet (at most ``MAX_PACKET_SIZE``)."""
    _check_key(dst_public)
    if len(packet) > MAX_PACKET_SIZE:
        raise PacketTooLarge(f"packet too big: {len(packet)} bytes > {MAX_PACKET_SIZE}")
    return encode_frame(FrameType.SEND_PACKET, dst_public + packet)


def encode_recv_packet(src_public: bytes, packet: bytes) -> bytes:
    """FrameRecvPacket (protocol v2): 32-byte source key + packet (server side; for tests)."""
    _check_key(src_public)
    if len(packet) > MAX_PACKET_SIZE:
        raise PacketTooLarge(f"packet too big: {len(packet)} bytes > {MAX_PACKET_SIZE}")
    return encode_frame(FrameType.RECV_PACKET, src_public + packet)


def encode_pong(data: bytes) -> bytes:
    """FramePong echoing the 8 bytes of a Ping."""
    return encode_frame(FrameType.PONG, _check_ping(data))


def encode_keep_alive() -> bytes:
    """FrameKeepAlive (server to client; no payload)."""
    return encode_frame(FrameType.KEEP_ALIVE)


def encode_health(problem: str) -> bytes:
    """FrameHealth (server to client; for tests): "" clears the problem."""
    return encode_frame(FrameType.HEALTH, problem.encode())


# -- server-to-client messages ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecvPacket:
    """A packet relayed to us; ``source`` is the sender's node public key."""

    source: bytes
    payload: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Sent by the server at least every 60 s (plus jitter); needs no answer."""


@dataclass(frozen=True, slots=True)
class Ping:
    """The peer asks for a Pong with the same 8 bytes."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    """The answer to a Ping we sent."""

    data: bytes


@dataclass(frozen=True, slots=True)
class PeerGone:
    """A peer that sent to us is gone from this server (``reason`` is a :class:`PeerGoneReason`)."""

    peer: bytes
    reason: int = PeerGoneReason.DISCONNECTED


@dataclass(frozen=True, slots=True)
class Health:
    """Connection health; an empty ``problem`` means healthy again."""

    problem: str


@dataclass(frozen=True, slots=True)
class Restarting:
    """The server is restarting: reconnect after ``reconnect_in`` seconds, trying for ``try_for`` seconds."""

    reconnect_in: float
    try_for: float


@dataclass(frozen=True, slots=True)
class UnknownFrame:
    """A frame type this client does not interpret (clients must skip these)."""

    type: int
    payload: bytes = field(repr=False)


Message = RecvPacket | KeepAlive | Ping | Pong | PeerGone | Health | Restarting | ServerInfo | UnknownFrame


def parse_message(frame: Frame) -> Message:
    """Interpret a steady-state server frame; raises :class:`MalformedFrame` for short ones.

    ServerInfo is returned undecrypted as :class:`UnknownFrame`; use :func:`parse_server_info`.
    """
    t, p = frame.type, frame.payload
    if t == FrameType.RECV_PACKET:
        if len(p) < KEY_LEN:
            raise MalformedFrame("short RecvPacket frame")
        return RecvPacket(p[:KEY_LEN], p[KEY_LEN:])
    if t == FrameType.KEEP_ALIVE:
        return KeepAlive()
    if t in (FrameType.PING, FrameType.PONG):
        if len(p) < PING_LEN:
            raise MalformedFrame(f"short {FrameType(t).name} frame")
        return Ping(p[:PING_LEN]) if t == FrameType.PING else Pong(p[:PING_LEN])
    if t == FrameType.PEER_GONE:
        if len(p) < KEY_LEN:
            raise MalformedFrame("short PeerGone frame")
        return PeerGone(p[:KEY_LEN], p[KEY_LEN] if len(p) > KEY_LEN else PeerGoneReason.DISCONNECTED)
    if t == FrameType.HEALTH:
        return Health(p.decode(errors="replace"))
    if t == FrameType.RESTARTING:
        if len(p) < 8:
            raise MalformedFrame("short Restarting frame")
        reconnect_ms, try_ms = struct.unpack_from(">II", p)
        return Restarting(reconnect_ms / 1000, try_ms / 1000)
    return UnknownFrame(t, p)


# -- a steady-state codec over a raw DerpConnection ---------------------------------------------------

_decoders: weakref.WeakKeyDictionary[DerpConnection, FrameDecoder] = weakref.WeakKeyDictionary()


async def send_packet(conn: DerpConnection, dst_key: bytes, payload: bytes) -> None:
    """Relay ``payload`` (at most 64 KiB) to the node with public key ``dst_key``."""
    conn.write(encode_send_packet(dst_key, payload))
    await conn.drain()


async def recv_message(conn: DerpConnection) -> Message:
    """The next server message. Pings are answered with a Pong before they are returned;
    malformed frames are logged and skipped, as Go's client does."""
    decoder = _decoders.setdefault(conn, FrameDecoder())
    while True:
        frame = decoder.next_frame()
        if frame is None:
            decoder.push(await conn.read_chunk())
            continue
        try:
            message = parse_message(frame)
        except MalformedFrame as exc:
            log.warning("derp: skipping malformed frame", error=str(exc))
            continue
        if isinstance(message, Ping):
            conn.write(encode_pong(message.data))
            await conn.drain()
        return message


async def recv_packet(conn: DerpConnection) -> tuple[bytes, bytes]:
    """The next relayed packet as ``(source_key, payload)``; other messages are skipped."""
    while True:
        message = await recv_message(conn)
        if isinstance(message, RecvPacket):
            return message.source, message.payload
