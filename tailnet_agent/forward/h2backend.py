"""The http expose's HTTP/2 client to its backend (``protocol: h2``), with the ``h2`` library.

Cleartext backends (``scheme: http``) are spoken to with prior knowledge (h2c, RFC 9113 3.3);
``scheme: https`` backends over TLS verified against the expose's CA file or the system roots,
with ALPN ``h2`` required (a server that picks anything else is a bad gateway, never a silent
fallback). Streams of all the expose's requests share a connection up to the server's
``SETTINGS_MAX_CONCURRENT_STREAMS``; more open another. A connection that ends, fails or gets
a GOAWAY takes no new streams (its open streams fail: the ``h2`` state machine accepts no frames
after GOAWAY) and the next request opens a new one.

Trailers go both ways: a request's trailers are sent as a last HEADERS frame after its body, the
response's are kept in :attr:`H2Response.trailers` once its body is read (gRPC's ``grpc-status``
lives there). Flow control both ways: the request body waits for window, the response's DATA is
acknowledged as the reader takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import structlog

log = structlog.get_logger("agent.http")

CHUNK = 64 << 10
STREAM_WINDOW = 1 << 20
"""How much of one response may be in flight before its reader takes it (RFC default: 64 KiB)."""
CONNECTION_WINDOW = 16 << 20
"""The same for all streams of a connection together, so one slow reader does not stall the rest."""
Headers = list[tuple[str, str]]


class BackendError(Exception):
    """The backend could not be asked, or ended the exchange before its response was complete."""


@dataclass
class _Exchange:
    """One stream's response as it arrives."""

    id: int
    head: asyncio.Future[tuple[int, Headers]]
    body: asyncio.Queue[tuple[bytes, int] | BaseException | None] = field(default_factory=asyncio.Queue)
    trailers: Headers = field(default_factory=list)
    ended: bool = False
    headers_only: bool = False
    """The response was its HEADERS frame alone (END_STREAM on it: gRPC's "trailers-only")."""


class H2Response:
    """A backend response: status and headers at once, the body as it is read, trailers after it."""

    def __init__(self, conn: _Connection, exchange: _Exchange, status: int, headers: Headers) -> None:
        self.status = status
        self.reason = ""
        self.headers = headers
        self._conn = conn
        self._exchange = exchange

    @property
    def trailers(self) -> Headers:
        """The response's trailers (complete once :meth:`body` is exhausted)."""
        return self._exchange.trailers

    @property
    def headers_only(self) -> bool:
        """The response ended with its headers: no body, no trailers."""
        return self._exchange.headers_only

    async def body(self) -> AsyncIterator[bytes]:
        """The DATA of the stream; its flow-control window is given back as each chunk is taken."""
        exchange = self._exchange
        while (item := await exchange.body.get()) is not None:
            if isinstance(item, BaseException):
                raise BackendError(str(item)) from item
            data, length = item
            self._conn.acknowledge(exchange.id, length)
            if data:
                yield data


class _Connection:
    """One HTTP/2 connection to the backend; a task reads it and dispatches to the streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.exchanges: dict[int, _Exchange] = {}
        self.closed = False
        self.error: str | None = None
        self._window = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        codes = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            codes.MAX_CONCURRENT_STREAMS: 100, codes.MAX_HEADER_LIST_SIZE: self.h2.DEFAULT_MAX_HEADER_LIST_SIZE,
            codes.ENABLE_PUSH: 0, codes.INITIAL_WINDOW_SIZE: STREAM_WINDOW})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.flush()
        self.task = asyncio.create_task(self._read(), name=f"h2-backend-{self.name}")

    @property
    def has_room(self) -> bool:
        return not self.closed and self.h2.open_outbound_streams < self.h2.remote_settings.max_concurrent_streams

    def flush(self) -> None:
        if not self.closed and (data := self.h2.data_to_send()):
            self.writer.write(data)

    def acknowledge(self, stream_id: int, length: int) -> None:
        if self.closed or not length:
            return
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.acknowledge_received_data(length, stream_id)
            self.flush()

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(CHUNK):
                for event in self.h2.receive_data(data):
                    self._dispatch(event)
                self.flush()
            self._fail("the backend closed the connection")
        except h2.exceptions.ProtocolError as exc:
            self._fail(f"HTTP/2 protocol error: {exc}")
        except (OSError, ssl.SSLError) as exc:
            self._fail(f"connection lost: {str(exc) or type(exc).__name__}")
        except asyncio.CancelledError:
            self._fail("the expose stopped")
            raise

    def _dispatch(self, event: h2.events.Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        exchange = self.exchanges.get(stream_id) if stream_id is not None else None
        if isinstance(event, h2.events.ResponseReceived) and exchange is not None:
            headers = [(str(k), str(v)) for k, v in event.headers or ()]
            status = next((v for k, v in headers if k == ":status"), "502")
            exchange.headers_only = event.stream_ended is not None
            if not exchange.head.done():
                exchange.head.set_result((int(status), [(k, v) for k, v in headers if not k.startswith(":")]))
        elif isinstance(event, h2.events.DataReceived) and exchange is not None:
            exchange.body.put_nowait((event.data or b"", event.flow_controlled_length or 0))
        elif isinstance(event, h2.events.TrailersReceived) and exchange is not None:
            exchange.trailers.extend((str(k), str(v)) for k, v in event.headers or ())
        elif isinstance(event, h2.events.StreamEnded) and exchange is not None:
            exchange.ended = True
            exchange.body.put_nowait(None)
            self.exchanges.pop(exchange.id, None)
        elif isinstance(event, h2.events.StreamReset) and exchange is not None:
            self._end(exchange, f"the backend reset the stream ({_code(event.error_code)})")
            self.exchanges.pop(exchange.id, None)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._fail(f"the backend closed the connection (GOAWAY {_code(event.error_code)})")
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window.set()
            self._window = asyncio.Event()

    def _end(self, exchange: _Exchange, why: str) -> None:
        error = BackendError(why)
        if not exchange.head.done():
            exchange.head.set_exception(error)
        elif not exchange.ended:
            exchange.body.put_nowait(error)
        exchange.ended = True

    def _fail(self, why: str) -> None:
        if self.closed:
            return
        self.closed, self.error = True, why
        for exchange in list(self.exchanges.values()):
            self._end(exchange, why)
        self.exchanges.clear()
        self._window.set()
        self.writer.close()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait([self.task])
        self._fail("closed")

    # -- one request --

    def open(self, headers: Headers, end_stream: bool) -> _Exchange:
        stream_id = self.h2.get_next_available_stream_id()
        exchange = _Exchange(stream_id, asyncio.get_running_loop().create_future())
        self.exchanges[stream_id] = exchange
        self.h2.send_headers(stream_id, headers, end_stream=end_stream)
        self.flush()
        return exchange

    async def send_body(self, exchange: _Exchange, body: AsyncIterator[bytes],
                        trailers: Callable[[], Headers]) -> None:
        """The request body within the stream's window, then its trailers (or END_STREAM)."""
        stream_id = exchange.id
        async for chunk in body:
            view = memoryview(chunk)
            while view:
                if self.closed or exchange.ended:
                    return
                room = min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size)
                if room <= 0:
                    await self._window.wait()
                    continue
                self.h2.send_data(stream_id, view[:room].tobytes())
                self.flush()
                view = view[room:]
            await self.writer.drain()
        if self.closed or exchange.ended:
            return
        if extra := trailers():
            self.h2.send_headers(stream_id, [(k.lower(), v) for k, v in extra], end_stream=True)
        else:
            self.h2.end_stream(stream_id)
        self.flush()

    def cancel(self, exchange: _Exchange) -> None:
        """The client went away (or the response was not read to its end): RST_STREAM CANCEL."""
        self.exchanges.pop(exchange.id, None)
        if self.closed or exchange.ended:
            return
        exchange.ended = True
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.h2.reset_stream(exchange.id, h2.errors.ErrorCodes.CANCEL)
            self.flush()


def _code(code: object) -> str:
    return getattr(code, "name", None) or str(code)


class H2Backend:
    """The HTTP/2 connections of one expose to its backend."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None, server_name: str | None,
                 connect_timeout: float = 10.0) -> None:
        self.host, self.port = host, port
        self.tls = tls
        self.server_name = server_name or host
        self.connect_timeout = connect_timeout
        self.scheme = "https" if tls is not None else "http"
        self._connections: list[_Connection] = []
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        connections, self._connections = self._connections, []
        for conn in connections:
            await conn.close()

    async def _connection(self) -> _Connection:
        async with self._lock:
            self._connections = [c for c in self._connections if not c.closed]
            for conn in self._connections:
                if conn.has_room:
                    return conn
            conn = await self._connect()
            self._connections.append(conn)
            return conn

    async def _connect(self) -> _Connection:
        where = f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.tls is None:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                else:
                    reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls,
                                                                   server_hostname=self.server_name)
        except TimeoutError:
            raise BackendError(f"connecting to {where} timed out after {self.connect_timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise BackendError(str(exc) or type(exc).__name__) from None
        if self.tls is not None:
            chosen = writer.get_extra_info("ssl_object").selected_alpn_protocol()
            if chosen != "h2":
                writer.close()
                raise BackendError(f"the backend did not negotiate HTTP/2 over TLS (ALPN {chosen or 'none'}); "
                                   "set protocol http1 for it")
        conn = _Connection(reader, writer, where)
        conn.start()
        return conn

    @contextlib.asynccontextmanager
    async def request(self, method: str, authority: str, path: str, headers: Headers,
                      body: AsyncIterator[bytes] | None, trailers: Callable[[], Headers],
                      ) -> AsyncIterator[H2Response]:
        """One exchange: headers, body and trailers sent while the response is awaited; the
        response is yielded once its headers arrived. Leaving early resets the stream."""
        conn = await self._connection()
        pseudo = [(":method", method), (":scheme", self.scheme), (":authority", authority), (":path", path)]
        try:
            exchange = conn.open([*pseudo, *((k.lower(), v) for k, v in headers)], end_stream=body is None)
        except h2.exceptions.ProtocolError as exc:
            raise BackendError(f"cannot open a stream: {exc}") from None
        sending: asyncio.Task[None] | None = None
        if body is not None:
            sending = asyncio.create_task(conn.send_body(exchange, body, trailers))
        try:
            status, response_headers = await _first(exchange.head, sending)
            yield H2Response(conn, exchange, status, response_headers)
        finally:
            if sending is not None and not sending.done():
                sending.cancel()
                await asyncio.wait([sending])
            conn.cancel(exchange)


async def _first(head: asyncio.Future[tuple[int, Headers]], sending: asyncio.Task[None] | None,
                 ) -> tuple[int, Headers]:
    """The response head; a request body that fails to send (the client went away) ends the wait."""
    if sending is None:
        return await head
    either: list[asyncio.Future[Any]] = [head, sending]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not head.done() and not sending.cancelled() and (exc := sending.exception()) is not None:
        raise BackendError(f"the request body could not be sent: {exc}") from exc
    return await head
