"""Reachability probes on a fake clock: the schedule, the result, the metrics."""

from __future__ import annotations

import asyncio

import pytest

from tailnet_agent.contract.clock import FakeClock
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.health import AgentMetrics
from tailnet_agent.probe import WARMUP_INTERVAL, Prober, Warmup, probe_once
from tailnet_agent.streams import NoRouteError

TARGET = Target(name="db", address="198.18.5.9", ports=(PortMapping(port=5432, listen=15432),
                                                        PortMapping(port=443, listen=8443)))


class FakeNode:
    """Connects after ``delay`` fake seconds, or fails with ``error``."""

    def __init__(self, clock: FakeClock, delay: float = 0.0) -> None:
        self.clock = clock
        self.delay = delay
        self.error: OSError | None = None
        self.dials: list[tuple[str, int, float]] = []

    async def wait_ready(self) -> None:
        return None

    async def open_connection(self, host: str, port: int, *, timeout: float | None = None,
                              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.dials.append((host, port, self.clock.now()))
        if self.error is not None:
            raise self.error
        self.clock.advance(self.delay)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        try:
            return await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        finally:
            server.close()


async def test_probe_measures_the_connect_on_the_first_port() -> None:
    clock = FakeClock()
    node = FakeNode(clock, delay=0.0125)
    result = await probe_once(node, TARGET, clock)
    assert (result.reachable, result.latency_ms, result.error) == (True, 12.5, None)
    assert result.checked_at == clock.utcnow() and node.dials == [("198.18.5.9", 5432, 0.0)]
    node.error = NoRouteError("no route to 198.18.5.9: no peer or accepted route covers it")
    failed = await probe_once(node, TARGET, clock)
    assert (failed.reachable, failed.latency_ms) == (False, None)
    assert failed.error == "no_route: no route to 198.18.5.9: no peer or accepted route covers it"


async def test_prober_runs_every_jittered_interval_and_keeps_metrics() -> None:
    clock, metrics = FakeClock(), AgentMetrics()
    node = FakeNode(clock, delay=0.02)
    prober = Prober(node, clock, metrics=metrics, rng=lambda: 1.0)  # the longest delay: 30 s + 20%
    assert prober.next_delay() == pytest.approx(36.0) and Prober(node, clock, rng=lambda: 0.0).next_delay() == 24.0
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(prober.run(TARGET))
        await clock.wait_for_sleepers()
        assert [d[2] for d in node.dials] == [0.0] and prober.results["db"].reachable
        node.error = NoRouteError("no route to 198.18.5.9")
        clock.advance(35.9)
        await asyncio.sleep(0)
        assert len(node.dials) == 1
        clock.advance(0.2)
        await clock.wait_for_sleepers()
        assert len(node.dials) == 2 and not prober.results["db"].reachable
        text = metrics.render().decode()
        assert 'tailnet_agent_target_reachable{target="db"} 0.0' in text
        assert 'tailnet_agent_target_probe_seconds_count{target="db"} 1.0' in text
        assert 'tailnet_agent_target_probe_seconds_bucket{le="0.025",target="db"} 1.0' in text
        task.cancel()
    assert "db" not in prober.results, "a stopped target's result and series go away"
    assert 'target="db"' not in metrics.render().decode()


async def test_until_a_target_first_answers_it_is_probed_every_warmup_interval() -> None:
    clock = FakeClock()
    node = FakeNode(clock)
    node.error = NoRouteError("no route to 198.18.5.9")  # a new pod: its path is not up yet
    prober = Prober(node, clock, rng=lambda: 1.0)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(prober.run(TARGET))
        await clock.wait_for_sleepers()
        clock.advance(WARMUP_INTERVAL)
        await clock.wait_for_sleepers()
        assert [d[2] for d in node.dials] == [0.0, WARMUP_INTERVAL]
        node.error = None
        clock.advance(WARMUP_INTERVAL)
        await clock.wait_for_sleepers()
        assert prober.results["db"].reachable and len(node.dials) == 3
        clock.advance(WARMUP_INTERVAL)
        await asyncio.sleep(0)
        assert len(node.dials) == 3, "once answered, the normal interval"
        task.cancel()


def test_warmup_waits_for_every_target_to_answer_once_or_for_its_limit() -> None:
    clock = FakeClock()
    prober = Prober(FakeNode(clock), clock)
    names, node_ready = ["db", "web"], [False]
    warmup = Warmup(prober, lambda: names, lambda: node_ready[0], clock, limit=30.0)
    assert warmup.waiting() == ["db", "web"]
    clock.advance(100)  # the limit counts from the node's readiness, not from the start
    node_ready[0] = True
    assert warmup.waiting() == ["db", "web"]
    prober.reached.add("db")
    assert warmup.waiting() == ["web"]
    clock.advance(30)
    assert warmup.waiting() == [], "a target that never answers holds a pod back 30 s at most"
    names.append("new")
    assert warmup.waiting() == [], "once warm, a target added later changes nothing"
