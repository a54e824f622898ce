"""TS2021 control client of the agent: keys, Noise, HTTP/2 over Noise, register, map poll, netmap.

Layers, each depending only on those below it::

    client        register + streaming map poll, reconnect/re-register policy (asyncio)
    compat        which Headscale versions accept this client's capability version
    controlconn   TLS, /key, upgrade, pumping bytes (asyncio)
    session       HTTP/2 over Noise records, early payload (sans-IO)
    upgrade       HTTP/1.1 upgrade request/response (sans-IO)
    noise         Noise IK initiator and record codec (sans-IO)
    mapstream     length-prefixed map message decoder (sans-IO)
    netmap        the netmap model and delta application (pure)
    keys          machine/node/disco keys and their text forms
"""

from .client import CAPABILITY_VERSION, ControlClient, ControlOptions
from .compat import UnsupportedServer, check_server
from .controlconn import ControlConnection
from .errors import (
    ConnectionLost,
    ControlError,
    HandshakeRefused,
    HTTPStatusError,
    KeyRefused,
    NoiseError,
    ProtocolViolation,
    RegistrationError,
)
from .keys import NodeKeys
from .netmap import NetMap

__all__ = [
    "CAPABILITY_VERSION",
    "ConnectionLost",
    "ControlClient",
    "ControlConnection",
    "ControlError",
    "ControlOptions",
    "HTTPStatusError",
    "HandshakeRefused",
    "KeyRefused",
    "NetMap",
    "NodeKeys",
    "NoiseError",
    "ProtocolViolation",
    "RegistrationError",
    "UnsupportedServer",
    "check_server",
]
