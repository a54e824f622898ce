"""Egress targets changed while connections are open (the tailnet replaced by local TCP servers):
an open connection to A survives adding B, changing C and removing D; /status serves the document."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import aiohttp

from hack.localenv import free_port
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.forward import EgressForwarder
from tailnet_agent.health import AgentMetrics, HealthServer

from .test_health import FakeNode


class LocalDialer:
    """Dials 127.0.0.1:<port> whatever the address: each 'target' is an echo server with a banner."""

    async def wait_ready(self) -> None:
        return None

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]:
        return await asyncio.get_running_loop().create_connection(protocol_factory, "127.0.0.1", port)


async def echo_server(banner: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(banner)
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


def target(name: str, port: int, listen: int) -> Target:
    return Target(name=name, address=f"{name}.example.internal", ports=(PortMapping(port=port, listen=listen),))


async def talk(listen: int, banner: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    assert await asyncio.wait_for(reader.readexactly(len(banner)), 10) == banner
    return reader, writer


async def refused(listen: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listen)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_open_connection_survives_add_change_remove() -> None:
    servers = {name: await echo_server(f"{name}\n".encode()) for name in ("a", "b", "c", "c2", "d")}
    port = {name: p for name, (_, p) in servers.items()}
    listen = {name: free_port() for name in ("a", "b", "c", "d")}
    a, c, d = (target(n, port[n], listen[n]) for n in "acd")
    forwarder = EgressForwarder(LocalDialer(), (a, c, d), bind_address="127.0.0.1", metrics=AgentMetrics())
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(forwarder.run())
        await asyncio.wait_for(forwarder.listening.wait(), 10)
        ra, wa = await talk(listen["a"], b"a\n")
        rd, wd = await talk(listen["d"], b"d\n")
        _, wc = await talk(listen["c"], b"c\n")

        b = target("b", port["b"], listen["b"])
        c2 = target("c", port["c2"], listen["c"])  # same listener port, a new address behind it
        diff = await forwarder.apply((a, b, c2))
        assert ([x.name for x in diff.added], [x.name for x in diff.changed], [x.name for x in diff.removed]) == (
            ["b"], ["c"], ["d"])

        wa.write(b"still here\n")
        assert await asyncio.wait_for(ra.readline(), 10) == b"still here\n", "A's connection survived"
        await talk(listen["b"], b"b\n")
        await talk(listen["c"], b"c2\n")
        assert await refused(listen["d"])
        assert await asyncio.wait_for(rd.read(), 10) == b"", "D's open connection ended"
        assert [t.name for t in forwarder.targets] == ["a", "b", "c"]

        wa.write(b"after\n")
        assert await asyncio.wait_for(ra.readline(), 10) == b"after\n"
        for w in (wa, wd, wc):
            w.close()
        task.cancel()
    for server, _ in servers.values():
        server.close()


async def test_a_listener_that_cannot_bind_on_reload_is_reported_not_fatal() -> None:
    server, port = await echo_server(b"a\n")
    a = target("a", port, free_port())
    forwarder = EgressForwarder(LocalDialer(), (a,), bind_address="127.0.0.1", metrics=AgentMetrics())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(forwarder.run())
            await asyncio.wait_for(forwarder.listening.wait(), 10)
            await forwarder.apply((a, target("b", port, busy)))
            assert "cannot listen on 127.0.0.1:" in forwarder.listen_errors["b"]
            await talk(a.ports[0].listen, b"a\n")
            task.cancel()
    server.close()


async def test_status_endpoint_serves_the_provider_document() -> None:
    node = FakeNode()
    documents = [{"node": {"id": None, "name": "egress", "addresses": []}, "targets": []}]
    server = HealthServer(node, AgentMetrics(node), host="127.0.0.1", port=0, status=lambda: documents[0])
    bare = HealthServer(node, AgentMetrics(node), host="127.0.0.1", port=0)
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(server.run()), tg.create_task(bare.run())]
        await asyncio.wait_for(server.started.wait(), 10)
        await asyncio.wait_for(bare.started.wait(), 10)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/status") as resp:
                assert resp.status == 200 and resp.content_type == "application/json"
                assert await resp.json() == documents[0]
            async with http.get(f"http://127.0.0.1:{bare.port}/status") as resp:
                assert resp.status == 404
        for task in tasks:
            task.cancel()
