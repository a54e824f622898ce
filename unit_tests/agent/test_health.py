"""Health endpoints and metrics of the agent, against a fake node status."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from tailnet_agent.health import AgentMetrics, HealthServer


@dataclass
class FakeNode:
    netmap: object | None = None
    home_region: int = 0
    control_connected: bool = False
    counters: dict[str, int] = field(default_factory=dict)
    derp_connections: dict[int, object] = field(default_factory=dict)
    direct_peer_count: int = 0

    @property
    def ready(self) -> bool:
        return self.netmap is not None and (self.home_region in self.derp_connections or self.direct_peer_count > 0)


async def test_readyz_follows_netmap_and_derp_and_metrics_render() -> None:
    node = FakeNode()
    metrics = AgentMetrics(node)
    server = HealthServer(node, metrics, host="127.0.0.1", port=0)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(server.run())
        await asyncio.wait_for(server.started.wait(), 10)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"{base}/readyz") as resp:
                assert (resp.status, await resp.text()) == (503, "not ready: no netmap from control yet\n")
            node.netmap, node.home_region = object(), 999
            async with http.get(f"{base}/readyz") as resp:
                expected = "not ready: home DERP region 999 not connected and no peer reached directly\n"
                assert (resp.status, await resp.text()) == (503, expected)
            node.derp_connections[999] = object()
            node.control_connected = True
            node.counters = {"packets_in": 7, "drop_filtered": 2}
            node.direct_peer_count = 3
            metrics.connections.labels("db").inc()
            metrics.dial_errors.labels("db", "no_route").inc()
            metrics.bytes.labels("db", "sent").inc(10)
            async with http.get(f"{base}/readyz") as resp:
                assert resp.status == 200
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
        task.cancel()
    for line in ('tailnet_agent_connections_total{target="db"} 1.0',
                 'tailnet_agent_dial_errors_total{reason="no_route",target="db"} 1.0',
                 'tailnet_agent_bytes_total{direction="sent",target="db"} 10.0',
                 "tailnet_agent_control_connected 1.0", "tailnet_agent_derp_connected 1.0",
                 "tailnet_agent_direct_peers 3.0",
                 "tailnet_agent_dataplane_packets_in_total 7.0", "tailnet_agent_dataplane_drop_filtered_total 2.0"):
        assert line in text.splitlines(), line


async def test_readyz_waits_for_what_the_warmup_still_waits_for() -> None:
    node = FakeNode(netmap=object(), home_region=1, derp_connections={1: object()})
    waiting = ["ledger"]
    server = HealthServer(node, AgentMetrics(node), host="127.0.0.1", port=0, warmup=lambda: waiting)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(server.run())
        await asyncio.wait_for(server.started.wait(), 10)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/readyz") as resp:
                assert resp.status == 503
                assert (await resp.text()).startswith("not ready: no target has answered a probe yet: ledger")
            waiting.clear()
            async with http.get(f"http://127.0.0.1:{server.port}/readyz") as resp:
                assert resp.status == 200
        task.cancel()
