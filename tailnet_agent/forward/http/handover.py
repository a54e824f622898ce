"""A connection's way from the listener to its HTTP protocol.

An accepted tailnet connection is held paused (:class:`Held`) until the port runs
``loop.start_tls``; the TLS side keeps what arrives (:class:`Pending`) until the protocol of the
negotiated HTTP version takes over (:func:`hand_over`), so no byte sent with the client's Finished
is lost.
"""

from __future__ import annotations

import asyncio


class Held(asyncio.Protocol):
    """An accepted connection held paused until its TLS handshake starts (and, after it, until
    the protocol for the negotiated HTTP version takes over)."""

    transport: asyncio.Transport | None = None

    def __init__(self) -> None:
        self.made: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()
        if not self.made.done():
            self.made.set_result(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.made.done():
            self.made.set_exception(ConnectionResetError("the connection ended before it was served"))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Pending(asyncio.Protocol):
    """The TLS side until the HTTP protocol takes over: keeps what arrives (``loop.start_tls`` does
    not call ``connection_made`` on it, so it cannot pause; a client may send with its Finished)."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True


def hand_over(tls: asyncio.Transport, pending: Pending, protocol: asyncio.Protocol) -> None:
    """Make ``protocol`` the TLS transport's and give it what :class:`Pending` kept."""
    tls.set_protocol(protocol)
    protocol.connection_made(tls)
    if pending.data:
        protocol.data_received(b"".join(pending.data))
    if pending.eof:
        protocol.eof_received()
