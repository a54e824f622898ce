"""The agent's targets followed from their file, ``/status`` and reachability probes, and names
through the tailnet's DNS configuration, against Headscale v0.29.2 and tailscaled v1.98 peers.

The agent is assembled as ``tailnet_agent.__main__`` does (node, forwarder with a prober, targets
watcher, health server with ``/status``), with short intervals so nothing waits long.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import TAG, read_all, wait_peer_sees
from hack.localenv import Environment, Headscale, SiteHost, free_port
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.contract.clock import RealClock
from tailnet_agent.contract.endpoints import STATUS_PATH
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.control import ControlOptions
from tailnet_agent.forward import EgressForwarder
from tailnet_agent.health import AgentMetrics, HealthServer
from tailnet_agent.node import Node, NodeOptions
from tailnet_agent.probe import Prober
from tailnet_agent.status import egress_status
from tailnet_agent.targets import TargetsWatcher

pytestmark = pytest.mark.integration


@dataclass
class FileAgent:
    node: Node
    forwarder: EgressForwarder
    watcher: TargetsWatcher[Target]
    metrics: AgentMetrics
    health: HealthServer

    async def status(self) -> dict[str, Any]:
        return await fetch_status(self.health)

    async def target_status(self, name: str) -> dict[str, Any]:
        return next(t for t in (await self.status())["targets"] if t["name"] == name)


async def fetch_status(health: HealthServer) -> dict[str, Any]:
    """``GET /status`` of a running health server."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{health.port}{STATUS_PATH}") as resp:
        assert resp.status == 200
        document: dict[str, Any] = await resp.json()
        return document


@contextlib.asynccontextmanager
async def running(tasks: dict[str, Coroutine[Any, Any, None]], ready: Callable[[], bool], what: str,
                  ) -> AsyncIterator[None]:
    """Run ``tasks`` in one TaskGroup until the body ends, after ``ready``; a crash fails the test."""
    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for name, coro in tasks.items():
                tg.create_task(coro, name=name)

    task = asyncio.create_task(main(), name=what)
    try:
        await eventually(lambda: task.done() or ready(), timeout=30, what=f"{what} ready")
        if task.done():
            task.result()
        yield
        if task.done():
            task.result()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def write_like_kubelet(directory: Path, targets: list[Target] | str) -> Path:
    """Kubelet's atomic update of a mounted ConfigMap: a new ``..<stamp>`` directory, ``..data`` renamed."""
    text = targets if isinstance(targets, str) else json.dumps(
        [{"name": t.name, "address": t.address, "ports": [{"port": m.port, "listen": m.listen} for m in t.ports]}
         for t in targets])
    stamp = directory / f"..{os.urandom(4).hex()}"
    stamp.mkdir()
    (stamp / "targets.json").write_text(text)
    (directory / "..data_tmp").symlink_to(stamp.name)
    (directory / "..data_tmp").rename(directory / "..data")
    if not (directory / "targets.json").is_symlink():
        (directory / "targets.json").symlink_to("..data/targets.json")
    return directory / "targets.json"


@contextlib.asynccontextmanager
async def file_agent(headscale: Headscale, hostname: str, key: str, directory: Path, targets: list[Target],
                     ) -> AsyncIterator[FileAgent]:
    clock = RealClock()
    path = write_like_kubelet(directory, targets)
    control = ControlOptions(url=headscale.url, auth_key=key, hostname=hostname, ca_bundle=headscale.ca_bundle,
                             backoff=Backoff(initial=0.2, maximum=2.0))
    node = Node(NodeOptions(control=control, derp_backoff=derp_backoff(initial=0.1, maximum=1.0), dial_timeout=15.0,
                            udp_port=None), clock=clock)
    metrics = AgentMetrics(node)
    forwarder = EgressForwarder(node, tuple(targets), bind_address="127.0.0.1", metrics=metrics, dial_timeout=15.0,
                                prober=Prober(node, clock, metrics=metrics, interval=1.0, timeout=5.0))
    watcher = TargetsWatcher(path, forwarder.apply, clock=clock, interval=0.2,
                             initial_digest=hashlib.sha256(path.read_bytes()).hexdigest(),
                             report=metrics.targets_reload_outcome)
    health = HealthServer(node, metrics, host="127.0.0.1", port=0,
                          status=lambda: egress_status(node, forwarder, watcher))

    tasks = {"node": node.run(), "egress": forwarder.run(), "targets": watcher.run(), "health": health.run()}
    async with running(tasks, lambda: node.ready and forwarder.listening.is_set() and health.started.is_set(),
                       f"agent-{hostname}"):
        yield FileAgent(node, forwarder, watcher, metrics, health)


async def banner_server(banner: bytes) -> tuple[asyncio.Server, int]:
    """Sends ``banner``, then echoes lines: tells which target a connection reached."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(banner)
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", free_port())
    return server, int(server.sockets[0].getsockname()[1])


async def connect(listen: int, banner: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    assert await asyncio.wait_for(reader.readexactly(len(banner)), 30) == banner
    return reader, writer


async def test_targets_reload_keeps_open_connections_and_status_reports_routes(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-reload", headscale, authkey=key)
    ip = peer.ipv4()
    servers = {n: await banner_server(f"{n}\n".encode()) for n in ("a", "b", "c", "c2", "d")}
    port = {n: p for n, (_, p) in servers.items()}
    listen = {n: free_port() for n in ("a", "b", "c", "d", "nowhere")}

    def tgt(name: str, server: str, address: str = ip) -> Target:
        return Target(name=name, address=address, ports=(PortMapping(port=port[server], listen=listen[name]),))

    a, c, d = tgt("a", "a"), tgt("c", "c"), tgt("d", "d")
    try:
        async with file_agent(headscale, "agent-reload", key, tmp_path, [a, c, d]) as agent:
            await wait_peer_sees(peer, "agent-reload")
            ra, wa = await connect(listen["a"], b"a\n")
            rd, wd = await connect(listen["d"], b"d\n")

            b, c2 = tgt("b", "b"), tgt("c", "c2")
            nowhere = Target(name="nowhere", address="198.18.250.1",
                             ports=(PortMapping(port=80, listen=listen["nowhere"]),))
            write_like_kubelet(tmp_path, [a, b, c2, nowhere])
            await eventually(lambda: [t.name for t in agent.forwarder.targets] == ["a", "b", "c", "nowhere"],
                             timeout=10, what="the new targets in force")
            wa.write(b"still here\n")
            assert await asyncio.wait_for(ra.readline(), 30) == b"still here\n", "A's connection survived"
            await connect(listen["b"], b"b\n")
            await connect(listen["c"], b"c2\n")
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", listen["d"])
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(read_all(rd), 30) == b"", "D's connection ended"

            # A malformed file: the targets in force stay; the error is reported.
            write_like_kubelet(tmp_path, '[{"name": "a", "address": "x", "ports": []}]')
            document = await eventually(_with_error(agent), timeout=10, what="the file error on /status")
            assert document["targetsFile"]["error"] == "TAILNET_TARGETS_FILE[0] (a): ports must be a non-empty list"
            metrics = agent.metrics.render().decode()
            assert "tailnet_agent_targets_reload_errors_total 1.0" in metrics
            assert "tailnet_agent_targets_file_valid 0.0" in metrics
            assert [t.name for t in agent.forwarder.targets] == ["a", "b", "c", "nowhere"]
            wa.write(b"after the bad file\n")
            assert await asyncio.wait_for(ra.readline(), 30) == b"after the bad file\n"

            # /status: the node, each target's route and its probe.
            # The first probe of a may have run before the peer knew the agent (its WireGuard handshake
            # is retried only after 5 s): wait for one that reached it.
            entry = await eventually(_probed(agent, "a", reachable=True), timeout=20, what="a probe that reached a")
            assert document["node"]["id"] and document["node"]["name"].startswith("agent-reload")
            assert document["node"]["addresses"] == agent.node.addresses()
            assert entry["state"] == "Ready" and entry["router"] == "ts-reload.tailnet.test"
            assert entry["reachable"] is True and isinstance(entry["latencyMs"], float) and entry["checkedAt"]
            assert entry["ports"] == [port["a"]] and entry["message"] == f"{ip} is ts-reload.tailnet.test"
            lost = await eventually(_probed(agent, "nowhere"), timeout=20, what="a probe of nowhere")
            assert (lost["state"], lost["router"], lost["reachable"]) == ("NoRoute", None, False)
            assert lost["message"].startswith("no peer in the netmap carries a route to 198.18.250.1")
            metrics = agent.metrics.render().decode()
            assert 'tailnet_agent_target_reachable{target="a"} 1.0' in metrics
            assert 'tailnet_agent_target_reachable{target="nowhere"} 0.0' in metrics
            assert 'tailnet_agent_target_probe_seconds_count{target="a"}' in metrics
            assert not [line for line in metrics.splitlines() if line.startswith("tailnet_agent_target_")
                        and 'target="d"' in line], "no probe series for a removed target"
            for w in (wa, wd):
                w.close()
    finally:
        for server, _ in servers.values():
            server.close()


def _with_error(agent: FileAgent) -> Callable[[], Any]:
    async def check() -> dict[str, Any] | None:
        document = await agent.status()
        return document if document["targetsFile"]["error"] else None
    return check


def _probed(agent: FileAgent, name: str, *, reachable: bool | None = None) -> Callable[[], Any]:
    """The target's status entry once a probe has run (and, with ``reachable``, had that outcome)."""
    async def check() -> dict[str, Any] | None:
        entry = await agent.target_status(name)
        if not entry["checkedAt"] or reachable not in (None, entry["reachable"]):
            return None
        return entry
    return check


async def test_a_name_from_the_tailnets_extra_records_reaches_a_site_host(
        environment: Environment, tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost],
        tmp_path: Path) -> None:
    host = site_host()
    host.serve_http(8080)
    name = "ledger.tailnet.example.internal"
    headscale = environment.headscale(extra_records=[{"name": name, "type": "A", "value": host.address}])
    try:
        key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
        tailscale_nodes("site-gw", headscale, authkey=key, advertise_routes=[host.subnet], site_router=True)
        router = await eventually(lambda: headscale.node_by_name("site-gw"), timeout=20, what="router listed")
        headscale.approve_routes(router["id"], [host.subnet])
        ledger = Target(name="ledger", address=name, ports=(PortMapping(port=8080, listen=free_port()),))
        missing = Target(name="missing", address="missing.tailnet.example.internal",
                         ports=(PortMapping(port=80, listen=free_port()),))
        async with file_agent(headscale, "agent-dns", key, tmp_path, [ledger, missing]) as agent:
            entry = await eventually(_ready(agent, "ledger"), timeout=30, what="ledger Ready and reachable")
            assert entry["router"] == "site-gw.tailnet.test" and entry["routerId"] == str(router["id"])
            assert entry["message"] == f"{name} ({host.address}) routed by site-gw.tailnet.test"
            reader, writer = await asyncio.open_connection("127.0.0.1", ledger.ports[0].listen)
            writer.write(b"GET /by-extra-record HTTP/1.0\r\n\r\n")
            await writer.drain()
            response = await asyncio.wait_for(read_all(reader), 30)
            writer.close()
            assert response.endswith(f"hello from {host.address}:8080 path /by-extra-record\n".encode()), response
            gone = await eventually(_probed(agent, "missing"), timeout=20, what="a probe of missing")
            assert (gone["state"], gone["reachable"], gone["router"]) == ("Unresolved", False, None)
            assert gone["message"].startswith("cannot resolve 'missing.tailnet.example.internal': not a MagicDNS "
                                              "name, no extra record, and no split-DNS route")
    finally:
        headscale.stop()


def _ready(agent: FileAgent, name: str) -> Callable[[], Any]:
    async def check() -> dict[str, Any] | None:
        entry = await agent.target_status(name)
        return entry if entry["state"] == "Ready" and entry["reachable"] else None
    return check

