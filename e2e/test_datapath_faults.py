"""Faults on the data path: a cut UDP path and an unreachable Headscale, with real peers.

The agent and a tailscaled peer first agree on a direct UDP path (both on 127.0.0.1). An echo
transfer then runs through the agent on one TCP connection, in 1 MiB round trips, while:

* an nftables rule (in a table this test creates and always deletes) drops every UDP datagram
  from or to the agent's socket: the connection falls back to DERP and carries on intact, and
  once the rule is gone the direct path comes back (seen in the agent's metrics);
* Headscale, and with it the embedded DERP, is stopped for ``TAILNET_OUTAGE_SECONDS`` (default
  30; the issue's figure is 300): the transfer and new connections keep going over the
  existing WireGuard session, and when Headscale returns the agent reconnects and learns of a
  peer that joined since.

Needs root for nftables; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import (
    Agent,
    connect_and_close,
    direct_peers,
    local_server,
    running_agent,
    target,
    wait_peer_sees,
)
from hack.localenv import Headscale
from hack.localenv.hostnet import TEST_TABLE_PREFIX

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nftables"),
]

TAG = "tag:egress"
CHUNK = 1 << 20
OUTAGE_SECONDS = float(os.environ.get("TAILNET_OUTAGE_SECONDS", "30"))


def nft(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, check=True).stdout


@contextlib.contextmanager
def udp_cut(port: int) -> Iterator[str]:
    """Drop UDP from and to ``port`` on this machine until the block exits; yields the table name."""
    table = f"{TEST_TABLE_PREFIX}cut_{os.getpid()}_{port}"
    nft("-f", "-", stdin=(
        f"table inet {table} {{\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"    udp sport {port} counter drop\n"
        f"    udp dport {port} counter drop\n"
        "  }\n"
        "}\n"))
    try:
        yield table
    finally:
        nft("delete", "table", "inet", table)
    assert table not in nft("list", "tables")


def dropped(table: str) -> int:
    """Packets the cut has dropped so far."""
    out = nft("list", "table", "inet", table)
    return sum(int(word.split()[0]) for word in out.split("packets ")[1:])


@dataclass
class EchoTransfer:
    """One TCP connection through the agent to an echo server behind the peer, driven 1 MiB at a time."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    sent: hashlib._Hash = field(default_factory=hashlib.sha256)
    echoed: hashlib._Hash = field(default_factory=hashlib.sha256)
    bytes: int = 0
    slowest: float = 0.0

    async def round_trip(self, *, timeout: float = 60) -> None:
        chunk = os.urandom(CHUNK)
        started = time.monotonic()
        self.writer.write(chunk)
        await self.writer.drain()
        back = await asyncio.wait_for(self.reader.readexactly(CHUNK), timeout)
        self.slowest = max(self.slowest, time.monotonic() - started)
        self.sent.update(chunk)
        self.echoed.update(back)
        self.bytes += CHUNK
        assert back == chunk, f"echo differs after {self.bytes} bytes"

    async def until(self, condition: object, *, timeout: float, what: str) -> float:
        """Keep the transfer going until ``condition()`` holds; return the seconds it took."""
        started = time.monotonic()
        while not condition():  # type: ignore[operator]
            assert time.monotonic() - started < timeout, f"{what} not within {timeout}s"
            await self.round_trip()
        return time.monotonic() - started


async def echo_once(port: int) -> None:
    """A new connection through the agent: one short message echoed back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        message = os.urandom(64)
        writer.write(message)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(message)), 20) == message
    finally:
        writer.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def direct_transfer(headscale: Headscale, tailscale_nodes: TailscaleFactory,
                          name: str) -> AsyncIterator[tuple[Agent, EchoTransfer]]:
    """An agent with a direct path to a tailscaled peer, and an echo transfer through it."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes(f"ts-{name}", headscale, authkey=key)
    async with local_server(echo) as port, \
            running_agent(headscale, f"agent-{name}", key, [target("echo", peer.ipv4(), port)],
                          udp_port=0) as agent:
        await wait_peer_sees(peer, f"agent-{name}")
        listen = agent.listen_port("echo", port)
        await connect_and_close(listen)  # traffic makes the peer worth a path
        await eventually(lambda: direct_peers(agent) == [f"ts-{name}"], timeout=30, what="a direct UDP path")
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        transfer = EchoTransfer(reader, writer)
        try:
            yield agent, transfer
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 30) == b""
            assert transfer.sent.digest() == transfer.echoed.digest()
        finally:
            writer.close()


def direct_gauge(agent: Agent) -> float:
    for line in agent.metrics.render().decode().splitlines():
        if line.startswith("tailnet_agent_direct_peers "):
            return float(line.split()[1])
    raise AssertionError("tailnet_agent_direct_peers is not exported")


async def test_a_cut_udp_path_falls_back_to_derp_and_returns(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    async with direct_transfer(headscale, tailscale_nodes, "cut") as (agent, transfer):
        for _ in range(4):
            await transfer.round_trip()
        assert direct_gauge(agent) == 1.0
        udp_before = agent.node.counters.get("udp_bytes_out", 0)
        assert udp_before > 4 * CHUNK, "the first transfer went over the direct path"
        port = agent.node.udp_port
        assert port
        with udp_cut(port) as table:
            fallback = await transfer.until(lambda: not direct_peers(agent), timeout=60,
                                            what="the direct path given up")
            derp_before = agent.node.counters.get("derp_bytes_out", 0)
            for _ in range(8):
                await transfer.round_trip()
            assert agent.node.counters.get("derp_bytes_out", 0) - derp_before > 8 * CHUNK, "went over DERP"
            assert direct_gauge(agent) == 0.0
            assert dropped(table) > 0
        udp_cut_done = agent.node.counters.get("udp_bytes_out", 0)
        back = await transfer.until(lambda: direct_peers(agent) == ["ts-cut"], timeout=90,
                                    what="the direct path back after the rule is removed")
        for _ in range(4):
            await transfer.round_trip()
        assert agent.node.counters.get("udp_bytes_out", 0) - udp_cut_done > 4 * CHUNK
        assert direct_gauge(agent) == 1.0
    print(f"\ncut UDP: DERP after {fallback:.1f}s, direct again {back:.1f}s after the rule went; "
          f"{transfer.bytes >> 20} MiB echoed intact, slowest 1 MiB round trip {transfer.slowest:.1f}s")


@pytest.mark.timeout(OUTAGE_SECONDS + 240)
async def test_traffic_outlives_an_unreachable_headscale(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    async with direct_transfer(headscale, tailscale_nodes, "outage") as (agent, transfer):
        await transfer.round_trip()
        sessions = agent.node.control.map_sessions
        listen = next(iter(agent.forwarder.targets)).ports[0].listen
        await asyncio.to_thread(headscale.stop)
        stopped = time.monotonic()
        try:
            await eventually(lambda: not agent.node.control.connected, timeout=30, what="control lost")
            dials = 0
            while time.monotonic() - stopped < OUTAGE_SECONDS:
                await transfer.round_trip()
                await echo_once(listen)  # new connections too
                dials += 1
            assert direct_peers(agent) == ["ts-outage"], "the direct path held without control and DERP"
            assert agent.node.ready and agent.node.home_region not in agent.node.derp_connections
        finally:
            await asyncio.to_thread(headscale.restart)
        outage = time.monotonic() - stopped
        await eventually(lambda: agent.node.control.map_sessions > sessions and agent.node.ready,
                         timeout=60, what="the agent back on control")
        caught_up = time.monotonic() - stopped - outage
        # Catching up: a peer that joins after the outage shows up in the agent's netmap.
        key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
        tailscale_nodes("ts-after-outage", headscale, authkey=key)
        await eventually(lambda: any(p.hostname == "ts-after-outage" for p in (agent.node.netmap.peers.values()
                                                                                 if agent.node.netmap else ())),
                         timeout=60, what="a peer that joined after the outage")
        await transfer.round_trip()
    print(f"\nHeadscale down {outage:.0f}s: {transfer.bytes >> 20} MiB echoed and {dials} new connections "
          f"over the existing session; back on control {caught_up:.1f}s after Headscale returned")
