"""A plaintext port: HTTP/1.1, or HTTP/2 with prior knowledge (h2c), without TLS; the host chosen
per request by its Host (``:authority``).

The tailnet carries every connection inside WireGuard, so a plaintext http expose is what a
Gateway API ``HTTP`` listener is: the agent still routes, edits headers and sends the caller's
identity, only without a certificate. Without TLS there is no ALPN: a connection whose first bytes
are the HTTP/2 preface (prior knowledge, as gRPC clients call an ``http://`` address) is served
HTTP/2 with the limits, drain and metrics of the TLS ports (:class:`PlainHttp2`); any other is
HTTP/1.1 (:class:`PlainHttp1`). The ``Upgrade: h2c`` request of RFC 7540 (dropped by RFC 9113) is
not answered: such a request is served in HTTP/1.1. Without SNI a connection is bound to no host:
each request (each stream) goes to the host it names (its name or an alias, case and port ignored)
among the plaintext exposes of the port, in the order of the exposes file, else to a host named
``*`` (any host), else gets 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from tailnet_agent.contract.exposes import VirtualHost, closest
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Limits

from .handover import Sniffing
from .http1 import Http1Server, PlainHttp1
from .http2 import Http2Server, PlainHttp2
from .ports import SharedPort
from .service import HttpService


class PlainHttpPort(SharedPort[HttpService]):
    """The tailnet listener of one port shared by plaintext http exposes (:class:`SharedPort`);
    its connections stay tasks of the port, since each request may go to another expose."""

    kind = "http"

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None, *,
                 gate: ConnectionGate | None = None, limits: Limits | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        super().__init__(port, order, gate=gate)
        self.limits = limits or Limits()
        self.front = PlainHttp1(port, self.pick, limits=limits, metrics=metrics)
        self.front2 = PlainHttp2(port, self.pick2, limits=limits, metrics=metrics)
        self._serving: set[asyncio.Task[None]] = set()
        """The connections being served (their first bytes read): the port's still, but not ended
        when the listener closes, so that :meth:`finish` can let their requests finish."""
        self._finishing = asyncio.Lock()
        self._finished = False

    def pick(self, name: str) -> tuple[Http1Server, VirtualHost] | None:
        """The expose (its HTTP/1.1 server) and host a request for the host ``name`` goes to."""
        found = self._closest(name)
        return (found[0].http1, found[1]) if found else None

    def pick2(self, name: str) -> tuple[Http2Server, VirtualHost] | None:
        """:meth:`pick` for an HTTP/2 stream."""
        found = self._closest(name)
        return (found[0].http2, found[1]) if found else None

    def _closest(self, name: str) -> tuple[HttpService, VirtualHost] | None:
        """The closest host of the port for ``name`` (an exact name, then ``*.`` names, then
        ``*``; :func:`closest`) and its expose."""
        return closest(((service, h) for service in self.ordered() for h in service.expose.hosts), name)

    async def finish(self) -> None:
        """Let the requests in progress finish (the agent shuts down, the listener closed):
        HTTP/1.1 connections close after theirs, HTTP/2 ones refuse new streams (REFUSED_STREAM,
        safe to retry elsewhere) and send GOAWAY once their streams are done. Each expose of the
        port asks; the first does it, the others wait for it (aiohttp's shutdown is not to be run
        twice at once)."""
        async with self._finishing:
            if self._finished:
                return
            self.front2.drain()
            await self.front.shutdown(None)
            if tasks := [t for t in self._serving if t is not asyncio.current_task()]:
                await asyncio.wait(tasks)
            self._finished = True

    async def drain(self) -> None:
        """End every connection the port still holds after the last lease went."""
        if tasks := [t for t in self._serving if t is not asyncio.current_task()]:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        await super().drain()

    async def _serve(self, transport: asyncio.Transport) -> None:
        sniffing = Sniffing(transport)
        try:
            async with asyncio.timeout(self.limits.idle_timeout or None):
                http2 = await sniffing.http2
        except TimeoutError:
            return  # nothing sent for an idle timeout
        if sniffing.lost:
            return  # the client left before its first request could be served
        task = asyncio.current_task()
        assert task is not None
        self._tasks.discard(task)  # served now: ended by drain or finish, not when the listener closes
        self._serving.add(task)
        try:
            if http2:
                await self.front2.serve(transport, sniffing, str((transport.get_extra_info("peername") or ("?",))[0]))
            else:
                await self.front.serve(transport, sniffing)
        finally:
            self._serving.discard(task)
