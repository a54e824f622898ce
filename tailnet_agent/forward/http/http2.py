"""HTTP/2 to clients: the ``h2`` library's state machine under one reading task per connection.

A connection arrives over TLS with ALPN ``h2`` (one expose's, :class:`Http2Server`, its host the
one SNI chose) or in plaintext after the HTTP/2 preface (a plaintext port's, :class:`PlainHttp2`,
each stream's host the one its ``:authority`` names); both run the same loop, limits, drain and
metrics (:class:`Http2Base`).

One task reads and feeds ``h2``; each request is a task of its own that forwards it and writes the
answer within the stream's flow-control window. Trailers cross only where both sides are HTTP/2
(gRPC): an HTTP/2 client's request trailers reach an h2 backend, an h2 backend's response trailers
reach the client. A backend that fails after the response began resets the stream.

Every received DATA byte is acknowledged once, whether the backend read it or not: a response that
ends before its request body (421, 502, an early answer) gives the unread body's window back and
resets the stream with NO_ERROR, and DATA that arrives for a stream whose response is over is
acknowledged as it is dropped, so the connection window never leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import structlog

from tailnet_agent.contract.exposes import VirtualHost
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import HEADER_LIST_HARD_FACTOR, Limits, ResetBudget, header_list_size

from ..h2backend import BackendError
from .handover import Pending, hand_over
from .headers import (
    Headers,
    host_of,
    misdirected,
    misdirected_text,
    request_headers,
    request_trailers,
    response_headers,
    trailer_headers,
)
from .identity import Identity, Whois
from .routes import Reply, edit_headers
from .upstream import CHUNK, BadGateway, Upstreams

log = structlog.get_logger("agent.http")

PLAIN_TEXT = [("content-type", "text/plain; charset=utf-8")]
GOAWAY_WRITE_TIMEOUT = 5.0
"""Seconds the agent waits for its GOAWAY to be written before it drops the connection."""


@dataclass
class _Stream:
    id: int
    ended: bool = False
    task: asyncio.Task[None] | None = None
    trailers: Headers = field(default_factory=list)
    """The request's trailers (complete once its body ended)."""

    def __post_init__(self) -> None:
        self.body: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()


class _Connection:
    """One HTTP/2 connection's state shared by its stream tasks (one task reads, all may write)."""

    def __init__(self, writer: asyncio.StreamWriter, limits: Limits) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max(1, limits.http2_max_streams),
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.http2_max_header_list_size})
        # The advertised size is answered with 431 (the block is decoded, so HPACK state stays in
        # step); HPACK stops decoding at the hard limit, and h2 ends the connection there.
        self.conn.decoder.max_header_list_size = limits.http2_max_header_list_size * HEADER_LIST_HARD_FACTOR
        self.writer = writer
        self.streams: dict[int, _Stream] = {}
        self.resets = ResetBudget(limits.http2_max_resets, asyncio.get_running_loop().time)
        self.ending: str | None = None
        """Why the agent ends the connection (a ``tailnet_agent_http2_goaway`` reason), once it does."""
        self.draining = False
        """The agent shuts down: no new stream; GOAWAY once the streams in progress are done."""
        self.wait: asyncio.Timeout | None = None
        """The timeout of the read in progress; rescheduled to now to wake the reader."""
        self._window = asyncio.Event()

    def wake_reader(self) -> None:
        """Make the read in progress return to the loop (it checks :attr:`draining` and idleness)."""
        if self.wait is not None and not self.wait.expired():
            self.wait.reschedule(asyncio.get_running_loop().time())

    def goaway(self, code: h2.errors.ErrorCodes, reason: str) -> None:
        """Send GOAWAY; the read loop stops and the connection ends once it is written."""
        self.ending = reason
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(code)
        self.flush()

    async def written(self) -> None:
        """Wait (a bounded time) until what was queued reached the socket, e.g. the GOAWAY."""
        self.writer.transport.set_write_buffer_limits(0)
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(GOAWAY_WRITE_TIMEOUT):
                await self.writer.drain()

    def received(self, event: h2.events.Event) -> None:
        """A client event on a stream already started (body, trailers, end, reset)."""
        stream = self.streams.get(getattr(event, "stream_id", None) or 0)
        if isinstance(event, h2.events.DataReceived):
            if stream is not None:
                stream.body.put_nowait((event.data or b"", event.flow_controlled_length or 0))
            else:  # its response is over: the bytes are dropped, their window given back
                self.acknowledge(event.flow_controlled_length or 0, event.stream_id or 0)
        elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
            stream.trailers.extend((_text(k), _text(v)) for k, v in event.headers or ())
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.body.put_nowait(None)
        elif isinstance(event, h2.events.StreamReset):
            if stream is not None:
                stream.ended = True  # no RST_STREAM back
                self.finish(stream)
                if stream.task is not None:
                    stream.task.cancel()
            if event.remote_reset and not self.resets.spend():
                self.goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, "rapid_reset")

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.writer.write(data)

    def windows_changed(self) -> None:
        self._window.set()
        self._window = asyncio.Event()

    async def body(self, stream: _Stream) -> AsyncIterator[bytes]:
        """The request body, acknowledged (window given back) as the backend takes it."""
        while (item := await stream.body.get()) is not None:
            data, length = item
            self.acknowledge(length, stream.id)
            yield data
        stream.ended = True

    def acknowledge(self, length: int, stream_id: int) -> None:
        """Count ``length`` received bytes as consumed (connection and stream windows) and flush."""
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.acknowledge_received_data(length, stream_id)
        self.flush()

    def finish(self, stream: _Stream) -> None:
        """The stream's response is over: forget it, give back the window of the body nobody will
        read, and ask the client to stop sending a body the response did not wait for (RST_STREAM
        NO_ERROR, RFC 9113 8.1). Without this, the bytes left count against the connection window
        for good and every other stream on the connection stalls once it is used up."""
        self.streams.pop(stream.id, None)
        if self.draining and not self.streams:
            self.wake_reader()
        unread = 0
        while not stream.body.empty():
            item = stream.body.get_nowait()
            if item is None:
                stream.ended = True
            else:
                unread += item[1]
        if unread:
            self.acknowledge(unread, stream.id)
        if not stream.ended:
            self.reset(stream.id, h2.errors.ErrorCodes.NO_ERROR)

    def reset(self, stream_id: int, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.INTERNAL_ERROR) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream_id, code)
            self.flush()

    async def respond(self, stream_id: int, status: int, headers: Headers, body: Any,
                      trailers: Callable[[], Headers] = list, *, end_with_headers: bool = False) -> None:
        """Headers, the body within the stream's window, then trailers (if any) or END_STREAM."""
        self.conn.send_headers(stream_id, [(":status", str(status)), *headers], end_stream=end_with_headers)
        if end_with_headers:
            self.flush()
            return
        self.flush()
        async for chunk in _aiter(body):
            view = memoryview(chunk)
            while view:
                room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
                if room <= 0:
                    await self._window.wait()
                    continue
                self.conn.send_data(stream_id, view[:room].tobytes())
                self.flush()
                view = view[room:]
            await self.writer.drain()
        if extra := trailers():
            self.conn.send_headers(stream_id, extra, end_stream=True)
        else:
            self.conn.end_stream(stream_id)
        self.flush()


Answer = Callable[[_Connection, _Stream, Headers, str], Awaitable[None]]
"""Answers one request of a connection: its stream, its header list (as text, within the limits)
and its authority (``:authority``, else ``host``)."""


class Http2Base:
    """The HTTP/2 connections of one server (named ``name`` in logs): the read loop, the limits,
    the graceful drain; what answers the requests is given with each connection (:meth:`run`)."""

    def __init__(self, name: str, limits: Limits | None = None, metrics: AgentMetrics | None = None) -> None:
        self.name = name
        self.limits = limits or Limits()
        self.metrics = metrics
        self.connections: set[_Connection] = set()
        self.draining = False

    def drain(self) -> None:
        """Shut down gracefully: every connection refuses new streams (REFUSED_STREAM, which a
        client may retry elsewhere) and ends with GOAWAY NO_ERROR once its streams are done."""
        self.draining = True
        for h2c in self.connections:
            h2c.draining = True
            h2c.wake_reader()

    async def run(self, transport: asyncio.Transport, pending: Pending, client: str, answer: Answer) -> None:
        """Serve the connection (TLS with ALPN ``h2``, or plaintext that began with the HTTP/2
        preface; reading may be paused) until it ends, each request answered by ``answer``."""
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        hand_over(transport, pending, protocol)
        writer = asyncio.StreamWriter(transport, protocol, reader, asyncio.get_running_loop())
        h2c = _Connection(writer, self.limits)
        h2c.draining = self.draining
        h2c.conn.initiate_connection()
        h2c.flush()
        self.connections.add(h2c)
        async with asyncio.TaskGroup() as tg:
            try:
                while h2c.ending is None and (data := await self._read(reader, h2c)):
                    try:
                        events = h2c.conn.receive_data(data)
                    except h2.exceptions.ProtocolError as exc:  # e.g. more streams than advertised
                        h2c.goaway(getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR),
                                   self._protocol_error(exc, client))
                        break
                    for event in events:
                        if isinstance(event, h2.events.RequestReceived) and h2c.draining:
                            h2c.reset(event.stream_id or 0, h2.errors.ErrorCodes.REFUSED_STREAM)
                        elif isinstance(event, h2.events.RequestReceived) and event.stream_id is not None:
                            stream = h2c.streams[event.stream_id] = _Stream(event.stream_id)
                            stream.ended = event.stream_ended is not None
                            stream.task = tg.create_task(self._request(h2c, stream, list(event.headers or ()),
                                                                       client, answer))
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            return
                        else:
                            h2c.received(event)
                        h2c.windows_changed()
                        if h2c.ending is not None:
                            break
                    h2c.flush()
                    if not await self._taken(h2c):
                        break
            finally:
                self.connections.discard(h2c)
                for stream in list(h2c.streams.values()):
                    if stream.task is not None:
                        stream.task.cancel()
                if h2c.ending is not None:
                    if self.metrics is not None:
                        self.metrics.http2_goaway.labels(h2c.ending).inc()
                    await h2c.written()
                writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, h2c: _Connection) -> bytes:
        """The client's next bytes, or b"" after GOAWAY NO_ERROR once no request is in progress and
        the agent shuts down, or the connection was idle for an idle timeout (checked each idle
        timeout, so an idle connection ends between one and two idle timeouts after its last
        request)."""
        idle = self.limits.idle_timeout or None
        loop = asyncio.get_running_loop()
        while True:
            if h2c.draining and not h2c.streams:
                h2c.goaway(h2.errors.ErrorCodes.NO_ERROR, "shutdown")
                return b""
            try:
                async with asyncio.timeout_at(None if idle is None else loop.time() + idle) as h2c.wait:
                    return await reader.read(CHUNK)  # cancelling it loses nothing (bytes stay buffered)
            except TimeoutError:
                if not h2c.streams and not h2c.draining:
                    h2c.goaway(h2.errors.ErrorCodes.NO_ERROR, "idle")
                    return b""
            finally:
                h2c.wait = None

    async def _taken(self, h2c: _Connection) -> bool:
        """Read no more while the client does not take what it was sent: the answers h2 queues
        for its frames (SETTINGS and PING acknowledgements) would otherwise pile up in the agent
        without bound (the ping and settings floods, CVE-2019-9512 and -9515). False once the
        connection is gone or the client took nothing for an idle timeout (then it is ended)."""
        try:
            async with asyncio.timeout(self.limits.idle_timeout or None):
                await h2c.writer.drain()
        except TimeoutError:
            h2c.ending = "write_stalled"
            return False
        except ConnectionError:
            return False
        return True

    def _protocol_error(self, exc: h2.exceptions.ProtocolError, client: str) -> str:
        """The GOAWAY reason of a connection error; a header list over the hard limit counts as a
        refused request too."""
        if not isinstance(exc.__cause__, hpack.OversizedHeaderListError):
            return "protocol_error"
        log.info("HTTP/2 connection ended: header list over the hard limit", expose=self.name,
                 client=client, limit=self.limits.http2_max_header_list_size * HEADER_LIST_HARD_FACTOR)
        self._count_refused()
        return "headers_too_large"

    def _count_refused(self) -> None:
        if self.metrics is not None:
            self.metrics.headers_refused.labels("http2").inc()

    async def _request(self, h2c: _Connection, stream: _Stream, raw: list[tuple[Any, Any]], client: str,
                       answer: Answer) -> None:
        """One request: 431 over the header list limit, else what ``answer`` says; the stream is
        finished (:meth:`_Connection.finish`) however it ends."""
        headers = [(_text(k), _text(v)) for k, v in raw]
        authority = next((v for k, v in headers if k == ":authority"), "") or \
            next((v for k, v in headers if k == "host"), "")
        try:
            if (size := header_list_size(raw)) > (limit := self.limits.http2_max_header_list_size):
                log.info("request refused: header list too large", expose=self.name, client=client,
                         size=size, limit=limit)
                self._count_refused()
                await h2c.respond(stream.id, 431, PLAIN_TEXT, [f"header list of {size} bytes, over {limit}\n".encode()])
                return
            await answer(h2c, stream, headers, authority)
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass
        finally:
            h2c.finish(stream)


class Http2Server(Http2Base):
    """One expose's HTTP/2: over TLS, the host its SNI chose (421 for a request that names
    another); :meth:`forward` also serves the requests a plaintext port gives it."""

    def __init__(self, upstreams: Upstreams, limits: Limits | None = None, metrics: AgentMetrics | None = None,
                 *, whois: Whois | None = None) -> None:
        super().__init__(upstreams.name, limits, metrics)
        self.upstreams = upstreams
        self.whois: Whois = whois or (lambda ip: None)

    async def serve(self, tls: asyncio.Transport, pending: Pending, host: VirtualHost, client: str,
                    identity: Identity | None) -> None:
        """Serve the TLS connection (ALPN ``h2``) until it ends."""
        async def answer(h2c: _Connection, stream: _Stream, headers: Headers, authority: str) -> None:
            if misdirected(host, authority):
                await h2c.respond(stream.id, 421, PLAIN_TEXT, [misdirected_text(host, authority).encode()])
                return
            await self.forward(h2c, stream, headers, authority, host, client, identity)

        await self.run(tls, pending, client, answer)

    async def forward(self, h2c: _Connection, stream: _Stream, headers: Headers, authority: str,
                      host: VirtualHost, client: str, identity: Identity | None) -> None:
        """The request to ``host`` where its route says (a backend's answer, or the agent's own)."""
        pseudo = dict(h for h in headers if h[0].startswith(":"))
        method = pseudo.get(":method", "GET")
        decision = self.upstreams.decide(host, method=method, target=pseudo.get(":path", "/"),
                                         authority=authority, headers=headers)
        if isinstance(decision, Reply):
            await h2c.respond(stream.id, decision.status, [*PLAIN_TEXT, *decision.headers],
                              [decision.text.encode()])
            return
        upstream_client = self.upstreams.clients[decision.backend]
        forwarded = edit_headers(request_headers(headers, client=client, authority=authority, identity=identity,
                                                 trailers=upstream_client.trailers, host=decision.authority,
                                                 scheme=self.upstreams.scheme),
                                 decision.request_edits)
        body = None if stream.ended else h2c.body(stream)
        try:
            async with upstream_client.request(method, decision.authority, decision.target,
                                               forwarded, body, lambda: request_trailers(stream.trailers),
                                               ) as upstream:
                out = [(k.lower(), v) for k, v in edit_headers(response_headers(upstream.headers),
                                                               decision.response_edits)]
                if upstream.headers_only:  # gRPC's trailers-only answer stays one HEADERS frame
                    await h2c.respond(stream.id, upstream.status, out, [], end_with_headers=True)
                else:
                    await h2c.respond(stream.id, upstream.status, out, upstream.body(),
                                      lambda: trailer_headers(upstream.trailers))
        except BadGateway as exc:
            await h2c.respond(stream.id, 502, PLAIN_TEXT, [f"{exc}\n".encode()])
        except BackendError as exc:  # after the response began: the client must see it fail
            log.warning("backend failed during the response", expose=self.name, error=str(exc))
            h2c.reset(stream.id)


Pick = Callable[[str], "tuple[Http2Server, VirtualHost] | None"]
"""The expose (its HTTP/2 server) and host a plaintext port gives a request for a host name."""


class PlainHttp2(Http2Base):
    """A plaintext port's HTTP/2 (prior knowledge): each stream goes to the host its
    ``:authority`` names (``pick``), of whichever plaintext expose on the port has it; 404 when
    none does. A connection is the port's, not an expose's: its streams may go to several."""

    def __init__(self, port: int, pick: Pick, *, limits: Limits | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        super().__init__(f"http-{port}", limits, metrics)
        self.pick = pick

    async def serve(self, transport: asyncio.Transport, pending: Pending, client: str) -> None:
        """Serve the plaintext connection, which began with the HTTP/2 preface, until it ends."""
        async def answer(h2c: _Connection, stream: _Stream, headers: Headers, authority: str) -> None:
            name = host_of(authority)
            if (found := self.pick(name)) is None:
                await h2c.respond(stream.id, 404, PLAIN_TEXT, [f"no host {name or '(none)'} on this port\n".encode()])
                return
            server, host = found
            await server.forward(h2c, stream, headers, authority, host, client, server.whois(client))

        await self.run(transport, pending, client, answer)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _aiter(body: Any) -> AsyncIterator[bytes]:
    if hasattr(body, "__aiter__"):
        async for chunk in body:
            yield chunk
    else:
        for chunk in body:
            yield chunk
