"""A connection's way from the listener to its HTTP protocol.

An accepted tailnet connection is held paused (:class:`Held`) until the port runs
``loop.start_tls``; the TLS side keeps what arrives (:class:`Pending`) until the protocol of the
negotiated HTTP version takes over (:func:`hand_over`), so no byte sent with the client's Finished
is lost. A plaintext connection has no ALPN: its first bytes tell (:class:`Sniffing`), the HTTP/2
preface (prior knowledge) or anything else (HTTP/1.1), and are handed over the same way.
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


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What a client of HTTP/2 with prior knowledge sends first (RFC 9113 3.4); no HTTP/1.1 request
begins so (``PRI`` is no method)."""


class Sniffing(Pending):
    """A plaintext connection until its first bytes say which HTTP it speaks (:attr:`http2`):
    keeps what arrives (as :class:`Pending`) until it is the HTTP/2 preface, or is not its
    beginning, or the client ends its side; then reading pauses until the protocol takes over."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.transport = transport
        self.http2: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        """True for the HTTP/2 preface, False for anything else; None if the connection ended first."""
        self.lost = False
        """The connection ended (before or after the first bytes told): nothing to hand over."""
        transport.set_protocol(self)
        transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        head = b"".join(self.data)[:len(HTTP2_PREFACE)]
        if head == HTTP2_PREFACE or not HTTP2_PREFACE.startswith(head):
            self._decide(head == HTTP2_PREFACE)
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        super().eof_received()
        self._decide(False)  # no pause: the transport reads no more after EOF, and resuming would read it again
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._decide(None)

    def _decide(self, http2: bool | None) -> None:
        if not self.http2.done():
            self.http2.set_result(http2)


def hand_over(transport: asyncio.Transport, pending: Pending, protocol: asyncio.Protocol) -> None:
    """Make ``protocol`` the transport's (TLS, or plaintext with reading paused), give it what
    :class:`Pending` kept, and let the transport read on."""
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if pending.data:
        protocol.data_received(b"".join(pending.data))
    if pending.eof:
        protocol.eof_received()
    if transport.is_reading() is False and not transport.is_closing():
        transport.resume_reading()
