"""The agent's DERP client against Headscale v0.29.2's real embedded DERP server (region 999).

Headscale 0.29.2 defaults ``derp.server.verify_clients`` to true and the local environment does
not change it, so the server only admits node keys of registered nodes. The tests register their
node keys with the agent's own control client (``tailnet_agent.control``) and take the DERP node
from the DERPMap that control sends; one test shows that an unregistered key is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from e2e.polling import eventually
from hack import derp_codec as codec
from hack.localenv import Headscale
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.control import ControlClient, ControlOptions, NodeKeys
from tailnet_agent.derp import (
    ConnectionLost,
    DerpConnection,
    DerpNode,
    DerpNodeLike,
    DerpSupervisor,
    DerpTLSError,
    HandshakeRejected,
    tls_context,
)
from tailnet_agent.derp import frames as f
from tailnet_agent.derp.connection import TLS_READ_SIZE
from tailnet_agent.memory import MMAP_THRESHOLD

pytestmark = pytest.mark.integration

REGION = 999
TAG = "tag:derp-test"


@contextlib.asynccontextmanager
async def registered_nodes(headscale: Headscale, *names: str) -> AsyncIterator[list[ControlClient]]:
    """Run one control client per name until each is registered and has a netmap with the DERPMap."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True)
    clients = [ControlClient(ControlOptions(url=headscale.url, auth_key=key, hostname=name, ephemeral=False,
                                            ca_bundle=headscale.ca_bundle,
                                            backoff=Backoff(initial=0.2, maximum=2.0)),
                             NodeKeys.generate()) for name in names]
    tasks = [asyncio.create_task(c.run(), name=f"control-{c.options.hostname}") for c in clients]
    try:
        for client, task in zip(clients, tasks, strict=True):
            await eventually(_ready(client, task), timeout=30,
                             what=f"{client.options.hostname} registered with a netmap")
            if task.done():
                task.result()  # a crash of the control client fails the test
        yield clients
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _ready(client: ControlClient, task: asyncio.Task[None]) -> Callable[[], bool]:
    return lambda: task.done() or client.netmap is not None


def home_node(client: ControlClient) -> DerpNodeLike:
    """The embedded DERP node as announced in control's DERPMap."""
    assert client.netmap is not None
    region = client.netmap.derp_map.regions[REGION]
    assert region.nodes, region
    return region.nodes[0]


def node_key(client: ControlClient) -> bytes:
    return client.keys.node.raw


async def open_conn(headscale: Headscale, node: DerpNodeLike, key: bytes) -> DerpConnection:
    return await DerpConnection.open(node, key, tls=tls_context(headscale.ca_bundle), read_timeout=30)


def embedded_node(headscale: Headscale) -> DerpNode:
    """The embedded DERP node built from the server URL (for tests that need no registration)."""
    host, port = headscale.url.removeprefix("https://").rsplit(":", 1)
    return DerpNode(host_name=host, ipv4=host, ipv6="none", derp_port=int(port), region_id=REGION)


async def recv_packet(conn: DerpConnection, *, timeout: float = 10.0) -> tuple[bytes, bytes]:
    async with asyncio.timeout(timeout):
        return await codec.recv_packet(conn)


async def test_handshake_receives_server_info_and_answers_ping(headscale: Headscale) -> None:
    async with registered_nodes(headscale, "derp-a") as (client,):
        node = home_node(client)
        assert (node.host_name, node.ipv4, node.derp_port) == ("127.0.0.1", "127.0.0.1", headscale.port)
        async with await open_conn(headscale, node, node_key(client)) as conn:
            assert conn.public_key == client.keys.node.public.raw
            assert conn.server_info.version == f.PROTOCOL_VERSION
            # The ServerKey frame and Headscale's 101 header name the same server key.
            assert conn.response_headers["derp-public-key"] == "nodekey:" + conn.server_key.hex()
            assert conn.response_headers["derp-version"] == "2"
            await conn.note_preferred(True)
            await conn.send_ping(b"derp-e2e")
            async with asyncio.timeout(10):
                while not isinstance(message := await codec.recv_message(conn), codec.Pong):
                    pass
            assert message == codec.Pong(b"derp-e2e")


async def test_unregistered_node_key_is_refused(headscale: Headscale) -> None:
    with pytest.raises(HandshakeRejected, match="not admitted"):
        await open_conn(headscale, embedded_node(headscale), os.urandom(32))


async def test_two_nodes_exchange_packets_both_ways(headscale: Headscale) -> None:
    async with registered_nodes(headscale, "derp-a", "derp-b") as (a, b), \
            await open_conn(headscale, home_node(a), node_key(a)) as conn_a, \
            await open_conn(headscale, home_node(b), node_key(b)) as conn_b:
        await codec.send_packet(conn_a, conn_b.public_key, b"a to b")
        assert await recv_packet(conn_b) == (conn_a.public_key, b"a to b")
        big = os.urandom(f.MAX_PACKET_SIZE)  # the largest packet the server relays
        await codec.send_packet(conn_b, conn_a.public_key, big)
        assert await recv_packet(conn_a) == (conn_b.public_key, big)


async def test_tls_reads_are_capped_below_the_mmap_threshold(headscale: Headscale) -> None:
    """Each TLS read allocates its full size: at most TLS_READ_SIZE, not asyncio's 256 KiB (which,
    above the agent's fixed mmap threshold, cost four system calls per DERP frame); frames of
    every size still arrive whole."""
    async with registered_nodes(headscale, "derp-a", "derp-b") as (a, b), \
            await open_conn(headscale, home_node(a), node_key(a)) as conn_a, \
            await open_conn(headscale, home_node(b), node_key(b)) as conn_b:
        for conn in (conn_a, conn_b):
            protocol = getattr(conn._writer.transport, "_ssl_protocol", None)
            assert protocol is not None and protocol.max_size == TLS_READ_SIZE < MMAP_THRESHOLD
        for size in (1, 1200, f.MAX_PACKET_SIZE) * 10:
            packet = os.urandom(size)
            await codec.send_packet(conn_b, conn_a.public_key, packet)
            assert await recv_packet(conn_a) == (conn_b.public_key, packet)


async def test_supervisor_reconnects_after_a_server_restart(headscale: Headscale) -> None:
    async with registered_nodes(headscale, "derp-a", "derp-b") as (a, b):
        inbox: asyncio.Queue[tuple[int, bytes, bytes]] = asyncio.Queue()

        async def handler(conn: DerpConnection) -> None:
            while True:
                src, payload = await codec.recv_packet(conn)
                await inbox.put((sup.generation, src, payload))

        sup = DerpSupervisor([home_node(a)], node_key(a), handler, tls=tls_context(headscale.ca_bundle),
                             read_timeout=30, backoff=derp_backoff(initial=0.2, maximum=1.0))
        task = asyncio.create_task(sup.run(), name="derp-supervisor")
        try:
            first = await asyncio.wait_for(sup.wait_connected(), 15)
            async with await open_conn(headscale, home_node(b), node_key(b)) as conn_b:
                await codec.send_packet(conn_b, first.public_key, b"before")
                assert await asyncio.wait_for(inbox.get(), 10) == (1, conn_b.public_key, b"before")

                await asyncio.to_thread(headscale.restart)
                with pytest.raises(ConnectionLost):  # the server side really cut the connections
                    await recv_packet(conn_b, timeout=30)

            second = await asyncio.wait_for(sup.wait_connected(newer_than=1), 30)
            assert second is not first and sup.generation >= 2
            async with await open_conn(headscale, home_node(b), node_key(b)) as conn_b:
                assert inbox.empty()
                await codec.send_packet(conn_b, second.public_key, b"after")
                generation, src, payload = await asyncio.wait_for(inbox.get(), 10)
                assert (src, payload) == (conn_b.public_key, b"after") and generation >= 2
                current = await sup.wait_connected()
                await codec.send_packet(current, conn_b.public_key, b"reply")
                assert await recv_packet(conn_b) == (current.public_key, b"reply")
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_untrusted_ca_fails_with_a_clear_tls_error(headscale: Headscale, tmp_path: Path) -> None:
    other = CertificateAuthority(tmp_path / "pki", "other")
    with pytest.raises(DerpTLSError, match="not trusted: unable to get local issuer certificate") as info:
        await DerpConnection.open(embedded_node(headscale), os.urandom(32), tls=tls_context(other.cert_path))
    assert "127.0.0.1" in str(info.value)
