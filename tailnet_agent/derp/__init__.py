"""DERP client of the agent: relay packets through the tailnet's DERP servers.

Layers, each depending only on those below it::

    supervisor   keep a connection to the home region up; backoff; NotePreferred on reconnect (asyncio)
    connection   TLS, HTTP upgrade, handshake I/O, the raw byte pump for the Rust codec (asyncio)
    handshake    upgrade request/101 response, ServerKey -> ClientInfo -> ServerInfo (sans-IO)
    frames       handshake and control frames, NaCl box sealing (sans-IO)
    errors       the exception tree

Keys are raw 32-byte Curve25519 keys; private keys are never logged.
"""

from .connection import DerpConnection, DerpNode, DerpNodeLike, tls_context
from .errors import (
    BadServerKey,
    ConnectionLost,
    CryptoError,
    DerpConnectError,
    DerpError,
    DerpTLSError,
    FrameTooLarge,
    HandshakeRejected,
    MalformedFrame,
    PacketTooLarge,
    ProtocolError,
    UpgradeRefused,
)
from .frames import MAX_PACKET_SIZE, ClientInfo, FrameDecoder, FrameType, ServerInfo
from .handshake import ClientHandshake, HandshakeState
from .supervisor import ConnectionHandler, DerpSupervisor

__all__ = [
    "MAX_PACKET_SIZE",
    "BadServerKey",
    "ClientHandshake",
    "ClientInfo",
    "ConnectionHandler",
    "ConnectionLost",
    "CryptoError",
    "DerpConnectError",
    "DerpConnection",
    "DerpError",
    "DerpNode",
    "DerpNodeLike",
    "DerpSupervisor",
    "DerpTLSError",
    "FrameDecoder",
    "FrameTooLarge",
    "FrameType",
    "HandshakeRejected",
    "HandshakeState",
    "MalformedFrame",
    "PacketTooLarge",
    "ProtocolError",
    "ServerInfo",
    "UpgradeRefused",
    "tls_context",
]
