"""The pump's DERP writes: one relay whose server stopped reading must not stall the others.

The relays are real TCP connections on 127.0.0.1 (one server reads everything, the other never
reads); the data plane is a stand-in whose every poll has a batch for each region and asks to be
polled again at once.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any, cast

from tailnet_agent.pump import DERP_QUEUE_LIMIT, Pump

BATCH = 64 << 10


class SocketRelay:
    """What the pump uses of a DERP connection, over a plain TCP stream."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def buffered(self) -> int:
        return self.writer.transport.get_write_buffer_size()

    async def drain(self) -> None:
        await self.writer.drain()


@dataclass
class Result:
    derp_writes: list[tuple[int, bytes]]
    counters: dict[str, int] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    udp_pending: int = 0
    next_deadline: float | None = None


class EndlessDataPlane:
    """Every poll: one batch for each region, and the next poll due now."""

    def __init__(self, regions: list[int]) -> None:
        self.regions = regions
        self.polls = 0

    def poll(self, now: float) -> Result:
        self.polls += 1
        return Result([(region, b"\0" * BATCH) for region in self.regions], next_deadline=now)


class Direct:
    def note_derp_traffic(self) -> None:
        pass

    def flush(self) -> None:
        pass


@dataclass
class Relays:
    connections: dict[int, SocketRelay]


async def test_a_relay_that_stops_reading_does_not_stall_the_others() -> None:
    received = 0
    enough = asyncio.Event()
    stalled_peers: list[asyncio.StreamWriter] = []

    async def reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(1 << 20):
            received += len(data)
            if received >= 32 * BATCH * 16:  # 32 MiB
                enough.set()

    async def not_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cast(asyncio.Transport, writer.transport).pause_reading()
        stalled_peers.append(writer)
        await asyncio.get_running_loop().create_future()

    healthy = await asyncio.start_server(reading, "127.0.0.1", 0)
    stalled = await asyncio.start_server(not_reading, "127.0.0.1", 0)
    _, to_healthy = await asyncio.open_connection("127.0.0.1", healthy.sockets[0].getsockname()[1])
    _, to_stalled = await asyncio.open_connection("127.0.0.1", stalled.sockets[0].getsockname()[1])
    to_stalled.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    relays = {1: SocketRelay(to_stalled), 2: SocketRelay(to_healthy)}
    pump = Pump(cast(Any, EndlessDataPlane([1, 2])), cast(Any, Relays(relays)), cast(Any, Direct()), lambda: None)
    task = asyncio.create_task(pump.run())
    pump.wake()
    try:
        async with asyncio.timeout(30):
            await enough.wait()
    except TimeoutError:
        raise AssertionError(f"the healthy relay got {received} bytes, then nothing: the pump waits on the "
                             f"stalled one ({relays[1].buffered()} bytes queued there)") from None
    finally:
        task.cancel()
        for server in (healthy, stalled):
            server.close()
        for writer in (to_healthy, to_stalled, *stalled_peers):
            writer.transport.abort()
    assert relays[1].buffered() <= DERP_QUEUE_LIMIT + BATCH
    assert pump.derp_writes_dropped > 0
