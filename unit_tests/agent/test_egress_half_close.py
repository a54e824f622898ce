"""Egress half-close pin (local TCP servers stand in for the tailnet): when the client half-closes,
a second, idle connection to the target is open before the EOF reaches the target, and it is
closed once the first connection has ended."""

from __future__ import annotations

import asyncio

from hack.localenv import free_port
from tailnet_agent.forward import EgressForwarder
from tailnet_agent.health import AgentMetrics

from .test_egress_reload import LocalDialer, target


class Server:
    """Echoes until EOF, then half-closes; records how many connections were open at each EOF."""

    def __init__(self) -> None:
        self.open = 0
        self.open_at_eof: list[int] = []
        self.pin_closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        received = 0
        while data := await reader.read(1 << 16):
            received += len(data)
            writer.write(data)
            await writer.drain()
        self.open_at_eof.append(self.open)
        if received == 0:  # the pin: nothing sent, closed by the agent
            self.pin_closed.set()
        writer.write_eof()
        self.open -= 1
        writer.close()


async def echo_with_half_close(listen: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return reply


async def test_pin_is_open_before_the_eof_reaches_the_target_and_closed_after() -> None:
    server = Server()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port, listen = int(srv.sockets[0].getsockname()[1]), free_port()
    forwarder = EgressForwarder(LocalDialer(), (target("t", port, listen),), bind_address="127.0.0.1",
                                metrics=AgentMetrics())
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(forwarder.run())
        await asyncio.wait_for(forwarder.listening.wait(), 10)
        payload = bytes(range(256)) * 1024
        assert await echo_with_half_close(listen, payload) == payload
        await asyncio.wait_for(server.pin_closed.wait(), 10)
        assert server.open_at_eof == [2, 1], "the pin was open when the client's EOF arrived, then closed"
        task.cancel()
    srv.close()


async def test_no_pin_when_disabled() -> None:
    server = Server()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port, listen = int(srv.sockets[0].getsockname()[1]), free_port()
    forwarder = EgressForwarder(LocalDialer(), (target("t", port, listen),), bind_address="127.0.0.1",
                                metrics=AgentMetrics(), pin_half_closed=False)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(forwarder.run())
        await asyncio.wait_for(forwarder.listening.wait(), 10)
        assert await echo_with_half_close(listen, b"x" * 1000) == b"x" * 1000
        assert server.open_at_eof == [1]
        task.cancel()
    srv.close()
