"""Ingress: the exposes listen on the node's tailnet address and dial their in-cluster backend.

The same :class:`~tailnet_agent.forward.egress.Forwarder` as egress (one task per expose, reloads
by name keep the connections of unchanged exposes), with the listeners on the tailnet
(:meth:`Node.listen <tailnet_agent.node.Node.listen>`; the packet filter decides who connects)
and the dials local (:class:`LocalDialer`). A tcp expose splices each connection to its backend
with half-close; an http expose's connections are served by an
:class:`~tailnet_agent.forward.http.HttpService` that lives as long as the expose listens, on the
listener of its port (:class:`~tailnet_agent.forward.http.HttpPort`), which the http exposes on one
port share: SNI picks the expose (a plaintext expose's port, :class:`~tailnet_agent.forward.http.PlainHttpPort`:
each request's Host picks it). The caller's identity for the ``Tailnet-*`` headers comes from the
node's netmap (the peer whose address the connection comes from). A tls expose is served the same
way, by a :class:`~tailnet_agent.forward.passthrough.PassthroughService` on the
:class:`~tailnet_agent.forward.passthrough.PassthroughPort` its port's tls exposes share: the
ClientHello's SNI picks the expose, and the connection is then spliced to its backend as a tcp
expose's is, TLS untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from tailnet_agent.contract.exposes import TCP, TLS, Expose
from tailnet_agent.contract.targets import PortMapping
from tailnet_agent.control.netmap import NetMap
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Limits
from tailnet_agent.probe import Prober

from .egress import Accept, Closable, Connection, Forwarder
from .http import HttpPort, HttpService, Identity, PlainHttpPort, SharedPort, identify
from .passthrough import PassthroughPort, PassthroughService


class Listener(Protocol):
    """Where the exposes listen (:class:`tailnet_agent.node.Node` fits)."""

    @property
    def netmap(self) -> NetMap | None:
        """The node's view of the tailnet: who a peer address belongs to."""

    async def wait_ready(self) -> None: ...

    async def listen(self, protocol_factory: Callable[[], asyncio.Protocol], port: int) -> Closable: ...


class LocalDialer:
    """Dials from the pod's network (the backend Service); the forwarder's and the probe's dialer."""

    async def wait_ready(self) -> None:
        pass

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]:
        async with asyncio.timeout(timeout):
            return await asyncio.get_running_loop().create_connection(protocol_factory, host, port)

    async def open_connection(self, host: str, port: int, *, timeout: float | None = None,
                              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(timeout):
            return await asyncio.open_connection(host, port)


class Ingress:
    """The exposes of one agent; ``forwarder.run`` serves them, ``forwarder.apply`` changes them."""

    def __init__(self, node: Listener, exposes: tuple[Expose, ...], *, dial_timeout: float = 30.0,
                 metrics: AgentMetrics | None = None, prober: Prober | None = None, limits: Limits | None = None,
                 gate: ConnectionGate | None = None) -> None:
        self.node = node
        self.limits = limits or Limits()
        self.gate = gate
        self.metrics = metrics
        self.services: dict[str, HttpService] = {}
        """The running http exposes by name (their certificates are on ``/status``)."""
        self.ports: dict[int, SharedPort[Any]] = {}
        """The listeners of the ports http and tls exposes are on (HTTPS, plaintext HTTP or TLS passthrough)."""
        self.forwarder = Forwarder(LocalDialer(), exposes, dial_timeout=dial_timeout, metrics=metrics,
                                   prober=prober, listen=self._listen, session=self._session, kind="ingress",
                                   gate=gate)

    def whois(self, ip: str) -> Identity | None:
        return identify(self.node.netmap, ip)

    async def _bind(self, factory: Callable[[], asyncio.Protocol], port: int) -> Closable:
        await self.node.wait_ready()
        return await self.node.listen(factory, port)

    async def _listen(self, factory: Callable[[], asyncio.Protocol], port: int) -> Closable:
        """A tcp expose's own listener, or a lease on the shared listener of an http or tls port
        (the session registered the expose there first)."""
        if (shared := self.ports.get(port)) is not None:
            return await shared.lease(self._bind)
        return await self._bind(factory, port)

    def _order(self) -> list[str]:
        return [e.name for e in self.forwarder.targets]

    def _port(self, expose: Expose) -> SharedPort[Any]:
        """A new shared port for the kind of ``expose`` (http over TLS, plaintext http, or tls)."""
        if expose.mode == TLS:
            return PassthroughPort(expose.port, self._order, gate=self.gate, metrics=self.metrics)
        if expose.plaintext:
            return PlainHttpPort(expose.port, self._order, gate=self.gate, limits=self.limits, metrics=self.metrics)
        return HttpPort(expose.port, self._order, gate=self.gate)

    def _service(self, expose: Expose) -> HttpService | PassthroughService:
        if expose.mode == TLS:
            return PassthroughService(expose, self.forwarder)
        return HttpService(expose, self.whois, limits=self.limits, metrics=self.metrics)

    @contextlib.asynccontextmanager
    async def _session(self, expose: Expose) -> AsyncIterator[Accept | None]:
        if expose.mode == TCP:
            yield None
            return
        async with self._service(expose) as service:
            port = self.ports.get(expose.port)
            if port is None:
                port = self.ports[expose.port] = self._port(expose)
            port.services[expose.name] = service
            if isinstance(service, HttpService):
                self.services[expose.name] = service
            try:
                yield _unused
                if self.forwarder.draining.is_set():  # the listener closed: let the connections finish
                    await service.drain()
                    await port.finish()
            finally:
                if port.services.get(expose.name) is service:
                    del port.services[expose.name]
                if self.services.get(expose.name) is service:
                    del self.services[expose.name]
                if port.idle and self.ports.get(expose.port) is port:
                    del self.ports[expose.port]
                    await port.drain()


def _unused(mapping: PortMapping) -> Connection:
    """An http or tls expose's connections are accepted by its port's listener, never by the forwarder."""
    raise RuntimeError(f"port {mapping.listen} is served by its shared port")
