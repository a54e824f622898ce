"""Copy bytes both ways between two transports with half-close (Go's io.Copy plus CloseWrite).

:class:`Splice` joins two protocols, ``a`` and ``b``: what one receives is written straight to the
other's transport (no stream buffers, no copies in Python), and flow control is passed across: when
one transport's write buffer is full, the other stops reading until it drains. When one side
reaches EOF, ``write_eof`` goes to the other and the opposite direction keeps copying until it ends
too; then both are closed. If either connection fails (a reset, a write to a lost connection), the
other is aborted and :attr:`Splice.done` raises the error.

``a`` may be attached before ``b`` exists (an accepted client while its upstream is being dialled):
it does not read until :meth:`Splice.join` is called.

:attr:`Splice.eof_gate` (optional) is awaited before ``a``'s EOF is passed on to ``b`` while ``b``
has not reached EOF itself (egress opens its half-close pin there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Count = Callable[[int], None]


def _ignore(_: int) -> None:
    pass


class _End(asyncio.Protocol):
    """One end of a splice: what arrives here goes to the other end's transport."""

    def __init__(self, splice: Splice, count: Count) -> None:
        self._splice = splice
        self._count = count
        self.other: _End
        self.transport: asyncio.Transport | None = None
        self.made: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()
        """Set by ``connection_made``: an accepted connection's task may run before it (asyncio's
        server calls it on the loop's next turn), so it waits here for its peer's address."""
        self.eof = False
        self.lost = False
        self.early: list[bytes] = []
        """Bytes that arrived before the join, written to the other end by it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.made.done():
            self.made.set_result(transport)
        if not self._splice.joined:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        if not self._splice.joined:
            # Some CPython releases (3.11.2, Debian bookworm's and so the image's) register a socket
            # transport's reader after connection_made even when it paused reading there, so the
            # first bytes can come before the join: keep them, and pause now (the reader is
            # registered by this time). Dropping them was the in-cluster egress hang.
            self.early.append(data)
            if self.transport is not None:
                self.transport.pause_reading()
            return
        out = self.other.transport
        if out is None or self.other.lost:
            return
        out.write(data)
        self._count(len(data))

    def flush_early(self) -> None:
        """Write what arrived before the join to the other end."""
        early, self.early = self.early, []
        for data in early:
            self.data_received(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self._splice.joined:
            self._splice.forward_eof(self)
        return True  # keep writing the other direction

    def pause_writing(self) -> None:
        if (src := self.other.transport) is not None and not self.other.lost:
            src.pause_reading()

    def resume_writing(self) -> None:
        if (src := self.other.transport) is not None and not self.other.lost:
            src.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._splice.end_lost(self, exc)


class Splice:
    """Two joined protocols; await :attr:`done` for the end of both directions."""

    def __init__(self, *, count_a_to_b: Count = _ignore, count_b_to_a: Count = _ignore) -> None:
        self.a = _End(self, count_a_to_b)
        self.b = _End(self, count_b_to_a)
        self.a.other, self.b.other = self.b, self.a
        self.joined = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.eof_gate: Callable[[], Awaitable[None]] | None = None
        """Awaited before ``a``'s EOF goes to ``b`` (only while ``b`` still sends); must not raise."""
        self._gate: asyncio.Task[None] | None = None

    def join(self) -> None:
        """Both ends are connected: start copying (and pass on an EOF that came early)."""
        self.joined = True
        for end in (self.a, self.b):
            if end.lost:
                self.end_lost(end, None)
                return
        for end in (self.a, self.b):
            end.flush_early()
            if end.eof:
                self.forward_eof(end)
            elif end.transport is not None:
                end.transport.resume_reading()

    def abort(self) -> None:
        if self._gate is not None:
            self._gate.cancel()
        for end in (self.a, self.b):
            if end.transport is not None:
                end.transport.abort()

    def forward_eof(self, end: _End) -> None:
        if end is self.a and self.eof_gate is not None and self._gate is None and not self.b.eof:
            self._gate = asyncio.get_running_loop().create_task(self._forward_eof_after_gate(self.eof_gate))
            return
        out = end.other.transport
        if out is not None and not end.other.lost and out.can_write_eof() and not out.is_closing():
            try:
                out.write_eof()
            except OSError as exc:  # the other side is already gone (reset or closed)
                self.abort()
                if not self.done.done():
                    self.done.set_exception(exc)
                return
        if self.a.eof and self.b.eof:
            for side in (self.a, self.b):
                if side.transport is not None:
                    side.transport.close()  # flushes what is still queued first

    async def _forward_eof_after_gate(self, gate: Callable[[], Awaitable[None]]) -> None:
        try:
            await gate()
        finally:
            if not self.done.done():
                self.forward_eof(self.a)

    def end_lost(self, end: _End, exc: Exception | None) -> None:
        other = end.other
        if exc is not None:
            if other.transport is not None:
                other.transport.abort()
            if not self.done.done():
                self.done.set_exception(exc if isinstance(exc, OSError) else ConnectionError(str(exc)))
            return
        if self.joined and not other.lost and other.transport is not None:
            other.transport.close()
        if (other.lost or other.transport is None) and not self.done.done():
            self.done.set_result(None)
