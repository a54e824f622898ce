"""asyncio streams over two native data planes wired back to back (no network, real event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from tailnet_agent import _native as nat
from tailnet_agent.streams import DialRefusedError, DialTimeoutError, NoRouteError, StreamTable

from .native.harness import B_V4, REGION, Pair, relay


class Wired:
    """Two StreamTables (A dials, B listens) and a pump that polls both and relays their DERP writes."""

    def __init__(self, tg: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        self.pair = Pair(loop.time)
        self.wakeup = asyncio.Event()

        def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
            tg.create_task(coro, name=name)

        self.a = StreamTable(self.pair.a.dp, wake=self.wakeup.set, spawn=spawn, loop=loop)
        self.b = StreamTable(self.pair.b.dp, wake=self.wakeup.set, spawn=spawn, loop=loop)

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deadline: float | None = None
            for table, peer in ((self.a, self.b), (self.b, self.a)):
                result = table.dataplane.poll(loop.time())
                for region, buf in result.derp_writes:
                    assert region == REGION
                    peer.dataplane.derp_feed(region, relay(buf, table.dataplane.public_key))
                for event in result.events:
                    table.dispatch(event)
                if result.next_deadline is not None:
                    deadline = min(deadline or result.next_deadline, result.next_deadline)
                if result.derp_writes:
                    self.wakeup.set()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wakeup.wait()
            self.wakeup.clear()


@pytest.fixture
async def wired() -> AsyncIterator[Wired]:
    async with asyncio.TaskGroup() as tg:
        w = Wired(tg)
        pump = tg.create_task(w.pump())
        yield w
        pump.cancel()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while chunk := await reader.read(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_bulk_both_ways_with_backpressure_and_half_close(wired: Wired) -> None:
    size = 8 << 20
    up, down = os.urandom(size), os.urandom(size)
    got_up: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)  # far above the high-water mark: the transport pauses the protocol
        assert writer.transport.get_write_buffer_size() > 0
        await writer.drain()
        writer.write_eof()

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(send(writer, down))
            got_up.set_result(await read_all(reader))
        writer.close()

    wired.b.start_server(server, 80)
    reader, writer = await wired.a.open_connection(B_V4, 80)
    assert writer.get_extra_info("peername") == (B_V4, 80)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(send(writer, up))
        received = await asyncio.wait_for(read_all(reader), 60)
    assert hashlib.sha256(received).digest() == hashlib.sha256(down).digest()
    assert hashlib.sha256(await asyncio.wait_for(got_up, 60)).digest() == hashlib.sha256(up).digest()
    writer.close()
    await writer.wait_closed()
    assert not wired.a.transports


async def test_reply_after_eof(wired: Wired) -> None:
    async def answers_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await read_all(reader)
        writer.write(b"got %d" % len(data))
        writer.close()

    wired.b.start_server(answers_after_eof, 81)
    reader, writer = await wired.a.open_connection(B_V4, 81)
    assert writer.can_write_eof()
    writer.write(b"x" * 100_000)
    writer.write_eof()
    with pytest.raises(RuntimeError, match="after write_eof"):
        writer.write(b"more")
    assert await asyncio.wait_for(read_all(reader), 30) == b"got 100000"


async def test_dial_errors(wired: Wired) -> None:
    with pytest.raises(NoRouteError, match=r"^no route to 100\.64\.0\.99: no peer or accepted route covers it$"):
        await wired.a.open_connection("100.64.0.99", 80)
    with pytest.raises(DialRefusedError, match="refused"):
        await wired.a.open_connection(B_V4, 9)
    wired.pair.b.dp.set_filter([])  # deny every new inbound flow
    wired.b.start_server(lambda r, w: asyncio.sleep(0), 82)
    with pytest.raises(DialTimeoutError, match=r"^connection to 100.64.0.2:82 timed out \(dropped by the packet"):
        await wired.a.open_connection(B_V4, 82, timeout=0.5)
    assert wired.pair.b.dp.counters()["drop_filtered"] >= 1


async def test_abort_resets_the_peer(wired: Wired) -> None:
    lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def waits(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()
            lost.set_result(None)
        except ConnectionError as exc:
            lost.set_result(exc)

    wired.b.start_server(waits, 83)
    _, writer = await wired.a.open_connection(B_V4, 83)
    writer.transport.abort()
    assert isinstance(await asyncio.wait_for(lost, 30), ConnectionResetError)
    assert isinstance(nat.DataPlane, type)
