"""Keeps one DERP connection to a region up, reconnecting with jittered exponential backoff.

Each time a connection is established the supervisor sends NotePreferred (when ``preferred``) and
then calls the handler with it; the handler owns the connection until it returns or raises (it
typically pumps ``read_chunk`` into the data plane). When the handler ends or the connection fails,
the supervisor closes it, waits out the backoff and reconnects. Nodes of the region are tried in
DERPMap order, as ``derphttp.Client.dialRegion`` does.

tailscaled retries a region with ``util/backoff`` capped at 5 s (``magicsock/derp.go``); the
defaults here use the same cap.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from tailnet_agent.contract.backoff import Backoff, derp_backoff

from .connection import DerpConnection, DerpNodeLike
from .errors import DerpConnectError, DerpError

log = structlog.get_logger("agent.derp.supervisor")


class ConnectionHandler(Protocol):
    """Called with every new connection; the connection is closed when the call returns or raises."""

    async def __call__(self, conn: DerpConnection, /) -> None: ...



Opener = Callable[[DerpNodeLike], Awaitable[DerpConnection]]


class DerpSupervisor:
    """Maintains the connection to one region (normally the home region). ``run`` blocks until cancelled.

    ``private_key`` is the raw 32-byte node private key (never logged). ``tls``/``plaintext``,
    ``connect_timeout`` and ``read_timeout`` are passed to :meth:`DerpConnection.open`.
    ``stable_after`` (seconds, default 10) is how long a connection must have lasted for the
    backoff to start again from ``initial`` after it drops.
    """

    def __init__(self, nodes: Sequence[DerpNodeLike], private_key: bytes, handler: ConnectionHandler, *,
                 preferred: bool = True, tls: ssl.SSLContext | None = None, plaintext: bool = False,
                 connect_timeout: float = 10.0, read_timeout: float = 120.0, backoff: Backoff | None = None,
                 stable_after: float = 10.0,
                 _open: Opener | None = None, _sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._nodes = tuple(nodes)
        self._private_key = private_key
        self._handler = handler
        self._preferred = preferred
        self._tls = tls
        self._plaintext = plaintext
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self.backoff = backoff or derp_backoff()
        self.stable_after = stable_after
        self._open = _open or self._open_default
        self._sleep = _sleep
        self.connection: DerpConnection | None = None
        """The current connection, None while (re)connecting."""
        self.generation = 0
        """Connections established so far; grows by one per (re)connect."""
        self._changed = asyncio.Condition()

    def set_nodes(self, nodes: Sequence[DerpNodeLike]) -> None:
        """New nodes for the region (after a DERPMap change); used from the next reconnect on."""
        self._nodes = tuple(nodes)

    async def set_preferred(self, preferred: bool) -> None:
        """Change whether this is the home region; sent now if connected, and after every reconnect."""
        self._preferred = preferred
        if self.connection is not None:
            await self.connection.note_preferred(preferred)

    async def wait_connected(self, *, newer_than: int = 0) -> DerpConnection:
        """The current connection once one with ``generation > newer_than`` is up (default: any)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.connection is not None and self.generation > newer_than)
        assert self.connection is not None
        return self.connection

    async def _set_connection(self, conn: DerpConnection | None) -> None:
        async with self._changed:
            self.connection = conn
            if conn is not None:
                self.generation += 1
            self._changed.notify_all()

    async def run(self) -> None:
        """Connect, serve, reconnect; returns only by cancellation. Errors of the handler other than
        :class:`DerpError` and ``OSError`` propagate (they are bugs, not network conditions)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn = await self._connect_any()
            except DerpError as exc:
                delay = self.backoff.next()
                log.warning("derp connect failed", error=str(exc), retry_in=round(delay, 3))
                await self._sleep(delay)
                continue
            started = loop.time()
            await self._set_connection(conn)
            try:
                await conn.note_preferred(self._preferred)
                await self._handler(conn)
                log.info("derp handler returned; reconnecting", derp=conn.label)
            except (DerpError, OSError) as exc:
                log.warning("derp connection lost", derp=conn.label, error=str(exc) or repr(exc))
            finally:
                await self._set_connection(None)
                await conn.close()
            if loop.time() - started >= self.stable_after:
                self.backoff.reset()
            await self._sleep(self.backoff.next())

    async def _connect_any(self) -> DerpConnection:
        nodes = [n for n in self._nodes if not getattr(n, "stun_only", False)]
        if not nodes:
            raise DerpConnectError("the region has no DERP nodes")
        last: DerpError | None = None
        for node in nodes:
            try:
                return await self._open(node)
            except DerpError as exc:
                last = exc
        assert last is not None
        raise last

    async def _open_default(self, node: DerpNodeLike) -> DerpConnection:
        return await DerpConnection.open(node, self._private_key, tls=self._tls, plaintext=self._plaintext,
                                         connect_timeout=self._connect_timeout, read_timeout=self._read_timeout)
