"""A plaintext port: HTTP/1.1 without TLS, the host chosen per request by its Host.

The tailnet carries every connection inside WireGuard, so a plaintext http expose is what a
Gateway API ``HTTP`` listener is: the agent still routes, edits headers and sends the caller's
identity, only without a certificate. Without SNI a connection is bound to no host: each request
goes to the host its Host names (its name or an alias, case and port ignored) among the
plaintext exposes of the port, in the order of the exposes file, else to a host named ``*`` (any
host), else gets 404. HTTP/2 is not served in plaintext.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from tailnet_agent.contract.exposes import VirtualHost, closest
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Limits

from .handover import Pending
from .http1 import Http1Server, PlainHttp1
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
        self.front = PlainHttp1(port, self.pick, limits=limits, metrics=metrics)

    def pick(self, name: str) -> tuple[Http1Server, VirtualHost] | None:
        """The expose and host a request for the host ``name`` goes to: the closest host of the
        port (an exact name, then ``*.`` names, then ``*``; :func:`closest`)."""
        return closest(((service.http1, h) for service in self.ordered() for h in service.expose.hosts), name)

    async def drain(self) -> None:
        """Finish the requests in progress (their connections close after them), then end the rest."""
        await self.front.shutdown(None)
        await super().drain()

    async def _serve(self, transport: asyncio.Transport) -> None:
        await self.front.serve(transport, Pending())
