"""asyncio streams over the data plane's userspace TCP handles.

The native :class:`~tailnet_agent._native.DataPlane` speaks in handles and events; this module turns
them into a standard :class:`asyncio.Transport` so that :class:`asyncio.StreamReaderProtocol`,
:class:`asyncio.StreamReader` and :class:`asyncio.StreamWriter` work unchanged:

* ``write`` queues bytes and hands them to ``tcp_send``; what the native send buffer does not take
  stays here, and above the high-water mark the protocol is paused (``pause_writing``) until a
  ``Writable`` event drains it below the low-water mark;
* ``write_eof`` sends FIN after everything queued (half-close) while reading continues; the peer's FIN
  reaches ``protocol.eof_received()`` (``PeerClosed``), and the transport stays open for writing
  when the protocol asks for it, as StreamReaderProtocol does;
* ``close`` flushes, then releases the handle (FIN); ``abort`` resets at once.

:class:`StreamTable` owns every handle of one node: it dispatches events to transports, resolves
pending dials and accepts on tailnet listeners. It never polls the data plane itself: each call that
produces work calls ``wake()`` and the node's pump polls (sans-IO core, thin asyncio shell).

Errors of a dial (all ``OSError``; ``reason`` is the metrics label)::

    OSError
    └── DialError           (``reason``, ``code``; str() is the message)
        ├── NoRouteError        (EHOSTUNREACH)  no peer or accepted route covers the address   reason="no_route"
        ├── DialRefusedError    (also a ConnectionRefusedError) the peer answered with RST     reason="refused"
        ├── DialTimeoutError    (also a TimeoutError) no SYN-ACK in time (packet filter?)      reason="timeout"
        └── UnknownNameError    (node.py, ENOENT) neither an IP nor a MagicDNS name            reason="unknown_name"
"""

from __future__ import annotations

import asyncio
import collections
import errno
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from tailnet_agent import _native as nat

log = structlog.get_logger("agent.streams")

DEFAULT_HIGH_WATER = 1 << 20
"""Bytes queued in Python above which ``pause_writing`` is called: 1 MiB."""
SEND_CHUNK = 256 << 10
"""Largest single ``tcp_send``: 256 KiB."""
RECV_CHUNK = 256 << 10
"""Largest single ``tcp_recv``: 256 KiB."""
DEFAULT_LIMIT = 1 << 20
"""StreamReader buffer limit: 1 MiB (reading pauses above twice this)."""

ClientConnected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Runs a coroutine as a task owned by the node's TaskGroup (second argument: task name)."""


# -- dial errors ----------------------------------------------------------------------------------

class DialError(OSError):
    """A dial that failed for a reason the agent names: ``reason`` is the metrics label and
    ``code`` the errno; ``str()`` is the message alone."""

    reason = "error"
    code = 0

    def __init__(self, message: str) -> None:
        super().__init__(self.code, message)

    def __str__(self) -> str:
        return str(self.strerror)


class NoRouteError(DialError):
    reason = "no_route"
    code = errno.EHOSTUNREACH


class DialRefusedError(DialError, ConnectionRefusedError):
    reason = "refused"
    code = errno.ECONNREFUSED


class DialTimeoutError(DialError, TimeoutError):
    reason = "timeout"
    code = errno.ETIMEDOUT


def dial_error(reason: str, host: str, port: int) -> OSError:
    """Map a native ``DialFailed`` reason to the exception raised by ``open_connection``."""
    if reason.startswith("no route"):
        return NoRouteError(f"no route to {host}: no peer or accepted route covers it")
    if "timed out" in reason:
        return DialTimeoutError(f"connection to {host}:{port} timed out (dropped by the packet filter?)")
    if "refused" in reason:
        return DialRefusedError(f"connection to {host}:{port} refused: nothing listens there")
    return OSError(f"connection to {host}:{port} failed: {reason}")


def error_reason(exc: BaseException) -> str:
    """Metrics label of a dial error: no_route, refused, timeout, not_found (name) or error."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "error"


# -- the transport --------------------------------------------------------------------------------

class TailnetTransport(asyncio.Transport):
    """One TCP connection of the data plane as an asyncio transport. Created by :class:`StreamTable`.

    ``loop.start_tls`` accepts it: it passes data to buffered protocols (asyncio's TLS) too."""

    _start_tls_compatible = True

    def __init__(self, table: StreamTable, handle: int, protocol: asyncio.BaseProtocol, *,
                 extra: dict[str, Any]) -> None:
        super().__init__(extra)
        self._table = table
        self._dp = table.dataplane
        self.handle = handle
        self._protocol = protocol
        self._buffer: collections.deque[memoryview] = collections.deque()
        """Queued writes, oldest first; the first may be partly sent already."""
        self._buffered = 0
        self._high = DEFAULT_HIGH_WATER
        self._low = DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._reading_paused = False
        self._readable_pending = False
        self._eof_requested = False
        self._closing = False
        self._released = False
        """The native handle is gone (released by us or by Closed/Reset)."""
        self._lost = False

    # -- asyncio.BaseTransport --

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def close(self) -> None:
        """Flush what is queued, then release the handle (FIN) and call ``connection_lost(None)``."""
        if self._closing:
            return
        self._closing = True
        self._reading_paused = True
        if not self._buffer or self._released:
            self._release(abort=False)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    # -- asyncio.ReadTransport --

    def is_reading(self) -> bool:
        return not self._reading_paused and not self.is_closing()

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        if self._readable_pending:
            # Not inline: StreamReader resumes from inside read(); deliver on the next loop turn.
            self._table.loop.call_soon(self._read_all)

    # -- asyncio.WriteTransport --

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return self._buffered

    def write(self, data: bytes | bytearray | memoryview[int]) -> None:
        if self._eof_requested:
            raise RuntimeError("cannot write after write_eof()")
        if not data or self._released:
            return
        # bytes are kept as they are; a mutable buffer is copied, since the caller may reuse it.
        view = memoryview(data if isinstance(data, bytes) else bytes(data)).cast("B")
        self._buffer.append(view)
        self._buffered += len(view)
        self._flush()
        self._maybe_pause()

    def write_eof(self) -> None:
        """Half-close: FIN after the queued bytes; reading continues."""
        if self._eof_requested or self._released:
            return
        self._eof_requested = True
        if not self._buffer:
            self._shutdown()

    def can_write_eof(self) -> bool:
        return True

    def abort(self) -> None:
        self._closing = True
        self._clear_buffer()
        self._release(abort=True)

    # -- events from the table --

    def on_readable(self) -> None:
        if self._reading_paused:
            self._readable_pending = True
        else:
            self._read_all()

    def on_writable(self) -> None:
        self._flush()
        self._maybe_resume()

    def on_peer_closed(self) -> None:
        if self._lost:
            return
        try:
            keep_open = self._protocol.eof_received() \
                if isinstance(self._protocol, asyncio.Protocol | asyncio.BufferedProtocol) else False
        except Exception as exc:  # as asyncio's transports: a failing protocol fails its connection only
            self._fatal(exc)
            return
        if not keep_open:
            self.close()

    def on_released(self, exc: Exception | None) -> None:
        """Closed (``exc`` None) or Reset: the native side already released the handle."""
        self._released = True
        self._clear_buffer()
        self._connection_lost(exc)

    # -- internals --

    def _read_all(self) -> None:
        self._readable_pending = False
        protocol = self._protocol
        assert isinstance(protocol, asyncio.Protocol | asyncio.BufferedProtocol)
        while not self._reading_paused and not self._released:
            try:
                data = self._dp.tcp_recv(self.handle, RECV_CHUNK)
            except ValueError as exc:  # released natively before its event reached us: this connection ends
                self._table.forget(self.handle)
                self.on_released(ConnectionResetError(f"connection lost while reading: {exc}"))
                return
            if not data:
                break
            try:
                if isinstance(protocol, asyncio.BufferedProtocol):
                    _into_buffers(protocol, data)  # e.g. asyncio's TLS (loop.start_tls)
                else:
                    protocol.data_received(data)
            except Exception as exc:
                self._fatal(exc)
                return
        else:
            if not self._released:
                self._readable_pending = True  # paused mid-way: more may be waiting
        self._table.wake()  # freed receive window: let the pump send a window update

    def _clear_buffer(self) -> None:
        self._buffer.clear()
        self._buffered = 0

    def _flush(self) -> None:
        sent_any = False
        while self._buffer and not self._released:
            view = self._buffer[0]
            try:
                n = self._dp.tcp_send(self.handle, view[:SEND_CHUNK])
            except (BrokenPipeError, ValueError) as exc:
                self._clear_buffer()
                self._fatal(ConnectionResetError(f"connection lost while writing: {exc}"))
                return
            if n:
                self._buffered -= n
                sent_any = True
                if n == len(view):
                    self._buffer.popleft()
                    continue
                self._buffer[0] = view[n:]
            if n < min(len(view), SEND_CHUNK):
                break
        if sent_any:
            self._table.wake()
        if not self._buffer:
            if self._eof_requested:
                self._shutdown()
            if self._closing:
                self._release(abort=False)

    def _shutdown(self) -> None:
        if self._released:
            return
        try:
            self._dp.tcp_shutdown_write(self.handle)
        except ValueError:
            return  # released concurrently; the Closed/Reset event reports it
        self._table.wake()

    def _maybe_pause(self) -> None:
        if not self._writing_paused and self._buffered > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()

    def _maybe_resume(self) -> None:
        if self._writing_paused and self._buffered <= self._low:
            self._writing_paused = False
            self._protocol.resume_writing()

    def _release(self, *, abort: bool) -> None:
        if not self._released:
            self._released = True
            if abort:
                self._dp.tcp_abort(self.handle)
            else:
                self._dp.tcp_close(self.handle)
            self._table.forget(self.handle)
            self._table.wake()
        if not self._lost:
            self._table.loop.call_soon(self._connection_lost, None)

    def _fatal(self, exc: Exception) -> None:
        self._closing = True
        if not self._released:
            self._released = True
            self._dp.tcp_abort(self.handle)
            self._table.forget(self.handle)
            self._table.wake()
        self._table.loop.call_soon(self._connection_lost, exc)

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._table.forget(self.handle)
        if self._writing_paused:
            self._writing_paused = False
        self._protocol.connection_lost(exc)


def _into_buffers(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    view = memoryview(data)
    while view:
        buffer = memoryview(protocol.get_buffer(len(view))).cast("B")
        n = min(len(buffer), len(view))
        buffer[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]


# -- handles, dials and listeners -----------------------------------------------------------------

class TailnetServer:
    """A listener on every node address (``start_server``). ``close()`` stops accepting."""

    def __init__(self, table: StreamTable, listener: int, port: int, callback: ClientConnected | None,
                 limit: int, protocol_factory: Callable[[], asyncio.Protocol] | None = None) -> None:
        self._table = table
        self.listener = listener
        self.port = port
        self.callback = callback
        self.protocol_factory = protocol_factory
        """Without a callback: each connection gets a protocol of its own, as ``loop.create_server``."""
        self.limit = limit
        self.accepted = 0
        """Connections accepted so far."""

    def is_serving(self) -> bool:
        return self.listener in self._table.listeners

    def close(self) -> None:
        self._table.unlisten(self)

    async def wait_closed(self) -> None:
        """Nothing to wait for: the connections belong to the node's TaskGroup."""

    async def __aenter__(self) -> TailnetServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class StreamTable:
    """Every TCP handle of one data plane, and the asyncio objects attached to them."""

    def __init__(self, dataplane: nat.DataPlane, *, wake: Callable[[], None], spawn: Spawn,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.dataplane = dataplane
        self.wake = wake
        self.loop = loop
        self._spawn = spawn
        self.transports: dict[int, TailnetTransport] = {}
        self._dials: dict[int, tuple[asyncio.Future[tuple[TailnetTransport, asyncio.Protocol]],
                                     str, int, Callable[[], asyncio.Protocol]]] = {}
        self.listeners: dict[int, TailnetServer] = {}
        self.last_accepted: dict[str, float] = {}
        """When (the loop's time) a connection to each local address was last accepted."""

    def forget(self, handle: int) -> None:
        self.transports.pop(handle, None)

    # -- public operations --

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], ip: str, port: int, *,
                                host: str | None = None, timeout: float = 30.0,
                                ) -> tuple[TailnetTransport, asyncio.Protocol]:
        """Dial ``ip:port`` and attach a protocol, as ``loop.create_connection``; ``host`` is the name
        shown in errors (default ``ip``)."""
        future: asyncio.Future[tuple[TailnetTransport, asyncio.Protocol]] = self.loop.create_future()
        handle = self.dataplane.tcp_connect(ip, port, timeout)
        self._dials[handle] = (future, host or ip, port, protocol_factory)
        self.wake()
        try:
            return await future
        except asyncio.CancelledError:
            if self._dials.pop(handle, None) is not None:
                self.dataplane.tcp_abort(handle)
                self.wake()
            raise

    async def open_connection(self, ip: str, port: int, *, host: str | None = None, timeout: float = 30.0,
                              limit: int = DEFAULT_LIMIT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Dial ``ip:port`` with streams; ``host`` is the name shown in errors (default ``ip``)."""
        reader = asyncio.StreamReader(limit=limit, loop=self.loop)
        transport, protocol = await self.create_connection(
            lambda: asyncio.StreamReaderProtocol(reader, loop=self.loop), ip, port, host=host, timeout=timeout)
        assert isinstance(protocol, asyncio.StreamReaderProtocol)
        return reader, asyncio.StreamWriter(transport, protocol, reader, self.loop)

    def start_server(self, callback: ClientConnected | None, port: int, *, limit: int = DEFAULT_LIMIT,
                     protocol_factory: Callable[[], asyncio.Protocol] | None = None) -> TailnetServer:
        """Listen on ``port`` of every node address; raises OSError(EADDRINUSE) if taken. Each
        connection gets streams for ``callback`` or, without one, a protocol from ``protocol_factory``."""
        listener = self.dataplane.tcp_listen(port)
        server = TailnetServer(self, listener, port, callback, limit, protocol_factory)
        self.listeners[listener] = server
        return server

    def unlisten(self, server: TailnetServer) -> None:
        if self.listeners.pop(server.listener, None) is not None:
            self.dataplane.tcp_unlisten(server.listener)
            self.wake()

    def abort_all(self, exc: Exception) -> None:
        """Fail pending dials and reset every connection (the node is stopping)."""
        for handle, (future, *_rest) in list(self._dials.items()):
            if not future.done():
                future.set_exception(exc)
            self.dataplane.tcp_abort(handle)
        self._dials.clear()
        for transport in list(self.transports.values()):
            transport.abort()

    # -- event dispatch --

    def dispatch(self, event: nat.Event) -> None:
        """Route one TCP event of ``poll`` to its transport, dial or listener."""
        match event:
            case nat.Readable(handle):
                if (t := self.transports.get(handle)) is not None:
                    t.on_readable()
            case nat.Writable(handle):
                if (t := self.transports.get(handle)) is not None:
                    t.on_writable()
            case nat.PeerClosed(handle):
                if (t := self.transports.get(handle)) is not None:
                    t.on_peer_closed()
            case nat.Closed(handle):
                if (t := self.transports.pop(handle, None)) is not None:
                    t.on_released(None)
            case nat.Reset(handle):
                if (t := self.transports.pop(handle, None)) is not None:
                    t.on_released(ConnectionResetError("connection reset by the peer (or timed out)"))
            case nat.Connected(handle):
                self._connected(handle)
            case nat.DialFailed(handle, reason):
                entry = self._dials.pop(handle, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_exception(dial_error(reason, entry[1], entry[2]))
            case nat.Accepted(listener, handle, remote_ip, remote_port):
                self._accepted(listener, handle, remote_ip, remote_port)
            case _:
                pass

    def _connected(self, handle: int) -> None:
        entry = self._dials.pop(handle, None)
        if entry is None or entry[0].done():
            self.dataplane.tcp_abort(handle)  # the dialer gave up meanwhile
            return
        future, _host, _port, protocol_factory = entry
        protocol = protocol_factory()
        future.set_result((self._attach(handle, protocol), protocol))

    def _accepted(self, listener: int, handle: int, remote_ip: str, remote_port: int) -> None:
        server = self.listeners.get(listener)
        if server is None:
            self.dataplane.tcp_abort(handle)
            return
        server.accepted += 1
        local, _ = self.dataplane.tcp_endpoints(handle)
        if local is not None:
            self.last_accepted[local[0]] = self.loop.time()
        if server.callback is None:
            assert server.protocol_factory is not None
            self._attach(handle, server.protocol_factory())
            return
        reader, writer = self._streams(handle, server.limit)
        self._spawn(_serve_one(server.callback, reader, writer, remote_ip, remote_port),
                    f"tailnet-conn-{remote_ip}:{remote_port}")

    def _attach(self, handle: int, protocol: asyncio.Protocol) -> TailnetTransport:
        local, remote = self.dataplane.tcp_endpoints(handle)
        transport = TailnetTransport(self, handle, protocol, extra={"peername": remote, "sockname": local})
        self.transports[handle] = transport
        protocol.connection_made(transport)
        return transport

    def _streams(self, handle: int, limit: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader = asyncio.StreamReader(limit=limit, loop=self.loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=self.loop)
        transport = self._attach(handle, protocol)
        return reader, asyncio.StreamWriter(transport, protocol, reader, self.loop)


async def _serve_one(callback: ClientConnected, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     remote_ip: str, remote_port: int) -> None:
    """Run one accepted connection's callback; its failure is logged, never fatal to the node."""
    try:
        await callback(reader, writer)
    except Exception as exc:
        log.warning("tailnet connection handler failed", remote=f"{remote_ip}:{remote_port}",
                    error=str(exc) or repr(exc))
        writer.transport.abort()
