"""A tailnet port shared by the exposes on it: one listener, held by a lease per expose.

The listener is bound with the first lease and closed with the last (:meth:`SharedPort.lease`,
the forwarder's ``listen``). Each accepted connection is held paused (:class:`~.handover.Held`),
counted against the agent's limits, and served in a task of the port by the kind of port
(:class:`~.sni.HttpPort` over TLS, :class:`~.plain.PlainHttpPort` without, and for tls exposes
:class:`~tailnet_agent.forward.passthrough.PassthroughPort`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import structlog

from tailnet_agent.contract.exposes import Expose
from tailnet_agent.limits import ConnectionGate, Refused, hold_peer

from ..egress import Closable
from .handover import Held

log = structlog.get_logger("agent.http")

Bind = Callable[[Callable[[], asyncio.Protocol], int], Any]
"""Opens the real listener of a port (awaitable; raises OSError when it cannot bind)."""


class Served(Protocol):
    """What serves one expose of a shared port (:class:`~.service.HttpService`, or a tls
    expose's :class:`~tailnet_agent.forward.passthrough.PassthroughService`)."""

    @property
    def expose(self) -> Expose: ...


S = TypeVar("S", bound=Served)


class SharedPort(Generic[S]):
    """The listener of one port and the exposes on it, by name; a subclass serves a connection
    (:meth:`_serve`)."""

    kind = "http"
    """The port's name in logs and task names."""

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None, *,
                 gate: ConnectionGate | None = None) -> None:
        self.port = port
        self.gate = gate
        """Counts the port's connections against the agent's limit (None: not counted)."""
        self.services: dict[str, S] = {}
        """The exposes on the port, by name."""
        self._order = order
        self._listener: Closable | None = None
        self._leases = 0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def idle(self) -> bool:
        return not self.services and not self._leases

    def ordered(self) -> list[S]:
        """The services in the order of the exposes file (else in the order they started)."""
        names = [n for n in self._order() if n in self.services] if self._order else []
        return [self.services[n] for n in dict.fromkeys([*names, *self.services])]

    async def lease(self, bind: Bind) -> Closable:
        async with self._lock:
            if self._listener is None:
                self._listener = await bind(self.protocol, self.port)
            self._leases += 1
        return _Lease(self)

    def release(self) -> None:
        self._leases -= 1
        if self._leases > 0 or self._listener is None:
            return
        self._listener.close()
        self._listener = None
        for task in self._tasks:
            task.cancel()

    async def finish(self) -> None:
        """Let the requests in progress on connections the port serves itself finish (the agent
        shuts down, the listener closed); nothing here: over TLS a connection is its expose's once
        served (:meth:`~.service.HttpService.drain`)."""

    async def drain(self) -> None:
        """End the connections the port still holds after the last lease went."""
        if tasks := [t for t in self._tasks if t is not asyncio.current_task()]:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    def protocol(self) -> asyncio.Protocol:
        """The listener's protocol factory: hold the connection, serve it in a task of the port (a
        connection over the agent's limit is closed at once)."""
        gate = self.gate
        if gate is not None and not gate.admit():
            return Refused()
        held = Held()
        task = asyncio.get_running_loop().create_task(self.serve(held), name=f"{self.kind}-{self.port}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if gate is not None:
            task.add_done_callback(lambda _: gate.release())
        return held

    async def serve(self, held: Held) -> None:
        """One connection until it ends; a failure ends it alone."""
        try:
            transport = await held.made
        except ConnectionError:
            return
        with hold_peer(self.gate, transport) as admitted:  # over its peer's limit: closed, not served
            if admitted:
                await self._serve_admitted(transport)

    async def _serve_admitted(self, transport: asyncio.Transport) -> None:
        try:
            await self._serve(transport)
        except Exception:
            log.exception(f"{self.kind} connection failed", port=self.port)
        finally:
            transport.abort()  # a no-op after a clean close

    async def _serve(self, transport: asyncio.Transport) -> None:
        raise NotImplementedError


class _Lease:
    """One expose's hold on the shared listener; closing it twice releases once."""

    def __init__(self, port: SharedPort[Any]) -> None:
        self._port: SharedPort[Any] | None = port

    def close(self) -> None:
        port, self._port = self._port, None
        if port is not None:
            port.release()
