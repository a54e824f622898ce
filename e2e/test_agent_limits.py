"""The agent's limits against a real Headscale v0.29.2 and tailscaled v1.98 peers: connections per
peer (egress: the client's address; ingress: the tailnet peer's, across tcp and http exposes),
header sizes over HTTP/1.1 and HTTP/2 through the tailnet, and what one connection may hold in the
agent when the side it writes to stops reading (egress through the tailnet; an HTTP/2 client that
floods PINGs on a listener on 127.0.0.1).

The agents are assembled as in ``test_agent_egress`` and ``test_agent_ingress``, with the limits
under test and a :class:`ConnectionGate` as ``tailnet_agent.__main__`` builds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from aiohttp import web

from e2e.backends import served
from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import TAG, local_server, running_agent, target, wait_peer_sees
from e2e.test_agent_targets import running, write_like_kubelet
from hack.https_client import Answer, client_context, request, tunnel
from hack.localenv import Headscale, TailscaleNode, free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.contract.clock import RealClock
from tailnet_agent.contract.exposes import parse_exposes
from tailnet_agent.control import ControlOptions
from tailnet_agent.forward.http import HttpPort, HttpService
from tailnet_agent.forward.http.upstream import CHUNK
from tailnet_agent.forward.ingress import Ingress
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import HEADER_LIST_HARD_FACTOR, ConnectionGate, Limits
from tailnet_agent.node import Node, NodeOptions
from tailnet_agent.streams import DEFAULT_HIGH_WATER, RECV_CHUNK

pytestmark = pytest.mark.integration

HOST = "shop.example.test"
SOCKET_READ = 256 << 10
"""Most an asyncio socket transport reads at once (``max_size`` of its selector transport)."""
SOCKET_HIGH_WATER = 64 << 10
"""asyncio's default write-buffer high-water mark for socket transports."""
SSL_WRITE_HIGH_WATER = 512 << 10
"""asyncio's default write-buffer high-water mark for TLS transports."""


def sample(metrics: AgentMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def closed_unanswered(reader: asyncio.StreamReader) -> bool:
    """The connection ends (a close or a reset) within 15 s, without a byte from the far side."""
    try:
        return await asyncio.wait_for(reader.read(1), 15) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


@dataclass
class Held:
    """A server on the far side that says ``hi`` and keeps each connection until its client closes it."""

    served: int = 0
    open: int = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.served += 1
        self.open += 1
        try:
            with contextlib.suppress(ConnectionError):
                writer.write(b"hi\n")
                await writer.drain()
                await reader.read()
            writer.close()
        finally:
            self.open -= 1


# Connections per peer ---------------------------------------------------------------------------

async def test_egress_closes_a_client_address_over_its_limit_and_serves_other_addresses(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    """With 2 per peer: a third connection from 127.0.0.1 is closed as accepted and never dialled,
    one from 127.0.0.2 is served, and once one of the first two ends 127.0.0.1 is served again."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-per-peer", headscale, authkey=key)
    held = Held()
    async with local_server(held) as port, \
            running_agent(headscale, "agent-per-peer", key, [target("web", peer.ipv4(), port)]) as agent:
        gate = agent.forwarder.gate = ConnectionGate.of(Limits(max_connections_per_peer=2), agent.metrics)
        await wait_peer_sees(peer, "agent-per-peer")
        listen = agent.listen_port("web", port)

        async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", listen, local_addr=(source, 0))

        first, second = await connect("127.0.0.1"), await connect("127.0.0.1")
        for reader, _ in (first, second):
            assert await asyncio.wait_for(reader.readline(), 30) == b"hi\n"
        third = await connect("127.0.0.1")
        assert await closed_unanswered(third[0]), "the third connection of 127.0.0.1 was served"
        assert sample(agent.metrics, "tailnet_agent_peer_connections_refused_total") == 1
        other = await connect("127.0.0.2")
        assert await asyncio.wait_for(other[0].readline(), 30) == b"hi\n"
        assert gate.peers == {"127.0.0.1": 2, "127.0.0.2": 1}
        assert held.served == 3, "the refused connection was dialled"
        first[1].close()
        await eventually(lambda: gate.peers.get("127.0.0.1") == 1, what="the closed connection released")
        again = await connect("127.0.0.1")
        assert await asyncio.wait_for(again[0].readline(), 30) == b"hi\n"
        assert sample(agent.metrics, "tailnet_agent_connections_refused_total") == 0
        for _, writer in (second, third, other, again):
            writer.close()
        await eventually(lambda: held.open == 0, what="the far side's connections closed")


@contextlib.asynccontextmanager
async def ingress_agent(headscale: Headscale, hostname: str, key: str, directory: Path, exposes: list[dict[str, Any]],
                        limits: Limits) -> AsyncIterator[tuple[Node, Ingress, AgentMetrics]]:
    """An ingress agent as ``tailnet_agent.__main__`` builds it, with ``limits`` and its gate."""
    path = write_like_kubelet(directory, json.dumps(exposes))
    control = ControlOptions(url=headscale.url, auth_key=key, hostname=hostname, ca_bundle=headscale.ca_bundle,
                             backoff=Backoff(initial=0.2, maximum=2.0))
    node = Node(NodeOptions(control=control, derp_backoff=derp_backoff(initial=0.1, maximum=1.0), dial_timeout=15.0,
                            udp_port=None, accept_routes=False), clock=RealClock())
    metrics = AgentMetrics(node)
    limits.report(metrics)
    ingress = Ingress(node, parse_exposes(path.read_text()), dial_timeout=15.0, metrics=metrics, limits=limits,
                      gate=ConnectionGate.of(limits, metrics))
    async with running({"node": node.run(), "ingress": ingress.forwarder.run()},
                       lambda: node.ready and ingress.forwarder.listening.is_set(), f"agent-{hostname}"):
        yield node, ingress, metrics


@dataclass
class Backend:
    port: int
    seen: list[str]
    """The paths of the requests that reached it."""


@contextlib.asynccontextmanager
async def backend() -> AsyncIterator[Backend]:
    """An HTTP backend on 127.0.0.1 that answers ``ok``."""
    state = Backend(free_port(), [])

    async def ok(request: web.Request) -> web.Response:
        state.seen.append(request.path)
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    async with served(app, state.port):
        yield state


def http_expose(tmp_path: Path, backend_port: int) -> tuple[dict[str, Any], Path]:
    """An http expose of ``HOST`` on a free port, and its CA file."""
    ca = CertificateAuthority(tmp_path / "pki", "limits")
    pair = ca.issue("shop", common_name=HOST, hosts=(HOST,))
    return ({"name": "web", "port": free_port(), "mode": "http", "backend": {"host": "127.0.0.1", "port": backend_port},
             "hosts": [{"name": HOST, "tls": {"certFile": str(pair.cert), "keyFile": str(pair.key)}}]}, ca.cert_path)


async def ask(laptop: TailscaleNode, ip: str, port: int, ca: Path, **kw: Any) -> Answer:
    return await asyncio.wait_for(request(await tunnel(laptop.http_proxy_port, ip, port), ca=ca, sni=HOST, **kw), 30)


async def test_ingress_holds_a_tailnet_peer_to_its_limit_across_tcp_and_http_exposes(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """With 2 per peer: a laptop holding a tcp and an https connection gets its third of either
    kind closed as accepted, the backends never see it, and once one ends it is served again."""
    held = Held()
    async with local_server(held) as held_port, backend() as app:
        expose, ca = http_expose(tmp_path, app.port)
        tcp_port = free_port()
        exposes = [expose, {"name": "hold", "port": tcp_port, "backend": {"host": "127.0.0.1", "port": held_port}}]
        key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
        laptop = tailscale_nodes("ts-laptop-per-peer", headscale, authkey=key)
        async with ingress_agent(headscale, "ingress-per-peer", key, tmp_path, exposes,
                                 Limits(max_connections_per_peer=2)) as (node, ingress, metrics):
            await wait_peer_sees(laptop, "ingress-per-peer")
            ip, gate = node.addresses()[0], ingress.gate
            assert gate is not None
            tcp = await tunnel(laptop.http_proxy_port, ip, tcp_port)
            assert await asyncio.wait_for(tcp[0].readline(), 30) == b"hi\n"
            https = await tunnel(laptop.http_proxy_port, ip, expose["port"])
            await asyncio.wait_for(https[1].start_tls(client_context(ca, "h2"), server_hostname=HOST), 30)
            assert gate.peers == {laptop.ipv4(): 2}

            for port in (tcp_port, expose["port"]):
                try:
                    reader, writer = await tunnel(laptop.http_proxy_port, ip, port)
                except ConnectionError:
                    continue  # tailscaled's proxy saw the close before it answered CONNECT
                assert await closed_unanswered(reader), f"a third connection to {port} was served"
                writer.close()
            assert sample(metrics, "tailnet_agent_peer_connections_refused_total") == 2
            assert held.served == 1 and app.seen == []

            tcp[1].close()
            await eventually(lambda: gate.peers.get(laptop.ipv4()) == 1, what="the tcp connection released")
            assert (await ask(laptop, ip, expose["port"], ca)).status == 200
            https[1].close()


# Header sizes -----------------------------------------------------------------------------------

async def test_http1_request_line_and_header_fields_over_the_limits_get_431(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """The defaults (8190 bytes a request line or field, 128 fields): each refusal is a 431 the
    backend never sees; a field just under the limit passes."""
    async with backend() as app:
        expose, ca = http_expose(tmp_path, app.port)
        key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
        laptop = tailscale_nodes("ts-laptop-h1-headers", headscale, authkey=key)
        async with ingress_agent(headscale, "ingress-h1-headers", key, tmp_path, [expose], Limits()) as (node, _, m):
            await wait_peer_sees(laptop, "ingress-h1-headers")
            ip, port = node.addresses()[0], expose["port"]
            refused = [await ask(laptop, ip, port, ca, path="/" + "a" * 9000),
                       await ask(laptop, ip, port, ca, headers=(("X-Big", "v" * 9000),)),
                       await ask(laptop, ip, port, ca, headers=tuple((f"X-{i}", "v") for i in range(130)))]
            assert [a.status for a in refused] == [431, 431, 431], refused
            assert b"8190" in refused[0].body
            assert (await ask(laptop, ip, port, ca, headers=(("X-Big", "v" * 8000),))).status == 200
            assert app.seen == ["/"]
            assert sample(m, "tailnet_agent_headers_refused_total", protocol="http1") == 3


async def advertised_settings(laptop: TailscaleNode, ip: str, port: int, ca: Path) -> h2.settings.Settings:
    """The SETTINGS the agent's HTTP/2 server sends first."""
    reader, writer = await tunnel(laptop.http_proxy_port, ip, port)
    try:
        await writer.start_tls(client_context(ca, "h2"), server_hostname=HOST)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        while True:
            data = await asyncio.wait_for(reader.read(1 << 16), 30)
            assert data, "the connection ended before the server's SETTINGS"
            if any(isinstance(e, h2.events.RemoteSettingsChanged) for e in conn.receive_data(data)):
                return conn.remote_settings
    finally:
        writer.close()


async def test_http2_header_list_limit_is_advertised_answered_431_and_ends_the_connection_past_twice_it(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """A header list over SETTINGS_MAX_HEADER_LIST_SIZE gets 431 on its stream (the block is
    decoded, so the connection stays usable); one over twice it is not decoded further and ends
    the connection with GOAWAY. Neither reaches the backend."""
    limit = 4096
    async with backend() as app:
        expose, ca = http_expose(tmp_path, app.port)
        key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
        laptop = tailscale_nodes("ts-laptop-h2-headers", headscale, authkey=key)
        async with ingress_agent(headscale, "ingress-h2-headers", key, tmp_path, [expose],
                                 Limits(http2_max_header_list_size=limit)) as (node, _, m):
            await wait_peer_sees(laptop, "ingress-h2-headers")
            ip, port = node.addresses()[0], expose["port"]
            assert (await advertised_settings(laptop, ip, port, ca)).max_header_list_size == limit
            under = await ask(laptop, ip, port, ca, alpn="h2", headers=(("x-big", "v" * (limit - 500)),))
            over = await ask(laptop, ip, port, ca, alpn="h2", headers=(("x-big", "v" * (limit + 100)),))
            assert (under.status, over.status) == (200, 431), (under, over)
            assert over.body.endswith(f"over {limit}\n".encode()), over.body
            with pytest.raises((ConnectionError, ssl.SSLError)):
                await ask(laptop, ip, port, ca, alpn="h2",
                          headers=(("x-big", "v" * (limit * HEADER_LIST_HARD_FACTOR + 100)),))
            assert app.seen == ["/"]
            assert sample(m, "tailnet_agent_headers_refused_total", protocol="http2") == 2
            assert sample(m, "tailnet_agent_http2_goaway_total", reason="headers_too_large") == 1


# Memory per connection --------------------------------------------------------------------------

class RecordingDialer:
    """The node as the forwarder's dialer, keeping each dialled connection's transport and protocol."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.dialled: list[tuple[asyncio.Transport, Any]] = []

    async def wait_ready(self) -> None:
        await self.node.wait_ready()

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]:
        transport, protocol = await self.node.create_connection(protocol_factory, host, port, timeout=timeout)
        self.dialled.append((transport, protocol))
        return transport, protocol


class Stalled:
    """Polls until a byte counter stops moving (the same value for ``still`` polls in a row),
    keeping the largest buffer size seen meanwhile."""

    def __init__(self, counter: Callable[[], float], buffered: Callable[[], int], still: int = 20) -> None:
        self.counter, self.buffered, self.still = counter, buffered, still
        self.last, self.same, self.most = -1.0, 0, 0

    def __call__(self) -> bool:
        self.most = max(self.most, self.buffered())
        value = self.counter()
        self.same = self.same + 1 if value == self.last else 0
        self.last = value
        return value > 0 and self.same >= self.still


def small_buffers(sock: socket.socket) -> None:
    """Small kernel buffers, so the stall comes after megabytes, not tens of them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)


@pytest.mark.parametrize("direction", ["to_peer", "to_client"])
async def test_a_side_that_stops_reading_holds_the_agent_to_its_buffer_bound(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, direction: str) -> None:
    """32 MiB towards a side that never reads (the tailnet peer's server, or the egress client):
    the agent stops reading the other side, and the bytes it queues in Python for that connection
    stay within one high-water mark and one read (the data plane's 512 KiB socket buffer is fixed
    on top). Without the backpressure the queue would take all that the sender can write."""
    size = 32 << 20
    payload = b"x" * size
    release = asyncio.Event()

    async def peer_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            if direction == "to_client":
                writer.write(payload)
                await writer.drain()
            await release.wait()  # never reads
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes(f"ts-stall-{direction.replace('_', '-')}", headscale, authkey=key)
    listening = socket.create_server(("127.0.0.1", 0))
    small_buffers(listening)
    server = await asyncio.start_server(peer_side, sock=listening)
    port = listening.getsockname()[1]
    try:
        async with running_agent(headscale, f"agent-stall-{direction.replace('_', '-')}", key,
                                 [target("web", peer.ipv4(), port)]) as agent:
            dialer = agent.forwarder.node = RecordingDialer(agent.node)
            await wait_peer_sees(peer, agent.node.options.control.hostname)
            client = socket.create_connection(("127.0.0.1", agent.listen_port("web", port)))
            small_buffers(client)
            _, writer = await asyncio.open_connection(sock=client)
            await eventually(lambda: dialer.dialled, what="the connection dialled")
            tailnet, end = dialer.dialled[0]
            if direction == "to_peer":
                writer.write(payload)  # queued in the test's own transport; the test never awaits it
                queue, moved, bound = tailnet.get_write_buffer_size, "sent", DEFAULT_HIGH_WATER + SOCKET_READ
            else:
                local = end.other.transport
                queue, moved, bound = local.get_write_buffer_size, "received", SOCKET_HIGH_WATER + RECV_CHUNK
            stalled = Stalled(lambda: sample(agent.metrics, "tailnet_agent_bytes_total", target="web",
                                             direction=moved), queue, still=30)
            await eventually(stalled, timeout=120, what=f"the {moved} bytes to stop growing")
            assert stalled.most <= bound, f"the agent queued {stalled.most} bytes for one connection (bound {bound})"
            assert stalled.last < size / 2, f"the agent took {stalled.last:.0f} of {size} bytes from the sender"
            if direction == "to_peer":
                assert writer.transport.get_write_buffer_size() > size / 2, "the client could send it all"
            release.set()
            writer.close()
    finally:
        release.set()
        server.close()


@contextlib.asynccontextmanager
async def https_listener(tmp_path: Path, limits: Limits) -> AsyncIterator[tuple[int, Path, HttpService, list[Any]]]:
    """The agent's http listener and service on 127.0.0.1 (``test_agent_http2``'s, keeping each
    accepted connection's protocol, whose transport is the socket under the TLS)."""
    async with backend() as app:
        expose_doc, ca = http_expose(tmp_path, app.port)
        expose = parse_exposes(json.dumps([expose_doc]))[0]
        accepted: list[Any] = []
        metrics = AgentMetrics()
        port = HttpPort(expose.port, gate=ConnectionGate.of(limits, metrics))

        def recording() -> asyncio.Protocol:
            accepted.append(protocol := port.protocol())
            return protocol

        async def bind(factory: Any, number: int) -> asyncio.Server:
            return await asyncio.get_running_loop().create_server(recording, "127.0.0.1", number)

        async with HttpService(expose, limits=limits, metrics=metrics) as service:
            port.services[expose.name] = service
            lease = await port.lease(bind)
            try:
                yield expose.port, ca, service, accepted
            finally:
                lease.close()
                del port.services[expose.name]
                await port.drain()


async def test_an_http2_client_that_floods_pings_and_reads_nothing_is_not_buffered_for(tmp_path: Path) -> None:
    """Every PING is answered; a client that sends 16 MiB of them and reads nothing makes the agent
    stop reading it once its answers fill the TLS and socket buffers, instead of queueing an answer
    for each (CVE-2019-9512); the stalled connection then ends after the idle timeout."""
    ping = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    ping.ping(b"12345678")
    frame = ping.data_to_send()
    async with https_listener(tmp_path, Limits(idle_timeout=5.0)) as (port, ca, service, accepted):
        sock = socket.create_connection(("127.0.0.1", port))
        small_buffers(sock)
        _, writer = await asyncio.open_connection(sock=sock, ssl=client_context(ca, "h2"), server_hostname=HOST)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        writer.write(conn.data_to_send() + frame * ((16 << 20) // len(frame)))  # never drained
        await eventually(lambda: service.http2.connections, what="the HTTP/2 connection served")
        h2c = next(iter(service.http2.connections))
        raw = accepted[0].transport  # the socket under the agent's TLS

        def buffered() -> int:
            return int(h2c.writer.transport.get_write_buffer_size() + raw.get_write_buffer_size())

        stalled = Stalled(buffered, buffered)
        await eventually(stalled, timeout=60, what="the agent's answers to stop growing")
        bound = SSL_WRITE_HIGH_WATER + SOCKET_HIGH_WATER + 2 * CHUNK
        assert stalled.most <= bound, f"the agent queued {stalled.most} bytes of answers (bound {bound})"
        await eventually(lambda: not service.http2.connections, timeout=30, what="the stalled connection ended")
        assert service.http2.metrics is not None
        assert sample(service.http2.metrics, "tailnet_agent_http2_goaway_total", reason="write_stalled") == 1
        writer.transport.abort()
