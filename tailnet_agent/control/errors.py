"""Errors of the control client.

The tree::

    ControlError
    ├── NoiseError               the Noise layer failed (bad handshake, tampered or oversized record)
    │   └── HandshakeRefused     the server answered the initiation with an error message
    ├── ProtocolViolation        the server sent something the protocol does not allow
    ├── ConnectionLost           the transport closed or the HTTP/2 connection ended
    ├── HTTPStatusError          a request through the tunnel returned an unexpected status
    └── RegistrationError        the server refused the registration (interactive login, ...)
        └── KeyRefused           the pre-auth key was refused (unknown, expired, used up)

Everything but ``RegistrationError`` is worth a retry with backoff; a registration refusal is
terminal until someone supplies a new key (``KeyRefused``: the client re-reads its key file).
"""

from __future__ import annotations


class ControlError(Exception):
    """Base class of every error raised by ``tailnet_agent.control``."""


class NoiseError(ControlError):
    """The Noise layer failed; the connection can no longer be used."""


class HandshakeRefused(NoiseError):
    """The server sent a cleartext error message (type 3) instead of a handshake response."""


class ProtocolViolation(ControlError):
    """The peer sent bytes the protocol does not allow at this point."""


class ConnectionLost(ControlError):
    """The connection to the control server ended."""


class HTTPStatusError(ControlError):
    """A request through the Noise tunnel returned an unexpected HTTP status."""

    def __init__(self, status: int, body: bytes, *, path: str) -> None:
        super().__init__(f"{path} returned HTTP {status}: {body[:200].decode(errors='replace').strip()}")
        self.status = status
        self.body = body
        self.path = path


class RegistrationError(ControlError):
    """The server refused the registration; retrying with the same key will not help."""


class KeyRefused(RegistrationError):
    """The server refused the pre-auth key (HTTP 401/403 or a register ``Error``)."""
