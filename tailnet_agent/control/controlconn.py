"""The asyncio pump of a TS2021 connection: TLS, ``/key``, the upgrade, Noise and HTTP/2.

All protocol decisions live in the sans-IO pieces (:mod:`.upgrade`, :mod:`.noise`,
:mod:`.session`); this module only moves bytes between them and a socket, and routes
response events to the awaiting request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import aiohttp
import structlog

from .errors import ConnectionLost, ControlError, HTTPStatusError, ProtocolViolation
from .keys import PrivateKey, PublicKey
from .noise import ClientHandshake
from .session import (
    ConnectionEnded,
    ControlSession,
    EarlyPayload,
    ResponseData,
    ResponseEnded,
    ResponseStarted,
    StreamReset,
)
from .upgrade import check_upgrade, parse_server_key, parse_upgrade_response, upgrade_request

log = structlog.get_logger("agent.control.conn")

CONNECT_TIMEOUT = 15.0
"""Seconds for TCP+TLS, the upgrade and the Noise handshake together."""
READ_SIZE = 64 * 1024


def ssl_context(ca_bundle: Path | None) -> ssl.SSLContext:
    """Verify the server against ``ca_bundle`` (None: the system store); ALPN offers only
    HTTP/1.1 because the upgrade is an HTTP/1.1 mechanism."""
    ctx = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


@dataclass(frozen=True, kw_only=True)
class ControlEndpoint:
    """Where the control server is: from a URL like ``https://headscale.example:443``."""

    scheme: str
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Self:
        parts = urlsplit(url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"control URL must be http(s)://host[:port], not {url!r}")
        return cls(scheme=parts.scheme, host=parts.hostname,
                   port=parts.port or (443 if parts.scheme == "https" else 80))

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def authority(self) -> str:
        return self.base_url.split("://", 1)[1]


async def fetch_server_key(endpoint: ControlEndpoint, *, capability_version: int,
                           ssl_ctx: ssl.SSLContext | None) -> PublicKey:
    """``GET /key?v=<capver>``: the server's Noise public key (``direct.go loadServerPubKeys``)."""
    timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT)
    connector = aiohttp.TCPConnector(ssl=ssl_ctx if ssl_ctx is not None else False)
    try:
        async with (aiohttp.ClientSession(timeout=timeout, connector=connector) as http,
                    http.get(f"{endpoint.base_url}/key", params={"v": str(capability_version)}) as resp):
            body = await resp.read()
            if resp.status != 200:
                raise HTTPStatusError(resp.status, body, path="/key")
    except aiohttp.ClientError as exc:
        raise ConnectionLost(f"GET /key failed: {exc!r}") from exc
    return parse_server_key(body)


async def fetch_server_version(endpoint: ControlEndpoint, *, ssl_ctx: ssl.SSLContext | None) -> str | None:
    """``GET /version`` (Headscale 0.27+, unauthenticated): the server's version; "" when the
    server has no such endpoint (404: Headscale 0.26 or another control server); None when it
    could not be asked (the connection itself will then fail and be retried)."""
    timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT)
    connector = aiohttp.TCPConnector(ssl=ssl_ctx if ssl_ctx is not None else False)
    try:
        async with (aiohttp.ClientSession(timeout=timeout, connector=connector) as http,
                    http.get(f"{endpoint.base_url}/version") as resp):
            if resp.status == 404:
                return ""
            if resp.status != 200:
                return None
            doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return str(doc.get("version") or "") if isinstance(doc, dict) else None


@dataclass(kw_only=True)
class Response:
    """A complete response of :meth:`ControlConnection.request`."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(eq=False)
class _Stream:
    started: asyncio.Future[ResponseStarted]
    chunks: asyncio.Queue[bytes | ControlError | None] = field(default_factory=asyncio.Queue)


class StreamingResponse:
    """A response whose body is read as it arrives (the map long-poll)."""

    def __init__(self, conn: ControlConnection, stream_id: int, started: ResponseStarted,
                 stream: _Stream) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.status = started.status
        self.headers = started.headers
        self._stream = stream
        self.ended = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks until the server ends the stream; raises ConnectionLost if the connection dies."""
        while not self.ended:
            item = await self._stream.chunks.get()
            if item is None:
                self.ended = True
                return
            if isinstance(item, ControlError):
                self.ended = True
                raise item
            yield item

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class ControlConnection:
    """One TS2021 connection. Open with :meth:`open`, then run :meth:`run` (the reader pump) as a
    task of the caller's TaskGroup while requests are made; :meth:`aclose` (or leaving ``async
    with``) ends both. ``closed`` is set when the connection is gone for any reason."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: ControlSession,
                 *, endpoint: ControlEndpoint, initial_data: bytes = b"") -> None:
        """Wrap an upgraded stream; ``initial_data`` is what followed the handshake response."""
        self._reader = reader
        self._writer = writer
        self._session = session
        self.endpoint = endpoint
        self._streams: dict[int, _Stream] = {}
        self.early_payload: EarlyPayload | None = None
        self.closed = asyncio.Event()
        self._error: ControlError | None = None
        self._initial_data = initial_data
        self._pump: asyncio.Task[object] | None = None

    @classmethod
    async def open(cls, url: str, machine_key: PrivateKey, *, capability_version: int,
                   ca_bundle: Path | None = None, timeout: float = CONNECT_TIMEOUT) -> Self:
        """Fetch the server key, upgrade to TS2021, and finish the Noise handshake."""
        endpoint = ControlEndpoint.from_url(url)
        ctx = ssl_context(ca_bundle) if endpoint.scheme == "https" else None
        async with asyncio.timeout(timeout):
            server_key = await fetch_server_key(endpoint, capability_version=capability_version, ssl_ctx=ctx)
            reader, writer = await asyncio.open_connection(
                endpoint.host, endpoint.port, ssl=ctx, server_hostname=endpoint.host if ctx else None)
            try:
                session, leftover = await cls._handshake(reader, writer, endpoint, machine_key, server_key,
                                               capability_version)
            except BaseException:
                writer.close()
                raise
        log.info("control connection established", server=endpoint.authority, server_key=server_key.short(),
                 machine_key=machine_key.public.short(), capability_version=capability_version)
        return cls(reader, writer, session, endpoint=endpoint, initial_data=leftover)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, endpoint: ControlEndpoint,
                         machine_key: PrivateKey, server_key: PublicKey, version: int,
                         ) -> tuple[ControlSession, bytes]:
        """Upgrade and handshake; returns the session and the first record bytes already read."""
        handshake = ClientHandshake(machine_key, server_key.raw, version)
        writer.write(upgrade_request(endpoint.authority, handshake.initiation))
        await writer.drain()
        buffer = b""
        while (upgrade := parse_upgrade_response(buffer)) is None:
            buffer += await _read_some(reader)
        check_upgrade(upgrade)
        data = upgrade.leftover
        while (done := handshake.receive_data(data)) is None:
            data = await _read_some(reader)
        transport, leftover = done
        return ControlSession(transport, host=endpoint.host), leftover

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def run(self) -> None:
        """Read and dispatch what the server sends until the connection ends; returns then.

        Blocks: run it in the TaskGroup of the code that makes requests (nothing is answered
        without it). :meth:`aclose` makes it return.
        """
        self._pump = asyncio.current_task()
        await self._read_loop(self._initial_data)

    # -- requests -------------------------------------------------------------------------------

    async def request(self, method: str, path: str, json_body: Any = None) -> Response:
        """One request with a JSON body; returns the whole response."""
        async with self.stream(method, path, json_body) as resp:
            body = await resp.read()
            return Response(status=resp.status, headers=resp.headers, body=body)

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, json_body: Any = None) -> AsyncIterator[StreamingResponse]:
        """A request whose response body is read incrementally; leaving the block early resets the stream."""
        if self._error is not None:
            raise self._error
        body = b"" if json_body is None else json.dumps(json_body).encode()
        stream_id = self._session.send_request(method, path, body)
        stream = _Stream(started=asyncio.get_running_loop().create_future())
        self._streams[stream_id] = stream
        await self._flush()
        resp: StreamingResponse | None = None
        try:
            started = await stream.started
            resp = StreamingResponse(self, stream_id, started, stream)
            yield resp
        finally:
            self._streams.pop(stream_id, None)
            if (resp is None or not resp.ended) and self._error is None:
                self._session.cancel(stream_id)
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await self._flush()

    async def aclose(self) -> None:
        if not self.closed.is_set():
            with contextlib.suppress(Exception):
                self._session.close()
                await self._flush()
        self._fail(ConnectionLost("connection closed by the client"))
        if self._pump is not None and self._pump is not asyncio.current_task():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    # -- the pump -------------------------------------------------------------------------------

    async def _flush(self) -> None:
        data = self._session.data_to_send()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _read_loop(self, data: bytes) -> None:
        try:
            await self._flush()  # the HTTP/2 preface and SETTINGS
            while True:
                if data:
                    for event in self._session.receive_data(data):
                        self._dispatch(event)
                    await self._flush()  # SETTINGS/PING acks and WINDOW_UPDATEs
                data = await self._reader.read(READ_SIZE)
                if not data:
                    raise ConnectionLost("control server closed the connection")
        except ControlError as exc:
            log.info("control connection ended", reason=str(exc))
            self._fail(exc)
        except (OSError, ssl.SSLError) as exc:
            log.info("control connection ended", reason=repr(exc))
            self._fail(ConnectionLost(f"control connection failed: {exc!r}"))

    def _dispatch(self, event: object) -> None:
        match event:
            case EarlyPayload():
                self.early_payload = event
            case ResponseStarted(stream_id=sid) if (stream := self._streams.get(sid)) is not None:
                if not stream.started.done():
                    stream.started.set_result(event)
            case ResponseData(stream_id=sid, data=data) if (stream := self._streams.get(sid)) is not None:
                stream.chunks.put_nowait(data)
            case ResponseEnded(stream_id=sid) if (stream := self._streams.get(sid)) is not None:
                stream.chunks.put_nowait(None)
            case StreamReset(stream_id=sid, error_code=code) if (stream := self._streams.get(sid)) is not None:
                self._fail_stream(stream, ConnectionLost(f"stream {sid} reset by server (code {code})"))
            case ConnectionEnded(error_code=code):
                raise ConnectionLost(f"server ended the HTTP/2 connection (GOAWAY, code {code})")
            case _:
                pass

    def _fail_stream(self, stream: _Stream, error: ControlError) -> None:
        if not stream.started.done():
            stream.started.set_exception(error)
        stream.chunks.put_nowait(error)

    def _fail(self, error: ControlError) -> None:
        if self._error is None:
            self._error = error
        for stream in self._streams.values():
            self._fail_stream(stream, error)
        self.closed.set()


async def _read_some(reader: asyncio.StreamReader) -> bytes:
    data = await reader.read(READ_SIZE)
    if not data:
        raise ProtocolViolation("control server closed the connection during the upgrade")
    return data
