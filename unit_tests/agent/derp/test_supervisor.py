"""DerpSupervisor: reconnects after a drop, re-sends NotePreferred, backs off on failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from hack import derp_codec as codec
from tailnet_agent.contract.backoff import derp_backoff
from tailnet_agent.derp import frames as f
from tailnet_agent.derp.connection import DerpConnection, DerpNode, DerpNodeLike
from tailnet_agent.derp.errors import DerpConnectError
from tailnet_agent.derp.supervisor import DerpSupervisor

from .fakeserver import FakeDerpServer


@contextlib.asynccontextmanager
async def running(sup: DerpSupervisor) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(sup.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_backoff_grows_caps_and_jitters() -> None:
    low = derp_backoff(initial=0.1, maximum=1.0, _random=lambda: 0.0)
    assert [round(low.next(), 3) for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    high = derp_backoff(initial=0.1, maximum=1.0, _random=lambda: 0.999999)
    assert round(high.next(), 3) == 0.15
    low.reset()
    assert round(low.next(), 3) == 0.05


async def test_reconnects_after_the_server_drops_and_resends_note_preferred() -> None:
    received: asyncio.Queue[tuple[int, bytes, bytes]] = asyncio.Queue()
    async with FakeDerpServer() as server:
        node = DerpNode(host_name="derp.test", ipv4="127.0.0.1", ipv6="none", derp_port=server.port)

        async def handler(conn: DerpConnection) -> None:
            while True:
                src, payload = await codec.recv_packet(conn)
                await received.put((sup.generation, src, payload))

        sup = DerpSupervisor([node], os.urandom(32), handler, plaintext=True,
                             backoff=derp_backoff(initial=0.01, maximum=0.05))
        async with running(sup):
            async with asyncio.timeout(5):
                first = await sup.wait_connected()
            peer = os.urandom(32)
            await server.send(codec.encode_recv_packet(peer, b"one"))
            assert await asyncio.wait_for(received.get(), 5) == (1, peer, b"one")

            await server.drop_all()
            second = await asyncio.wait_for(sup.wait_connected(newer_than=1), 5)
            assert second is not first
            await server.send(codec.encode_recv_packet(peer, b"two"))
            assert await asyncio.wait_for(received.get(), 5) == (2, peer, b"two")

        note_preferred = [fr for fr in server.received if fr.type == f.FrameType.NOTE_PREFERRED]
        assert note_preferred == [f.Frame(f.FrameType.NOTE_PREFERRED, b"\x01")] * 2
        assert server.connections == 2


async def test_connect_failures_back_off_and_try_every_node() -> None:
    delays: list[float] = []
    tried: list[str] = []
    gave_up = asyncio.Event()

    async def fake_open(node: DerpNodeLike) -> DerpConnection:
        tried.append(node.host_name)
        raise DerpConnectError("refused")

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 4:
            gave_up.set()
        await asyncio.sleep(0)

    async def handler(conn: DerpConnection) -> None:
        raise AssertionError("never connected")

    nodes = [DerpNode(host_name="a"), DerpNode(host_name="stun", stun_only=True), DerpNode(host_name="b")]
    backoff = derp_backoff(initial=1, maximum=4, _random=lambda: 0.5)
    sup = DerpSupervisor(nodes, os.urandom(32), handler, backoff=backoff, _open=fake_open, _sleep=fake_sleep)
    async with running(sup):
        await asyncio.wait_for(gave_up.wait(), 5)
    assert delays[:4] == [1, 2, 4, 4]
    assert tried[:4] == ["a", "b", "a", "b"]
    assert sup.connection is None and sup.generation == 0
