"""The agent's control client against a real Headscale v0.29.2 and real tailscaled v1.98 nodes.

Each test gets a fresh Headscale; the client runs as a task for the test's duration and any
exception it raises fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from hack.localenv import Headscale
from tailnet_agent.contract.backoff import Backoff
from tailnet_agent.control import ControlClient, ControlOptions, NetMap

pytestmark = pytest.mark.integration

TAG = "tag:agent"
CGNAT = ipaddress.ip_network("100.64.0.0/10")
ULA = ipaddress.ip_network("fd7a:115c:a1e0::/48")


@contextlib.asynccontextmanager
async def running_client(headscale: Headscale, hostname: str, key: str) -> AsyncIterator[ControlClient]:
    client = ControlClient(ControlOptions(url=headscale.url, auth_key=key, hostname=hostname,
                                          ca_bundle=headscale.ca_bundle,
                                          backoff=Backoff(initial=0.2, maximum=2.0)))
    task = asyncio.create_task(client.run(), name=f"control-{hostname}")
    try:
        yield client
        if task.done():
            task.result()  # surface a crash of the client as the test's failure
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def netmap_of(client: ControlClient) -> NetMap:
    assert client.netmap is not None
    return client.netmap


def tagged_key(headscale: Headscale) -> str:
    return headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)


async def _node(headscale: Headscale, name: str) -> dict[str, Any]:
    node: dict[str, Any] = await eventually(lambda: headscale.node_by_name(name), timeout=20,
                                            what=f"headscale lists {name}")
    return node


async def test_registers_with_a_tag_only_ephemeral_key(headscale: Headscale) -> None:
    async with running_client(headscale, "agent-reg", tagged_key(headscale)) as client:
        await eventually(lambda: client.registered, timeout=30, what="registration")
        node = await _node(headscale, "agent-reg")
        assert TAG in node.get("tags", []), node
        assert (node.get("preAuthKey") or {}).get("ephemeral") is True, node
        assert node["nodeKey"] == str(client.keys.node.public)
        assert node["machineKey"] == str(client.keys.machine.public)


async def test_netmap_has_addresses_derp_map_and_peer(headscale: Headscale,
                                                      tailscale_nodes: TailscaleFactory) -> None:
    key = tagged_key(headscale)
    peer = tailscale_nodes("ts-peer-a", headscale, authkey=key)
    peer_ips = {ipaddress.ip_address(ip) for ip in peer.status()["Self"]["TailscaleIPs"]}
    async with running_client(headscale, "agent-nm", key) as client:
        await eventually(lambda: client.netmap is not None, timeout=30, what="first netmap")
        nm = netmap_of(client)
        own = [net.network_address for net in nm.self_node.addresses]
        assert any(ip in CGNAT for ip in own) and any(ip in ULA for ip in own), own
        assert TAG in nm.self_node.tags
        region = nm.derp_map.regions.get(999)
        assert region is not None, nm.derp_map
        assert region.nodes and region.nodes[0].ipv4 == "127.0.0.1"
        assert region.nodes[0].derp_port == headscale.port

        def peer_in_netmap() -> bool:
            current = netmap_of(client)
            return any({n.network_address for n in p.addresses} == peer_ips for p in current.peers.values())

        await eventually(peer_in_netmap, timeout=30, what="tailscaled peer in the agent's netmap")
        found = next(p for p in netmap_of(client).peers.values() if p.hostname == "ts-peer-a")
        assert found.key.startswith("nodekey:") and found.disco_key.startswith("discokey:")
        assert found.home_derp == 999


async def test_tailscaled_peer_lists_the_agent(headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = tagged_key(headscale)
    peer = tailscale_nodes("ts-peer-b", headscale, authkey=key)
    async with running_client(headscale, "agent-seen", key) as client:
        await eventually(lambda: client.netmap is not None, timeout=30, what="first netmap")
        own = {str(n.network_address) for n in netmap_of(client).self_node.addresses}

        def listed() -> bool:
            return any(p.get("HostName") == "agent-seen" and set(p.get("TailscaleIPs") or []) == own
                       for p in peer.peers())

        await eventually(listed, timeout=30, what="tailscaled lists the agent")


async def test_late_peer_arrives_as_a_delta(headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = tagged_key(headscale)
    tailscale_nodes("ts-early", headscale, authkey=key)
    async with running_client(headscale, "agent-delta", key) as client:
        await eventually(lambda: client.netmap is not None and len(client.netmap.peers) == 1, timeout=30,
                         what="netmap with the first peer")
        sessions = client.map_sessions
        late = tailscale_nodes("ts-late", headscale, authkey=key)
        late_ips = {ipaddress.ip_address(ip) for ip in late.status()["Self"]["TailscaleIPs"]}

        def has_late() -> bool:
            return any({n.network_address for n in p.addresses} == late_ips
                       for p in netmap_of(client).peers.values())

        await eventually(has_late, timeout=30, what="late peer in the agent's netmap")
        assert len(netmap_of(client).peers) == 2
        assert client.map_sessions == sessions, "the late peer must arrive on the same map poll"


async def test_reconnects_after_headscale_restart(headscale: Headscale) -> None:
    async with running_client(headscale, "agent-restart", tagged_key(headscale)) as client:
        await eventually(lambda: client.netmap is not None, timeout=30, what="first netmap")
        node_id = (await _node(headscale, "agent-restart"))["id"]
        assert client.map_sessions == 1
        await asyncio.to_thread(headscale.restart)
        await eventually(lambda: client.map_sessions >= 2, timeout=30, what="map poll resumed after restart")
        node = await _node(headscale, "agent-restart")
        assert node["id"] == node_id, "the node must stay registered, not be re-created"

        def online() -> bool:
            current = headscale.node_by_name("agent-restart")
            return bool(current and current.get("online"))

        await eventually(online, timeout=30, what="headscale sees the agent online again")


async def test_reporting_a_home_derp_region_reaches_the_peers(
    headscale: Headscale, tailscale_nodes: TailscaleFactory
) -> None:
    peer = tailscale_nodes("watcher", headscale, authkey=tagged_key(headscale))
    async with running_client(headscale, "agent-home", tagged_key(headscale)) as client:
        await eventually(lambda: client.netmap is not None and client.netmap.derp_map.regions, timeout=30,
                         what="a netmap with a DERP map")
        region = sorted(netmap_of(client).derp_map.regions)[0]
        assert await client.set_preferred_derp(region)

        def relay_of_agent() -> str | None:
            for status in peer.peers():
                if status.get("HostName") == "agent-home" and status.get("Relay"):
                    return str(status["Relay"])
            return None

        relay = await eventually(relay_of_agent, timeout=30, what="the peer to see the agent's home DERP")
        assert relay == netmap_of(client).derp_map.regions[region].region_code


async def test_a_refused_key_is_read_again_from_its_file(headscale: Headscale, tmp_path: Path) -> None:
    """A container restarted before kubelet refreshed its mounted Secret starts with a key that
    Headscale refuses; the client reads the key file again and registers once it holds the new key
    (written as kubelet does: a new file renamed over the old)."""
    good = tagged_key(headscale)
    stale = good[:-6] + ("000000" if not good.endswith("000000") else "111111")
    key_file = tmp_path / "authkey"
    key_file.write_text(stale + "\n")
    client = ControlClient(ControlOptions(url=headscale.url, auth_key=stale, auth_key_file=key_file,
                                          hostname="agent-rekeyed", ca_bundle=headscale.ca_bundle,
                                          backoff=Backoff(initial=0.2, maximum=2.0)))
    task = asyncio.create_task(client.run(), name="control-rekeyed")
    try:
        await eventually(lambda: task.done() or client.key_refused is not None, timeout=30,
                         what="the stale key refused")
        assert not task.done(), task.exception() if not task.cancelled() else "cancelled"
        (tmp_path / ".authkey.new").write_text(good + "\n")
        (tmp_path / ".authkey.new").rename(key_file)
        await eventually(lambda: task.done() or client.netmap is not None, timeout=30, what="registered")
        assert not task.done(), task.exception() if not task.cancelled() else "cancelled"
        assert client.key_refused is None and client.auth_key == good
        await _node(headscale, "agent-rekeyed")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
