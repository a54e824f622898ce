"""Reachability of each target: a TCP connect through the tailnet, the way egress dials it.

A route in the netmap says a packet has somewhere to go, not that the far end answers (a grant
missing on the router's side, a host down, a firewall on the site LAN). Every ``interval`` seconds
(jittered by +-20% so many agents do not probe in step) the target's first port is dialled with a
``timeout`` through the node's own dial path, the connection closed at once, and the outcome kept
for ``/status`` and the metrics ``tailnet_agent_target_reachable`` and
``tailnet_agent_target_probe_seconds`` (connect time of successful probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import structlog

from tailnet_agent.config import Forwarded
from tailnet_agent.contract.clock import Clock
from tailnet_agent.health import AgentMetrics
from tailnet_agent.streams import error_reason

log = structlog.get_logger("agent.probe")

DEFAULT_INTERVAL = 30.0
DEFAULT_TIMEOUT = 5.0
WARMUP_INTERVAL = 2.0
"""How often a target that has never answered is probed: a new agent's path to it (a WireGuard
handshake, the router's side) takes seconds after its first netmap, and readiness waits for it."""
WARMUP_LIMIT = 30.0
"""Seconds after the node is first ready that :class:`Warmup` waits at most for every target to
answer once, so that a target that is down does not keep a new pod unready for ever."""
JITTER = 0.2


@dataclass(frozen=True)
class ProbeResult:
    """One reachability probe: a TCP connect through the tailnet to the target's first port."""

    reachable: bool
    latency_ms: float | None
    """Connect time in milliseconds when reachable."""
    checked_at: datetime
    error: str | None = None


class ProbeDialer(Protocol):
    """What a probe needs from the node (:class:`tailnet_agent.node.Node` fits)."""

    async def wait_ready(self) -> None: ...

    async def open_connection(self, host: str, port: int, *, timeout: float | None = None,
                              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...


async def probe_once(node: ProbeDialer, target: Forwarded, clock: Clock, *, timeout: float = DEFAULT_TIMEOUT,
                     ) -> ProbeResult:
    """Dial the target's first port once; never raises for a failed dial."""
    port = target.ports[0].port
    started = clock.now()
    try:
        async with asyncio.timeout(timeout):
            await node.wait_ready()
            _, writer = await node.open_connection(target.address, port, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        message = str(exc) or f"no connection to {target.address}:{port} within {timeout:g}s"
        return ProbeResult(False, None, clock.utcnow(), f"{error_reason(exc)}: {message}")
    latency = (clock.now() - started) * 1000.0
    writer.close()
    return ProbeResult(True, round(latency, 3), clock.utcnow())


class Prober:
    """Probes targets on a schedule; the caller runs one :meth:`run` per target in its TaskGroup."""

    def __init__(self, node: ProbeDialer, clock: Clock, *, metrics: AgentMetrics | None = None,
                 interval: float = DEFAULT_INTERVAL, timeout: float = DEFAULT_TIMEOUT,
                 rng: Callable[[], float] = random.random) -> None:
        self.node = node
        self.clock = clock
        self.metrics = metrics or AgentMetrics()
        self.interval = interval
        self.timeout = timeout
        self.rng = rng
        self.results: dict[str, ProbeResult] = {}
        """The last result per target name."""
        self.reached: set[str] = set()
        """The targets that have answered a probe at least once."""

    def next_delay(self) -> float:
        """``interval`` +-20%."""
        return self.interval * (1 - JITTER + 2 * JITTER * self.rng())

    async def run(self, target: Forwarded) -> None:
        """Probe ``target`` now and then every :meth:`next_delay` seconds until cancelled."""
        try:
            while True:
                try:
                    self.record(target, await probe_once(self.node, target, self.clock, timeout=self.timeout))
                except Exception:  # a probe must never take the target's listeners down with it
                    log.exception("reachability probe failed", target=target.name)
                await self.clock.sleep(self.next_delay() if target.name in self.reached else WARMUP_INTERVAL)
        finally:
            self.forget(target)

    def record(self, target: Forwarded, result: ProbeResult) -> None:
        previous = self.results.get(target.name)
        self.results[target.name] = result
        if result.reachable:
            self.reached.add(target.name)
        self.metrics.target_reachable.labels(target.name).set(1 if result.reachable else 0)
        if result.latency_ms is not None:
            self.metrics.target_probe_seconds.labels(target.name).observe(result.latency_ms / 1000.0)
        if previous is None or previous.reachable != result.reachable:
            log.info("target reachability", target=target.name, reachable=result.reachable,
                     latency_ms=result.latency_ms, error=result.error)

    def forget(self, target: Forwarded) -> None:
        """A removed (or replaced) target: drop its result and its metric series."""
        self.results.pop(target.name, None)
        self.reached.discard(target.name)
        for metric in (self.metrics.target_reachable, self.metrics.target_probe_seconds):
            with contextlib.suppress(KeyError):
                metric.remove(target.name)


class Warmup:
    """An egress agent's readiness beyond its node's: every target has answered a probe once, or
    :data:`WARMUP_LIMIT` seconds have passed since the node was first ready. Until then a new pod
    (a rollout's, a replacement's) stays out of its Services, which keep sending to the pods that
    already reach the targets. Once warm, it stays warm: a target that goes down later does not
    take the pod out of the Services of the others."""

    def __init__(self, prober: Prober, targets: Callable[[], Iterable[str]], node_ready: Callable[[], bool],
                 clock: Clock, *, limit: float = WARMUP_LIMIT) -> None:
        self.prober, self.targets, self.node_ready, self.clock, self.limit = prober, targets, node_ready, clock, limit
        self._ready_since: float | None = None
        self._warm = False

    def waiting(self) -> list[str]:
        """The targets readiness still waits for (none: warm)."""
        if self._warm:
            return []
        waiting = [name for name in self.targets() if name not in self.prober.reached]
        if self._ready_since is None and self.node_ready():
            self._ready_since = self.clock.now()
        expired = self._ready_since is not None and self.clock.now() - self._ready_since >= self.limit
        if not waiting or expired:
            self._warm = True
            if waiting:
                log.info("ready without an answer from every target", waiting=waiting, after_seconds=self.limit)
            return []
        return waiting
