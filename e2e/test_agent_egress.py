"""The agent's node and egress forwarder against a real Headscale v0.29.2 and real tailscaled v1.98 peers.

Servers "on a peer's side" listen on 127.0.0.1 of this machine: a userspace tailscaled forwards
inbound tailnet TCP for its own IP to 127.0.0.1:<same port>. Unless a test asks for a direct path
(``udp_port=0``), everything between the agent and the peers goes through Headscale's embedded
DERP (region 999).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from hack.localenv import Environment, Headscale, SiteHost, TailscaleNode, free_port
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.control import ControlOptions
from tailnet_agent.forward import EgressForwarder
from tailnet_agent.health import AgentMetrics
from tailnet_agent.node import Node, NodeOptions
from tailnet_agent.streams import DialTimeoutError, NoRouteError

pytestmark = pytest.mark.integration

TAG = "tag:egress"
PEER_TAG = "tag:peer"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Agent:
    node: Node
    forwarder: EgressForwarder
    metrics: AgentMetrics

    def listen_port(self, target: str, port: int) -> int:
        t = next(t for t in self.forwarder.targets if t.name == target)
        return next(m.listen for m in t.ports if m.port == port)


@contextlib.asynccontextmanager
async def running_agent(headscale: Headscale, hostname: str, key: str, targets: list[Target] | None = None,
                        **options: Any) -> AsyncIterator[Agent]:
    """A Node (and an egress forwarder on 127.0.0.1 when ``targets`` are given), ready before the body."""
    control = ControlOptions(url=headscale.url, auth_key=key, hostname=hostname, ca_bundle=headscale.ca_bundle,
                             backoff=Backoff(initial=0.2, maximum=2.0))
    defaults = NodeOptions(control=control, derp_backoff=derp_backoff(initial=0.1, maximum=1.0), dial_timeout=15.0,
                           udp_port=None)
    node = Node(dataclasses.replace(defaults, **options))
    metrics = AgentMetrics(node)
    forwarder = EgressForwarder(node, tuple(targets or ()), bind_address="127.0.0.1", metrics=metrics,
                                dial_timeout=node.options.dial_timeout)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(node.run(), name="node")
            if targets:
                tg.create_task(forwarder.run(), name="egress")

    task = asyncio.create_task(main(), name=f"agent-{hostname}")
    try:
        await eventually(lambda: task.done() or (node.ready and (not targets or forwarder.listening.is_set())),
                         timeout=30, what=f"{hostname} ready")
        if task.done():
            task.result()
        yield Agent(node, forwarder, metrics)
        if task.done():
            task.result()  # a crash of the agent fails the test
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def local_server(handler: Handler, host: str | list[str] = "127.0.0.1") -> AsyncIterator[int]:
    """A TCP server on ``host`` (reached through a tailscaled peer's IP); yields its port."""
    port = free_port()
    server = await asyncio.start_server(handler, host, port)
    try:
        yield port
    finally:
        server.close()


async def wait_peer_sees(peer: TailscaleNode, hostname: str) -> None:
    def seen() -> bool:
        return any(p.get("HostName") == hostname and p.get("Relay") for p in peer.peers())

    await eventually(lambda: asyncio.to_thread(seen), timeout=30, what=f"{peer.hostname} sees {hostname} with a relay")


def target(name: str, address: str, port: int) -> Target:
    return Target(name=name, address=address, ports=(PortMapping(port=port, listen=free_port()),))


async def read_all(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while chunk := await reader.read(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def set_policy(headscale: Headscale, policy: dict[str, object]) -> None:
    headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(policy)})


# -- joining --------------------------------------------------------------------------------------


async def test_joins_with_a_tagged_ephemeral_key_and_peers_see_it(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-watch", headscale, authkey=key)
    async with running_agent(headscale, "agent-join", key) as agent:
        node = await eventually(lambda: headscale.node_by_name("agent-join"), timeout=20, what="node listed")
        assert TAG in node.get("tags", []), node
        assert (node.get("preAuthKey") or {}).get("ephemeral") is True
        await wait_peer_sees(peer, "agent-join")
        status = next(p for p in peer.peers() if p.get("HostName") == "agent-join")
        assert set(status["TailscaleIPs"]) == set(agent.node.addresses())
        region = agent.node.netmap.derp_map.regions[agent.node.home_region]  # type: ignore[union-attr]
        assert status["Relay"] == region.region_code
        assert agent.node.ready and agent.node.control_connected


# -- egress to a tailscaled peer ------------------------------------------------------------------


async def http_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = await reader.readuntil(b"\r\n\r\n")
    path = request.split(b" ", 2)[1].decode()
    body = f"hello from the peer side, path {path}\n".encode()
    writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    writer.close()


async def get_through(listen_port: int, path: str) -> bytes:
    """One HTTP/1.0 GET of ``path`` through the agent's listener on ``listen_port``: the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", listen_port)
    writer.write(f"GET {path} HTTP/1.0\r\nHost: web\r\n\r\n".encode())
    await writer.drain()
    response = await asyncio.wait_for(read_all(reader), 30)
    writer.close()
    return response


async def test_egress_reaches_an_http_server_behind_a_tailscaled_peer(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-web", headscale, authkey=key)
    async with local_server(http_handler) as port:
        tgt = target("web", peer.ipv4(), port)
        async with running_agent(headscale, "agent-web", key, [tgt]) as agent:
            await wait_peer_sees(peer, "agent-web")
            response = await get_through(agent.listen_port("web", port), "/over-the-agent")
            assert response.startswith(b"HTTP/1.0 200 OK\r\n"), response
            assert response.endswith(b"\r\n\r\nhello from the peer side, path /over-the-agent\n")
            # By MagicDNS name too, straight from the node.
            r2, w2 = await agent.node.open_connection("ts-web", port)
            w2.write(b"GET /by-name HTTP/1.0\r\n\r\n")
            assert (await asyncio.wait_for(read_all(r2), 30)).endswith(b"path /by-name\n")
            w2.close()
            assert agent.metrics.connections.labels("web")._value.get() == 1
            metrics = agent.metrics.render().decode()
            assert 'tailnet_agent_bytes_total{direction="received",target="web"}' in metrics
            assert "tailnet_agent_derp_connected 1.0" in metrics


async def test_egress_reaches_a_peer_by_its_ipv6_address(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    """A target at a peer's tailnet IPv6 address (fd7a:115c:a1e0::/48) works like one at its IPv4 one."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-web-v6", headscale, authkey=key)
    # tailscaled (userspace) hands a connection to its IPv6 address to the host's ::1
    async with contextlib.AsyncExitStack() as stack:
        port = await stack.enter_async_context(local_server(http_handler, ["127.0.0.1", "::1"]))
        agent = await stack.enter_async_context(
            running_agent(headscale, "agent-web-v6", key, [target("web", peer.ipv6(), port)]))
        await wait_peer_sees(peer, "agent-web-v6")
        response = await get_through(agent.listen_port("web", port), "/over-ipv6")
        assert response.endswith(b"\r\n\r\nhello from the peer side, path /over-ipv6\n"), response


def direct_peers(agent: Agent) -> list[str]:
    """Hostnames of the peers the agent has a direct UDP path to."""
    netmap = agent.node.netmap
    if netmap is None:
        return []
    return [p.hostname or p.name for p in netmap.peers.values()
            if p.key.startswith("nodekey:")
            and agent.node.disco.direct_path(bytes.fromhex(p.key.removeprefix("nodekey:"))) is not None]


@pytest.mark.parametrize("path", ["derp", "direct"])
async def test_64_mib_each_way_through_one_connection(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, path: str) -> None:
    size = 64 << 20
    download = os.urandom(size)
    upload = os.urandom(size)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def receive() -> bytes:
            digest = hashlib.sha256()
            while chunk := await reader.read(1 << 20):
                digest.update(chunk)
            return digest.digest()

        receiving = asyncio.create_task(receive())
        for i in range(0, size, 1 << 20):
            writer.write(download[i:i + (1 << 20)])
            await writer.drain()
        writer.write(await receiving)  # the digest of what arrived, after the download
        await writer.drain()
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes(f"ts-bulk-{path}", headscale, authkey=key)
    options = {"udp_port": 0} if path == "direct" else {}
    async with local_server(handler) as port, \
            running_agent(headscale, f"agent-bulk-{path}", key, [target("bulk", peer.ipv4(), port)],
                          **options) as agent:
        await wait_peer_sees(peer, f"agent-bulk-{path}")
        if path == "direct":
            await connect_and_close(agent.listen_port("bulk", port))  # traffic makes the peer worth a path
            await eventually(lambda: direct_peers(agent) == [f"ts-bulk-{path}"], timeout=30,
                             what="a direct UDP path to the peer")
        before = dict(agent.node.counters)
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("bulk", port))
        started = time.perf_counter()

        async def send() -> None:
            for i in range(0, size, 1 << 20):
                writer.write(upload[i:i + (1 << 20)])
                await writer.drain()
            writer.write_eof()

        sending = asyncio.create_task(send())
        received = await asyncio.wait_for(read_all(reader), 240)
        await sending
        elapsed = time.perf_counter() - started
        writer.close()
        assert len(received) == size + 32
        assert hashlib.sha256(received[:size]).digest() == hashlib.sha256(download).digest()
        assert received[size:] == hashlib.sha256(upload).digest()
        sent_udp = agent.node.counters.get("udp_bytes_out", 0) - before.get("udp_bytes_out", 0)
        got_udp = agent.node.counters.get("udp_bytes_in", 0) - before.get("udp_bytes_in", 0)
        if path == "direct":
            assert sent_udp > size and got_udp > size, "both directions went over the direct path"
            seen = next(p for p in peer.peers() if p.get("HostName") == f"agent-bulk-{path}")
            assert seen.get("CurAddr"), f"tailscaled sends to the agent directly: {seen}"
            assert "tailnet_agent_direct_peers 1.0" in agent.metrics.render().decode().splitlines()
        else:
            assert sent_udp == got_udp == 0
        print(f"\n64 MiB each way through the agent ({path}): {elapsed:.1f}s, "
              f"{2 * size / 1e6 / elapsed:.1f} MB/s total ({size / 1e6 / elapsed:.1f} MB/s per direction)")


async def test_the_stun_endpoint_reaches_peers(headscale: Headscale) -> None:
    """Headscale's embedded DERP answers STUN on 127.0.0.1: the address it saw is reported as an
    endpoint of type STUN, and another node's netmap carries it."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    async with running_agent(headscale, "agent-stun", key, udp_port=0) as agent, \
            running_agent(headscale, "agent-observer", key) as observer:
        port = agent.node.udp_port
        assert port is not None
        stun_endpoint = f"127.0.0.1:{port}"
        await eventually(lambda: stun_endpoint in dict(agent.node.control.endpoints), timeout=30,
                         what="the STUN-observed endpoint")
        kinds = dict(agent.node.control.endpoints)
        assert kinds[stun_endpoint] == 2, kinds

        def listed() -> bool:
            netmap = observer.node.netmap
            seen = [p for p in (netmap.peers.values() if netmap else ()) if p.hostname == "agent-stun"]
            return bool(seen) and stun_endpoint in seen[0].endpoints

        await eventually(listed, timeout=30, what="the observer's netmap lists the STUN endpoint")


async def test_a_direct_path_over_ipv6_to_a_peer_whose_only_endpoint_is_ipv6(
        environment: Environment, tailscale_nodes: TailscaleFactory) -> None:
    """The agent's UDP socket is dual-stack: a peer that STUN found only an IPv6 endpoint for (its
    local addresses left out, Headscale's STUN on ``[::1]`` alone) is reached directly over IPv6.
    The agent offers only its STUN endpoint too, so neither side learns an IPv4 address of the
    other (a ping from one would make it a path)."""
    headscale = environment.headscale(stun_ipv6=True)
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-v6", headscale, authkey=key)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(1 << 20))
        await writer.drain()
        writer.close()

    async with local_server(echo) as port, \
            running_agent(headscale, "agent-v6", key, [target("v6", peer.ipv4(), port)], udp_port=0,
                          local_endpoints=False) as agent:
        await wait_peer_sees(peer, "agent-v6")
        await eventually(lambda: any(text.startswith("[::1]:") for text, _ in agent.node.control.endpoints),
                         timeout=30, what="the agent's IPv6 endpoint from STUN")
        await connect_and_close(agent.listen_port("v6", port))
        await eventually(lambda: direct_peers(agent) == ["ts-v6"], timeout=30, what="a direct path to the peer")
        key_hex = next(p.key for p in agent.node.netmap.peers.values() if p.hostname == "ts-v6") \
            if agent.node.netmap else ""
        path = agent.node.disco.direct_path(bytes.fromhex(key_hex.removeprefix("nodekey:")))
        assert path is not None and path[0] == "::1", f"the path is {path}, not the peer's IPv6 endpoint"

        before = dict(agent.node.counters)
        payload = os.urandom(1 << 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("v6", port))
        writer.write(payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(1 << 20), 60) == payload
        writer.close()
        udp_out = agent.node.counters.get("udp_bytes_out", 0) - before.get("udp_bytes_out", 0)
        udp_in = agent.node.counters.get("udp_bytes_in", 0) - before.get("udp_bytes_in", 0)
        assert udp_out > 1 << 20 and udp_in > 1 << 20, "both directions went over the IPv6 path"


async def connect_and_close(port: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()


# -- half-close -----------------------------------------------------------------------------------


async def test_half_close_in_both_directions(headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    request = os.urandom(3 << 20)
    uploaded: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def reads_to_eof_then_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await read_all(reader)
        answer = hashlib.sha256(data).digest() + os.urandom(1 << 20)
        writer.write(b"%d\n" % len(data) + answer)
        await writer.drain()
        writer.close()

    async def closes_first_then_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"go ahead\n")
        await writer.drain()
        writer.write_eof()
        uploaded.set_result(await read_all(reader))
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-half", headscale, authkey=key)
    ip = peer.ipv4()
    async with local_server(reads_to_eof_then_answers) as port1, local_server(closes_first_then_reads) as port2, \
            running_agent(headscale, "agent-half", key, [target("a", ip, port1), target("b", ip, port2)]) as agent:
        await wait_peer_sees(peer, "agent-half")

        # The client shuts its write side and still gets the whole answer.
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("a", port1))
        writer.write(request)
        await writer.drain()
        writer.write_eof()
        answer = await asyncio.wait_for(read_all(reader), 60)
        writer.close()
        header, _, rest = answer.partition(b"\n")
        assert int(header) == len(request)
        assert rest[:32] == hashlib.sha256(request).digest() and len(rest) == 32 + (1 << 20)

        # The server shuts its write side first; the client keeps sending and all of it arrives.
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("b", port2))
        assert await asyncio.wait_for(read_all(reader), 30) == b"go ahead\n"  # EOF from the server
        writer.write(request)
        await writer.drain()
        writer.write_eof()
        assert hashlib.sha256(await asyncio.wait_for(uploaded, 60)).digest() == hashlib.sha256(request).digest()
        writer.close()


# -- subnet routes --------------------------------------------------------------------------------


async def test_reaches_a_host_behind_an_approved_subnet_route(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost]) -> None:
    host = site_host()
    host.serve_http(8080)
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    tailscale_nodes("site-router", headscale, authkey=key, advertise_routes=[host.subnet], site_router=True)
    router = await eventually(lambda: headscale.node_by_name("site-router"), timeout=20, what="router listed")
    async with running_agent(headscale, "agent-site", key, [target("site", host.address, 8080)]) as agent:
        with pytest.raises(NoRouteError, match=f"no route to {host.address}"):
            await agent.node.open_connection(host.address, 8080)  # advertised but not approved yet
        headscale.approve_routes(router["id"], [host.subnet])

        def routed() -> bool:
            netmap = agent.node.netmap
            return netmap is not None and any(
                str(net) == host.subnet for p in netmap.peers.values() for net in p.routable_ips)

        await eventually(routed, timeout=30, what="the approved route in the agent's netmap")
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("site", 8080))
        writer.write(b"GET /through-the-router HTTP/1.0\r\n\r\n")
        await writer.drain()
        response = await asyncio.wait_for(read_all(reader), 30)
        writer.close()
        assert response.startswith(b"HTTP/1.0 200"), response
        assert response.endswith(f"hello from {host.address}:8080 path /through-the-router\n".encode())


async def test_without_accept_routes_the_subnet_is_not_routed(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost]) -> None:
    host = site_host()
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    tailscale_nodes("site-router2", headscale, authkey=key, advertise_routes=[host.subnet], site_router=True)
    router = await eventually(lambda: headscale.node_by_name("site-router2"), timeout=20, what="router listed")
    headscale.approve_routes(router["id"], [host.subnet])
    async with running_agent(headscale, "agent-noroutes", key, accept_routes=False) as agent:
        def routed() -> bool:
            netmap = agent.node.netmap
            return netmap is not None and any(
                str(net) == host.subnet for p in netmap.peers.values() for net in p.routable_ips)

        await eventually(routed, timeout=30, what="the approved route in the agent's netmap")
        with pytest.raises(NoRouteError, match=f"no route to {host.address}: no peer or accepted route covers it"):
            await agent.node.open_connection(host.address, 8080)


# -- packet filter --------------------------------------------------------------------------------


async def proxy_connect(peer: TailscaleNode, ip: str, port: int, *, timeout: float) -> bool:
    """CONNECT through the peer's tailnet HTTP proxy; True if the tunnel opened and echoes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", peer.http_proxy_port)
    try:
        writer.write(f"CONNECT {ip}:{port} HTTP/1.1\r\nHost: {ip}:{port}\r\n\r\n".encode())
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        if b" 200" not in head.split(b"\r\n", 1)[0]:
            return False
        writer.write(b"ping\n")
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), timeout) == b"ping\n"
    finally:
        writer.close()


async def test_packet_filter_holds_both_ways(headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    owners: dict[str, list[str]] = {"tag:egress": [], "tag:peer": []}
    # Only the peers may talk among themselves: the agent's tag is granted nothing.
    set_policy(headscale, {"tagOwners": owners, "grants": [{"src": ["tag:peer"], "dst": ["tag:peer"], "ip": ["*"]}]})
    agent_key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer_key = headscale.create_preauth_key(tags=[PEER_TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-guarded", headscale, authkey=peer_key)
    peer_ip = peer.ipv4()
    served: list[bytes] = []

    async def recorder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(await reader.read(100))
        writer.close()

    async with local_server(recorder) as port, \
            running_agent(headscale, "agent-guarded", agent_key, [target("guarded", peer_ip, port)]) as agent:
        with pytest.raises((NoRouteError, DialTimeoutError)) as info:
            await agent.node.open_connection(peer_ip, port, timeout=5)
        assert str(info.value) in (f"no route to {peer_ip}: no peer or accepted route covers it",
                                   f"connection to {peer_ip}:{port} timed out (dropped by the packet filter?)")
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("guarded", port))
        writer.write(b"must not pass")
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(read_all(reader), 30) == b""
        writer.close()
        errors = agent.metrics.render().decode()
        assert 'tailnet_agent_dial_errors_total{reason="no_route",target="guarded"} 1.0' in errors \
            or 'tailnet_agent_dial_errors_total{reason="timeout",target="guarded"} 1.0' in errors, errors
        assert served == []

        # Inbound: the agent may reach the peer, not the other way round.
        set_policy(headscale, {"tagOwners": owners, "grants": [{"src": ["tag:egress"], "dst": ["tag:peer"],
                                                               "ip": ["*"]}]})
        accepted: list[str] = []

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(str(writer.get_extra_info("peername")))
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        listen_port = free_port()
        server = agent.node.start_server(echo, listen_port)
        agent_ip = agent.node.addresses()[0]
        await wait_peer_sees(peer, "agent-guarded")
        dropped = agent.node.counters.get("drop_filtered", 0)
        assert not await proxy_connect(peer, agent_ip, listen_port, timeout=8)
        assert accepted == []
        assert agent.node.counters["drop_filtered"] > dropped

        # The same dial is accepted once the policy grants it (the check above can fail).
        set_policy(headscale, {"tagOwners": owners, "grants": [
            {"src": ["tag:egress"], "dst": ["tag:peer"], "ip": ["*"]},
            {"src": ["tag:peer"], "dst": ["tag:egress"], "ip": [f"tcp:{listen_port}"]}]})

        def granted() -> bool:
            netmap = agent.node.netmap
            return netmap is not None and any(p.first == listen_port for r in netmap.packet_filter for p in r.dst_ports)

        await eventually(granted, timeout=30, what="the grant in the agent's packet filter")
        assert await proxy_connect(peer, agent_ip, listen_port, timeout=15)
        assert accepted and accepted[0].startswith(f"('{peer_ip}'")
        server.close()


# -- reconnecting ---------------------------------------------------------------------------------


async def get(port: int, path: str, *, timeout: float = 10) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        return await asyncio.wait_for(read_all(reader), timeout)
    finally:
        writer.close()


async def get_works(port: int, path: str) -> bool:
    """Whether a GET of ``path`` through the listener on ``port`` gets the server's answer now."""
    try:
        return (await get(port, path, timeout=5)).endswith(f"path {path}\n".encode())
    except (OSError, TimeoutError):
        return False


async def test_survives_a_headscale_restart_and_a_cut_derp_connection(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-steady", headscale, authkey=key)
    async with local_server(http_handler) as port, \
            running_agent(headscale, "agent-steady", key, [target("web", peer.ipv4(), port)]) as agent:
        await wait_peer_sees(peer, "agent-steady")
        listen = agent.listen_port("web", port)
        assert (await get(listen, "/before")).endswith(b"path /before\n")

        # Cut the DERP connection from our side: the supervisor reconnects.
        old = agent.node.derp_connections[agent.node.home_region]
        await old.close()
        await eventually(lambda: agent.node.derp_connections.get(agent.node.home_region) not in (None, old),
                         timeout=20, what="a new DERP connection")
        assert (await get(listen, "/after-derp-cut", timeout=20)).endswith(b"path /after-derp-cut\n")

        # Restart Headscale (control and its embedded DERP).
        sessions = agent.node.control.map_sessions
        derp = agent.node.derp_connections[agent.node.home_region]
        await asyncio.to_thread(headscale.restart)
        await eventually(lambda: agent.node.control.map_sessions > sessions and agent.node.ready
                         and agent.node.derp_connections[agent.node.home_region] is not derp,
                         timeout=60, what="control and DERP back after the restart")

        await eventually(lambda: get_works(listen, "/after-restart"), timeout=60, interval=1,
                         what="a new dial through the agent after the restart")


async def test_an_expired_agent_joins_again_and_traffic_continues(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    """An admin expires the agent's (tagged) node. Headscale 0.29 keeps that expiry through a node
    key rotation, so the agent joins as a new node with its pre-auth key; dials work again."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-rotate", headscale, authkey=key)
    async with local_server(http_handler) as port, \
            running_agent(headscale, "agent-rotate", key, [target("web", peer.ipv4(), port)]) as agent:
        await wait_peer_sees(peer, "agent-rotate")
        listen = agent.listen_port("web", port)
        assert (await get(listen, "/before")).endswith(b"path /before\n")
        old_key, old_addresses = agent.node.dataplane.public_key, agent.node.addresses()
        listed = headscale.node_by_name("agent-rotate")
        assert listed is not None and listed["nodeKey"] == f"nodekey:{old_key.hex()}"

        await asyncio.to_thread(headscale.cli, "nodes", "expire", "--identifier", str(listed["id"]))
        await eventually(lambda: agent.node.dataplane.public_key != old_key and agent.node.ready,
                         timeout=60, what="the agent joined again with a new node key, DERP reconnected")
        new_key = agent.node.dataplane.public_key
        assert agent.node.addresses() and agent.node.addresses() != old_addresses, "a new node, new addresses"

        def listed_with_new_key() -> bool:
            return any(n.get("nodeKey") == f"nodekey:{new_key.hex()}" for n in headscale.nodes())

        await eventually(lambda: asyncio.to_thread(listed_with_new_key), timeout=30,
                         what="Headscale lists the agent with its new node key")

        await eventually(lambda: get_works(listen, "/after-rejoin"), timeout=60, interval=1,
                         what="a new dial through the agent after it joined again")


async def _echo_through(port: int, size: int, *, half_close: bool, idle: float = 15.0) -> int:
    """Send ``size`` random bytes to an echo server through the agent and count what comes back
    (until EOF, or ``idle`` seconds without data); ``half_close`` sends EOF after the upload."""
    data = os.urandom(size)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        for i in range(0, size, 1 << 16):
            writer.write(data[i:i + (1 << 16)])
            await writer.drain()
        if half_close:
            writer.write_eof()

    sending = asyncio.create_task(send())
    digest, received = hashlib.sha256(), 0
    try:
        while received < size or half_close:
            chunk = await asyncio.wait_for(reader.read(1 << 16), idle)
            if not chunk:
                break
            digest.update(chunk)
            received += len(chunk)
    except TimeoutError:
        pass
    finally:
        sending.cancel()
        writer.close()
    return received if digest.digest() == hashlib.sha256(data[:received]).digest() else -1




@pytest.mark.parametrize("half_close", [
    False,
    True,
])
async def test_echo_through_a_subnet_router_after_the_client_half_closes(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost],
        half_close: bool) -> None:
    """16 MiB echoed by a host on a site LAN behind a tailscaled subnet router, over the direct
    path, in rounds: everything comes back, with and without the client half-closing first."""
    host = site_host()
    host.serve_echo(9000)
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    tailscale_nodes("echo-router", headscale, authkey=key, advertise_routes=[host.subnet], site_router=True)
    router = await eventually(lambda: headscale.node_by_name("echo-router"), timeout=20, what="router listed")
    headscale.approve_routes(router["id"], [host.subnet])
    async with running_agent(headscale, "agent-echo", key, [target("echo", host.address, 9000)],
                             udp_port=0) as agent:
        port = agent.listen_port("echo", 9000)
        size = 16 << 20
        for round_ in range(6):
            received = await _echo_through(port, size, half_close=half_close)
            assert received == size, f"round {round_}: {received} of {size} bytes came back intact"
