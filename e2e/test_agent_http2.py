"""The agent's HTTP/2 server under a real TLS client, a real backend and the agent's own listener
code (:class:`HttpPort`, :class:`HttpService`), bound on 127.0.0.1 instead of the tailnet: flow
control across streams of one connection, and the limits against abusive clients (concurrent
streams, rapid reset, idle connections, connections per agent). A plaintext port
(:class:`PlainHttpPort`) serves HTTP/2 with prior knowledge (h2c) under the same limits and drain.

The tailnet under the listener is the same for every connection and is covered by
``test_agent_ingress``; what is tested here is the HTTP/2 state of one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from e2e.polling import eventually
from hack.localenv import free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.exposes import parse_exposes
from tailnet_agent.forward.http import HttpPort, HttpService, PlainHttpPort, SharedPort
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Limits

HOST = "shop.example.test"
WINDOW = 65_535
"""HTTP/2's initial connection window (RFC 9113 6.9.2), which the agent keeps."""


# Backend ----------------------------------------------------------------------------------------

async def echo_length(request: web.Request) -> web.Response:
    """Reads the whole body and answers its length."""
    return web.Response(text=str(len(await request.read())))


async def early(request: web.Request) -> web.Response:
    """Answers at once without reading the body (an early response: 413, an auth failure)."""
    return web.Response(status=413, text="too large\n")


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("s", "30")))
    return web.Response(text="late\n")


@dataclass
class Backend:
    port: int
    started: int = 0
    """Requests that reached the backend."""


@contextlib.asynccontextmanager
async def backend() -> AsyncIterator[Backend]:
    state = Backend(free_port())

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        state.started += 1
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[count], client_max_size=1 << 30)
    app.router.add_post("/echo", echo_length)
    app.router.add_post("/early", early)
    app.router.add_get("/slow", slow)
    async with served(app, state.port):
        yield state


# The agent's listener on 127.0.0.1 --------------------------------------------------------------

@dataclass
class Listener:
    port: int
    ca: Path
    service: HttpService
    metrics: AgentMetrics
    lease: Any
    """The expose's hold on the port's listener (closing the last one closes the listener)."""
    shared: SharedPort[HttpService]
    """The port's listener: over TLS, or plaintext (h2c with prior knowledge)."""

    @property
    def plaintext(self) -> bool:
        return isinstance(self.shared, PlainHttpPort)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def listener(tmp_path: Path, backend_port: int, limits: Limits | None = None, *,
                   plaintext: bool = False) -> AsyncIterator[Listener]:
    ca = CertificateAuthority(tmp_path / "pki", "h2")
    pair = ca.issue("shop", common_name=HOST, hosts=(HOST,))
    host = {"name": HOST} if plaintext else {"name": HOST, "tls": {"certFile": str(pair.cert),
                                                                  "keyFile": str(pair.key)}}
    expose = parse_exposes(json.dumps([{
        "name": "web", "port": free_port(), "mode": "http", "backend": {"host": "127.0.0.1", "port": backend_port},
        "hosts": [host], "plaintext": plaintext}]))[0]
    loop = asyncio.get_running_loop()

    async def bind(factory: Any, port: int) -> asyncio.Server:
        return await loop.create_server(factory, "127.0.0.1", port)

    limits = limits or Limits()
    metrics = AgentMetrics()
    gate = ConnectionGate(limits.max_connections, metrics)
    port: SharedPort[HttpService] = PlainHttpPort(expose.port, gate=gate, limits=limits, metrics=metrics) \
        if plaintext else HttpPort(expose.port, gate=gate)
    async with HttpService(expose, limits=limits, metrics=metrics) as service:
        port.services[expose.name] = service
        lease = await port.lease(bind)
        try:
            yield Listener(expose.port, ca.cert_path, service, metrics, lease, port)
        finally:
            lease.close()
            del port.services[expose.name]
            await port.drain()


# A client that keeps several streams open on one connection ------------------------------------

@dataclass
class StreamState:
    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reset: h2.errors.ErrorCodes | None = None


class Client:
    """HTTP/2 to the listener (over TLS, or with prior knowledge on a plaintext one), any number of
    streams, flow control obeyed both ways."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scheme: str = "https") -> None:
        self.reader, self.writer = reader, writer
        self.scheme = scheme
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.streams: dict[int, StreamState] = {}
        self.window = asyncio.Event()
        self.closed = asyncio.Event()
        self.goaway: h2.errors.ErrorCodes | None = None
        self.settings = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, target: Listener) -> AsyncIterator[Client]:
        if target.plaintext:
            reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        else:
            context = ssl.create_default_context(cafile=str(target.ca))
            context.set_alpn_protocols(["h2"])
            reader, writer = await asyncio.open_connection("127.0.0.1", target.port, ssl=context,
                                                           server_hostname=HOST)
            assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        client = cls(reader, writer, "http" if target.plaintext else "https")
        client.conn.initiate_connection()
        client.flush()
        client._task = asyncio.create_task(client._read())
        try:
            yield client
        finally:
            client._task.cancel()
            writer.close()

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.writer.write(data)

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(1 << 16):
                for event in self.conn.receive_data(data):
                    state = self.streams.get(getattr(event, "stream_id", 0) or 0)
                    if isinstance(event, h2.events.ResponseReceived) and state is not None:
                        state.status = int(dict(event.headers or ())[b":status"])
                    elif isinstance(event, h2.events.DataReceived) and state is not None:
                        state.body += event.data or b""
                        self.conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id or 0)
                    elif isinstance(event, h2.events.StreamEnded) and state is not None:
                        state.ended.set()
                    elif isinstance(event, h2.events.StreamReset) and state is not None:
                        state.reset = h2.errors.ErrorCodes(event.error_code or 0)
                        state.ended.set()
                    elif isinstance(event, h2.events.RemoteSettingsChanged):
                        self.settings.set()
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self.goaway = h2.errors.ErrorCodes(event.error_code or 0)
                    self.window.set()
                    self.window = asyncio.Event()
                self.flush()
        except (ConnectionError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass
        finally:
            self.closed.set()
            for state in self.streams.values():
                state.ended.set()
            self.window.set()

    def open(self, method: str, path: str, *, authority: str = HOST, end: bool = True) -> int:
        stream_id: int = self.conn.get_next_available_stream_id()
        self.streams[stream_id] = StreamState()
        self.conn.send_headers(stream_id, [(":method", method), (":path", path), (":scheme", self.scheme),
                                           (":authority", authority)], end_stream=end)
        self.flush()
        return stream_id

    async def send(self, stream_id: int, data: bytes, *, end: bool) -> None:
        """Send ``data`` within the windows the server grants (waits for WINDOW_UPDATE)."""
        view = memoryview(data)
        while view:
            if self.closed.is_set() or self.streams[stream_id].ended.is_set():
                raise ConnectionError("stream ended while sending")
            room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
            if room <= 0:
                await self.window.wait()
                continue
            self.conn.send_data(stream_id, view[:room].tobytes())
            view = view[room:]
            self.flush()
        if end:
            self.conn.end_stream(stream_id)
            self.flush()

    def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self.flush()


# Flow control -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("plaintext", "authority", "path", "status"), [
    (False, "elsewhere.example.test", "/echo", 421), (False, HOST, "/early", 413),
    (True, "elsewhere.example.test", "/echo", 404), (True, HOST, "/early", 413)])
async def test_a_response_that_ends_before_the_request_body_gives_the_window_back(
        tmp_path: Path, plaintext: bool, authority: str, path: str, status: int) -> None:
    """A client-streaming call answered before its body was read (421 or, on a plaintext port, 404
    from the agent, an early answer from the backend) whose client sent a whole connection window:
    the bytes the agent dropped still count as received, so a second stream on the same connection
    can send its body."""
    async with backend() as app, listener(tmp_path, app.port, plaintext=plaintext) as target, \
            Client.connect(target) as client:
        first = client.open("POST", path, authority=authority, end=False)
        await asyncio.wait_for(client.send(first, b"x" * WINDOW, end=False), 30)
        await asyncio.wait_for(client.streams[first].ended.wait(), 30)
        assert client.streams[first].status == status
        second = client.open("POST", "/echo", end=False)
        body = b"y" * (4 * WINDOW)
        try:
            await asyncio.wait_for(client.send(second, body, end=True), 15)
        except TimeoutError:
            window = client.conn.outbound_flow_control_window
            pytest.fail(f"the second stream could not send its body: the connection window is {window} bytes")
        await asyncio.wait_for(client.streams[second].ended.wait(), 30)
        assert (client.streams[second].status, bytes(client.streams[second].body)) == (200, str(len(body)).encode())


# Limits -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("plaintext", [False, True], ids=["tls", "h2c"])
async def test_the_concurrent_streams_limit_is_advertised_and_enforced(tmp_path: Path, plaintext: bool) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS is the configured limit; a client that opens one more
    stream than it allows gets a connection error, and the backend never sees that stream."""
    async with backend() as app, listener(tmp_path, app.port, Limits(http2_max_streams=3),
                                          plaintext=plaintext) as target, \
            Client.connect(target) as client:
        await asyncio.wait_for(client.settings.wait(), 30)
        assert client.conn.remote_settings.max_concurrent_streams == 3
        for _ in range(3):
            client.open("GET", "/slow?s=30")
        await eventually(lambda: app.started == 3, what="three requests at the backend")
        # a misbehaving client: its own h2 would refuse to open a fourth stream, so it is told 100
        client.conn.remote_settings._settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].appendleft(100)
        client.open("GET", "/slow?s=30")
        await asyncio.wait_for(client.closed.wait(), 30)
        assert client.goaway == h2.errors.ErrorCodes.PROTOCOL_ERROR
        assert app.started == 3
        assert target.sample("tailnet_agent_http2_goaway_total", reason="protocol_error") == 1


@pytest.mark.parametrize("plaintext", [False, True], ids=["tls", "h2c"])
async def test_rapid_reset_ends_the_connection_with_enhance_your_calm(tmp_path: Path, plaintext: bool) -> None:
    """CVE-2023-44487: a client that opens streams and resets each at once gets GOAWAY
    ENHANCE_YOUR_CALM once over its budget, and the backend is asked a bounded number of times."""
    async with backend() as app, listener(tmp_path, app.port, Limits(http2_max_resets=50),
                                          plaintext=plaintext) as target, \
            Client.connect(target) as client:
        await asyncio.wait_for(client.settings.wait(), 30)
        sent = 0
        while client.goaway is None and not client.closed.is_set() and sent < 5000:
            stream_id = client.open("GET", "/slow?s=30")
            client.reset(stream_id)
            sent += 1
            if sent % 50 == 0:
                with contextlib.suppress(ConnectionError):  # ended by the agent: its GOAWAY is read below
                    await client.writer.drain()
                await asyncio.sleep(0)
        await asyncio.wait_for(client.closed.wait(), 30)
        assert client.goaway == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, (sent, client.goaway)
        assert app.started <= 60, app.started
        assert target.sample("tailnet_agent_http2_goaway_total", reason="rapid_reset") == 1


@pytest.mark.parametrize("plaintext", [False, True], ids=["tls", "h2c"])
async def test_an_idle_connection_is_ended_after_the_idle_timeout(tmp_path: Path, plaintext: bool) -> None:
    """A connection with no request in progress gets GOAWAY NO_ERROR after the idle timeout; one
    with a request in progress is kept past it."""
    async with backend() as app, listener(tmp_path, app.port, Limits(idle_timeout=1.0),
                                          plaintext=plaintext) as target, \
            Client.connect(target) as client:
        busy = client.open("GET", "/slow?s=3")
        await asyncio.wait_for(client.streams[busy].ended.wait(), 30)
        assert (client.streams[busy].status, bytes(client.streams[busy].body)) == (200, b"late\n")
        await asyncio.wait_for(client.closed.wait(), 30)
        assert client.goaway == h2.errors.ErrorCodes.NO_ERROR
        assert target.sample("tailnet_agent_http2_goaway_total", reason="idle") == 1


async def test_connections_over_the_agent_limit_are_closed_as_accepted(tmp_path: Path) -> None:
    """With a limit of 2, a third connection is closed before its handshake; once one of the two
    ends, a new one is served."""
    async with backend() as app, listener(tmp_path, app.port, Limits(max_connections=2)) as target:
        async with Client.connect(target) as one, Client.connect(target) as two:
            for client in (one, two):
                await asyncio.wait_for(client.settings.wait(), 30)
            with pytest.raises((ConnectionError, ssl.SSLError)):
                async with Client.connect(target):
                    pass
            assert target.sample("tailnet_agent_connections_refused_total") == 1
            assert target.sample("tailnet_agent_open_connections") == 2
        await eventually(lambda: target.sample("tailnet_agent_open_connections") == 0, what="no connection open")
        async with Client.connect(target) as three:
            stream_id = three.open("POST", "/echo", end=False)
            await three.send(stream_id, b"z" * 10, end=True)
            await asyncio.wait_for(three.streams[stream_id].ended.wait(), 30)
            assert three.streams[stream_id].status == 200



# Graceful shutdown ------------------------------------------------------------------------------

async def refused_then_finished(client: Client, busy: int) -> None:
    """A draining connection refuses a new stream (REFUSED_STREAM, safe to retry elsewhere), gives
    the stream ``busy`` its whole answer, then ends with GOAWAY NO_ERROR."""
    late = client.open("GET", "/slow?s=0")
    await asyncio.wait_for(client.streams[late].ended.wait(), 30)
    assert client.streams[late].reset == h2.errors.ErrorCodes.REFUSED_STREAM
    await asyncio.wait_for(client.streams[busy].ended.wait(), 30)
    assert (client.streams[busy].status, bytes(client.streams[busy].body)) == (200, b"late\n")
    await asyncio.wait_for(client.closed.wait(), 30)
    assert client.goaway == h2.errors.ErrorCodes.NO_ERROR


async def test_a_draining_service_finishes_the_streams_in_progress_and_refuses_new_ones(tmp_path: Path) -> None:
    """What SIGTERM does to an http expose's HTTP/2 connection: the request in progress gets its
    whole answer, a new stream is refused (REFUSED_STREAM, safe to retry elsewhere), then GOAWAY
    NO_ERROR ends the connection."""
    async with backend() as app, listener(tmp_path, app.port) as target, Client.connect(target) as client:
        busy = client.open("GET", "/slow?s=2")
        await eventually(lambda: app.started == 1, what="the request at the backend")
        drain = asyncio.create_task(target.service.drain())
        await eventually(lambda: target.service.http2.draining, what="the service draining")
        await refused_then_finished(client, busy)
        await asyncio.wait_for(drain, 30)
        assert app.started == 1
        assert target.sample("tailnet_agent_http2_goaway_total", reason="shutdown") == 1


async def test_the_shutdown_order_of_an_http_expose_keeps_requests_in_progress(tmp_path: Path) -> None:
    """The ingress's order on SIGTERM: the expose's lease on the port goes (the listener closes),
    then the service drains. Requests in progress on HTTP/2 and HTTP/1.1 connections get their
    whole answers; a new connection is refused."""
    async with backend() as app, listener(tmp_path, app.port) as target, Client.connect(target) as client:
        busy = client.open("GET", "/slow?s=2")
        context = ssl.create_default_context(cafile=str(target.ca))
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port, ssl=context, server_hostname=HOST)
        writer.write(f"GET /slow?s=2 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        await eventually(lambda: app.started == 2, what="both requests at the backend")
        target.lease.close()
        drain = asyncio.create_task(target.service.drain())
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", target.port)
        await asyncio.wait_for(client.streams[busy].ended.wait(), 30)
        assert (client.streams[busy].status, bytes(client.streams[busy].body)) == (200, b"late\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert await asyncio.wait_for(reader.read(), 30) == b"late\n"  # then the agent closes it
        writer.close()
        await asyncio.wait_for(drain, 30)


async def test_a_draining_plaintext_port_finishes_h2c_streams_and_http1_requests_in_progress(tmp_path: Path) -> None:
    """What SIGTERM does to a plaintext port (the last lease goes, then each expose of the port
    asks it to finish): an h2c stream in progress gets its whole answer, a new stream is refused
    (REFUSED_STREAM), then GOAWAY NO_ERROR ends the connection; an HTTP/1.1 request in progress on
    the same port gets its answer."""
    async with backend() as app, listener(tmp_path, app.port, plaintext=True) as target, \
            Client.connect(target) as client:
        port = target.shared
        assert isinstance(port, PlainHttpPort)
        busy = client.open("GET", "/slow?s=2")
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        writer.write(f"GET /slow?s=2 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        await eventually(lambda: app.started == 2, what="both requests at the backend")
        target.lease.close()
        drains = [asyncio.create_task(port.finish()) for _ in range(2)]  # each expose of a port asks
        await eventually(lambda: port.front2.draining, what="the port draining")
        await refused_then_finished(client, busy)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert await asyncio.wait_for(reader.read(), 30) == b"late\n"  # then the agent closes it
        writer.close()
        await asyncio.wait_for(asyncio.gather(*drains), 30)
        assert app.started == 2
        assert target.sample("tailnet_agent_http2_goaway_total", reason="shutdown") == 1
