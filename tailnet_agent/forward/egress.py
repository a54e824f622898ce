"""Egress: a local TCP listener per target port, each connection dialled over the tailnet and spliced.

The operator points one Service per target at these listeners. A connection is accepted (and not
read from yet), the node waits (at most ``dial_timeout`` seconds) until it is ready, dials
``address:port`` over the tailnet, and then copies both ways with half-close
(:class:`~tailnet_agent.forward.splice.Splice`, protocol to protocol). A failed dial resets the local
connection (the client sees ECONNRESET, as with a plain proxy) and is counted by reason. Every
connection runs as a task of the forwarder's TaskGroup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import structlog

from tailnet_agent.config import PortMapping, Target
from tailnet_agent.health import AgentMetrics
from tailnet_agent.streams import error_reason

from .splice import Splice

log = structlog.get_logger("agent.egress")


class Dialer(Protocol):
    """What egress needs from the node (:class:`tailnet_agent.node.Node` is the real one)."""

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]: ...

    async def wait_ready(self) -> None: ...


class EgressForwarder:
    """Runs the listeners of ``targets``; ``run`` blocks until cancelled."""

    def __init__(self, node: Dialer, targets: tuple[Target, ...], *, bind_address: str = "0.0.0.0",
                 dial_timeout: float = 30.0, metrics: AgentMetrics | None = None) -> None:
        self.node = node
        self.targets = targets
        self.bind_address = bind_address
        self.dial_timeout = dial_timeout
        """Seconds for readiness plus the dial. Default 30."""
        self.metrics = metrics or AgentMetrics()
        self.listening = asyncio.Event()
        """Set once every listener is bound."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        servers: list[asyncio.Server] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for target in self.targets:
                    for mapping in target.ports:
                        server = await loop.create_server(
                            self._factory(tg, target, mapping), self.bind_address, mapping.listen,
                            reuse_address=True)
                        servers.append(server)
                        log.info("egress listening", target=target.name, listen=f"{self.bind_address}:"
                                 f"{mapping.listen}", to=f"{target.address}:{mapping.port}")
                self.listening.set()
                await loop.create_future()  # until cancelled; connections are tasks of tg
        finally:
            for server in servers:
                server.close()

    def _factory(self, tg: asyncio.TaskGroup, target: Target, mapping: PortMapping,
                 ) -> Callable[[], asyncio.Protocol]:
        sent = self.metrics.bytes.labels(target.name, "sent")
        received = self.metrics.bytes.labels(target.name, "received")

        def accept() -> asyncio.Protocol:
            splice = Splice(count_a_to_b=sent.inc, count_b_to_a=received.inc)
            # The task first runs after connection_made has given splice.a its transport.
            tg.create_task(self._forward(target, mapping, splice), name=f"egress-{target.name}-{mapping.port}")
            return splice.a

        return accept

    async def _forward(self, target: Target, mapping: PortMapping, splice: Splice) -> None:
        m = self.metrics
        m.connections.labels(target.name).inc()
        active = m.active.labels(target.name)
        active.inc()
        client = splice.a.transport.get_extra_info("peername") if splice.a.transport else None
        try:
            try:
                async with asyncio.timeout(self.dial_timeout):
                    await self.node.wait_ready()
                    await self.node.create_connection(lambda: splice.b, target.address, mapping.port,
                                                      timeout=self.dial_timeout)
            except (OSError, TimeoutError) as exc:
                reason = error_reason(exc)
                message = str(exc) or f"tailnet node not ready within {self.dial_timeout:g}s"
                m.dial_errors.labels(target.name, reason).inc()
                log.warning("egress dial failed", target=target.name, to=f"{target.address}:{mapping.port}",
                            client=client, reason=reason, error=message)
                splice.abort()
                return
            splice.join()
            try:
                await splice.done
            except OSError as exc:
                log.info("egress connection ended with an error", target=target.name, client=client,
                         error=str(exc) or repr(exc))
        except Exception:
            log.exception("egress connection failed", target=target.name, client=client)
            splice.abort()
        except BaseException:
            splice.abort()
            raise
        finally:
            active.dec()
            if splice.done.done() and not splice.done.cancelled():
                splice.done.exception()  # retrieved: an early failure is not "never retrieved"
