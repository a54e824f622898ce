"""The http expose: TLS terminated on the agent, HTTP/1.1 and HTTP/2 to clients, HTTP/1.1 to the app.

Each accepted tailnet connection is paused until :meth:`HttpService.serve` runs ``loop.start_tls``:
the :class:`CertificateStore` picks the certificate of the host named in SNI (``sni_callback``; an
unknown name is refused with ``unrecognized_name``, no SNI means the expose's first host). The host
so chosen binds the connection: a request whose Host (or ``:authority``) is not that host's name or
alias gets 421 Misdirected Request. ALPN ``h2`` is served with the ``h2`` library, anything else by
aiohttp's HTTP/1.1 server protocol. Requests go to the backend with an aiohttp client over HTTP/1.1,
or HTTPS verified against the expose's CA file (or the system roots) for its server name, with
hop-by-hop headers dropped and X-Forwarded-For/-Proto/-Host set (what the client sent in those is
replaced). A backend that cannot be reached, or whose certificate does not verify, gives 502 and a
log line naming why.

Certificates are read again when their files change (checked, by ``stat``, before each handshake and
for ``/status``): new handshakes get the new certificate, open connections keep theirs. A file that
does not load keeps the certificate in force and shows its error on ``/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import structlog
from aiohttp import web
from cryptography import x509

from tailnet_agent.config import PortMapping
from tailnet_agent.exposes import Expose, VirtualHost

from .egress import Connection

log = structlog.get_logger("agent.http")

HANDSHAKE_TIMEOUT = 10.0
CHUNK = 64 << 10
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "http2-settings"})
FORWARDED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})


# -- pure header handling -------------------------------------------------------------------------

def host_of(authority: str | None) -> str:
    """The host of a Host header or ``:authority``: lower-case, without port and trailing dot."""
    text = (authority or "").strip().lower()
    if text.startswith("["):
        text = text[:text.find("]") + 1]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def misdirected(host: VirtualHost, authority: str | None) -> bool:
    """The request names another host than the one the TLS connection was made for."""
    return host_of(authority) not in host.names


def request_headers(headers: Iterable[tuple[str, str]], *, client: str, authority: str) -> list[tuple[str, str]]:
    """Headers for the backend: hop-by-hop (and those ``Connection`` names) and the client's
    forwarding headers dropped; Host kept; X-Forwarded-For/-Proto/-Host set."""
    items = [(k, v) for k, v in headers if not k.startswith(":")]
    named = {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}
    out = [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | FORWARDED | named | {"host"}]
    return [("Host", authority), *out, ("X-Forwarded-For", client), ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", authority)]


def response_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The backend's response headers without hop-by-hop ones."""
    items = list(headers)
    named = {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | named]


# -- certificates ---------------------------------------------------------------------------------

@dataclass
class _Loaded:
    stamp: tuple[object, ...] = ()
    context: ssl.SSLContext | None = None
    not_after: datetime | None = None
    error: str | None = None


class CertificateStore:
    """The TLS context of each virtual host, loaded from its files and re-loaded when they change."""

    def __init__(self, hosts: tuple[VirtualHost, ...]) -> None:
        self.hosts = hosts
        self._by_name = {name: host for host in hosts for name in host.names}
        self._loaded = {host.name: _Loaded() for host in hosts}
        self.refresh()

    def refresh(self) -> None:
        """Load each host whose files changed (kubelet swaps a symlink: ``stat`` follows it)."""
        for host in self.hosts:
            state = self._loaded[host.name]
            try:
                stamp = tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, (host.cert_file,
                                                                                          host.key_file)))
            except OSError as exc:
                self._failed(host, state, (), f"cannot read {exc.filename}: {exc.strerror or exc}")
                continue
            if stamp == state.stamp:
                continue
            try:
                context = server_context()
                context.load_cert_chain(host.cert_file, host.key_file)
                with open(host.cert_file, "rb") as f:
                    not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._failed(host, state, stamp, f"cannot load {host.cert_file} and {host.key_file}: {exc}")
                continue
            if state.context is not None:
                log.info("certificate reloaded", host=host.name, not_after=not_after.isoformat())
            self._loaded[host.name] = _Loaded(stamp, context, not_after)

    def _failed(self, host: VirtualHost, state: _Loaded, stamp: tuple[object, ...], error: str) -> None:
        if error != state.error:
            log.error("certificate not loaded; the one in force stays", host=host.name, error=error)
        state.stamp, state.error = stamp, error

    def status(self) -> list[dict[str, Any]]:
        self.refresh()
        return [{"name": h.name, "alias": h.alias, "error": self._loaded[h.name].error,
                 "notAfter": _iso(self._loaded[h.name].not_after)} for h in self.hosts]

    def sni(self, sslobj: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> int | None:
        """``sni_callback``: switch to the named host's context and remember the host on ``sslobj``."""
        host = self._by_name.get(server_name.lower().rstrip(".")) if server_name else self.hosts[0]
        if host is None:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        context = self._loaded[host.name].context
        if context is None:
            return ssl.ALERT_DESCRIPTION_INTERNAL_ERROR
        sslobj.context = context
        sslobj.virtual_host = host  # type: ignore[attr-defined]
        return None

    def listener_context(self) -> ssl.SSLContext:
        context = server_context()
        context.sni_callback = self.sni
        return context


def server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def _iso(when: datetime | None) -> str | None:
    return when.isoformat().replace("+00:00", "Z") if when else None


# -- connections ----------------------------------------------------------------------------------

class _Held(asyncio.Protocol):
    """An accepted connection held paused until its TLS handshake starts (and, after it, until
    the protocol for the negotiated HTTP version takes over)."""

    transport: asyncio.Transport | None = None

    def __init__(self) -> None:
        self.made: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()
        if not self.made.done():
            self.made.set_result(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.made.done():
            self.made.set_exception(ConnectionResetError("the connection ended before it was served"))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _Pending(asyncio.Protocol):
    """The TLS side until the HTTP protocol takes over: keeps what arrives (``loop.start_tls`` does
    not call ``connection_made`` on it, so it cannot pause; a client may send with its Finished)."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True


class _Http1(web.Server):
    """aiohttp's HTTP/1.1 server protocol factory; tells each connection's end to its waiter."""

    def __init__(self, handler: Any) -> None:
        super().__init__(handler, access_log=None)
        self.ends: dict[web.RequestHandler, asyncio.Future[None]] = {}

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if (end := self.ends.pop(handler, None)) is not None and not end.done():
            end.set_result(None)


class HttpService:
    """One http expose while it listens: certificates, the backend client, the HTTP servers."""

    def __init__(self, expose: Expose) -> None:
        self.expose = expose
        self.certs = CertificateStore(expose.hosts)
        self.tls = self.certs.listener_context()
        backend = expose.backend
        self.base = f"{backend.scheme}://{backend.host}:{backend.port}"
        self.backend_tls: ssl.SSLContext | None = None
        if backend.scheme == "https":
            self.backend_tls = ssl.create_default_context(cafile=backend.ca_file)  # verified, always
        self.client: aiohttp.ClientSession | None = None
        self.http1 = _Http1(self._http1_request)

    async def __aenter__(self) -> HttpService:
        self.client = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10), connector=aiohttp.TCPConnector(ssl=self.backend_tls or True))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.client is not None:
            await self.client.close()

    def accept(self, mapping: PortMapping) -> Connection:
        held = _Held()
        return held, self.serve(held), held.abort

    async def serve(self, held: _Held) -> None:
        """One connection: handshake, then HTTP/2 or HTTP/1.1 until it ends; a failure ends it alone."""
        try:
            transport = await held.made
        except ConnectionError:
            return
        try:
            await self._serve(transport)
        except Exception:
            log.exception("https connection failed", expose=self.expose.name)
        finally:
            transport.abort()  # a no-op after a clean close

    async def _serve(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        client = str((transport.get_extra_info("peername") or ("?",))[0])
        self.certs.refresh()
        try:
            pending = _Pending()
            tls = await loop.start_tls(transport, pending, self.tls, server_side=True,
                                       ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            log.info("TLS handshake failed", expose=self.expose.name, client=client, error=str(exc) or repr(exc))
            return
        assert tls is not None
        sslobj = tls.get_extra_info("ssl_object")
        host: VirtualHost = sslobj.virtual_host
        if sslobj.selected_alpn_protocol() == "h2":
            reader = asyncio.StreamReader(limit=1 << 20)
            protocol: asyncio.Protocol = asyncio.StreamReaderProtocol(reader)
            _hand_over(tls, pending, protocol)
            await self._serve_h2(reader, asyncio.StreamWriter(tls, protocol, reader, loop), host, client)
        else:
            handler = self.http1()
            end = self.http1.ends[handler] = loop.create_future()
            _hand_over(tls, pending, handler)
            await end

    # -- HTTP/1.1 --

    async def _http1_request(self, request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        host: VirtualHost = request.transport.get_extra_info("ssl_object").virtual_host
        authority = request.headers.get("Host", "")
        if misdirected(host, authority):
            return web.Response(status=421, text=_misdirected_text(host, authority))
        headers = request_headers(request.headers.items(), client=request.remote or "", authority=authority)
        body = request.content if request.body_exists else None
        try:
            async with self._upstream(request.method, request.rel_url.raw_path_qs, headers, body) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in response_headers(upstream.headers.items()):
                    response.headers.add(key, value)
                await response.prepare(request)
                async for chunk in upstream.content.iter_chunked(CHUNK):
                    await response.write(chunk)
                await response.write_eof()
                return response
        except BadGateway as exc:
            return web.Response(status=502, text=f"{exc}\n")

    # -- HTTP/2 --

    async def _serve_h2(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: VirtualHost,
                        client: str) -> None:
        h2c = _H2(writer)
        h2c.conn.initiate_connection()
        h2c.flush()
        async with asyncio.TaskGroup() as tg:
            try:
                while data := await reader.read(CHUNK):
                    try:
                        events = h2c.conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        break
                    for event in events:
                        if isinstance(event, h2.events.RequestReceived) and event.stream_id is not None:
                            stream = h2c.streams[event.stream_id] = _H2Stream(event.stream_id)
                            stream.ended = event.stream_ended is not None
                            stream.task = tg.create_task(self._h2_request(h2c, stream, list(event.headers or ()),
                                                                          host, client))
                        elif isinstance(event, h2.events.DataReceived) and event.stream_id in h2c.streams:
                            h2c.streams[event.stream_id].body.put_nowait((event.data or b"",
                                                                          event.flow_controlled_length or 0))
                        elif isinstance(event, h2.events.StreamEnded) and event.stream_id in h2c.streams:
                            h2c.streams[event.stream_id].body.put_nowait(None)
                        elif isinstance(event, h2.events.StreamReset) and event.stream_id in h2c.streams:
                            if (task := h2c.streams.pop(event.stream_id).task) is not None:
                                task.cancel()
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            return
                        h2c.windows_changed()
                    h2c.flush()
            finally:
                for stream in h2c.streams.values():
                    if stream.task is not None:
                        stream.task.cancel()
                writer.transport.abort()

    async def _h2_request(self, h2c: _H2, stream: _H2Stream, raw: list[tuple[Any, Any]], host: VirtualHost,
                          client: str) -> None:
        headers = [(_text(k), _text(v)) for k, v in raw]
        pseudo = dict(h for h in headers if h[0].startswith(":"))
        authority = pseudo.get(":authority") or next((v for k, v in headers if k == "host"), "")
        try:
            if misdirected(host, authority):
                await h2c.respond(stream.id, 421, [("content-type", "text/plain; charset=utf-8")],
                                  [_misdirected_text(host, authority).encode()])
                return
            forwarded = request_headers(headers, client=client, authority=authority)
            body = None if stream.ended else h2c.body(stream)
            try:
                async with self._upstream(pseudo.get(":method", "GET"), pseudo.get(":path", "/"), forwarded,
                                          body) as upstream:
                    out = [(k.lower(), v) for k, v in response_headers(upstream.headers.items())]
                    await h2c.respond(stream.id, upstream.status, out, upstream.content.iter_chunked(CHUNK))
            except BadGateway as exc:
                await h2c.respond(stream.id, 502, [("content-type", "text/plain; charset=utf-8")],
                                  [f"{exc}\n".encode()])
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass
        finally:
            h2c.streams.pop(stream.id, None)

    # -- the backend --

    @contextlib.asynccontextmanager
    async def _upstream(self, method: str, path: str, headers: list[tuple[str, str]], body: Any,
                        ) -> AsyncIterator[aiohttp.ClientResponse]:
        assert self.client is not None
        backend = self.expose.backend
        extra: dict[str, Any] = {}
        if backend.scheme == "https":
            extra["server_hostname"] = backend.server_name or backend.host
        try:
            response = await self.client.request(method, self.base + path, headers=headers, data=body,
                                                 allow_redirects=False, **extra)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            message = f"backend {backend.host}:{backend.port} failed: {str(exc) or type(exc).__name__}"
            log.warning("bad gateway", expose=self.expose.name, error=message)
            raise BadGateway(message) from None
        async with response:
            yield response


class BadGateway(Exception):
    """The backend could not be asked (refused, unreachable, TLS verification failed)."""


def _hand_over(tls: asyncio.Transport, pending: _Pending, protocol: asyncio.Protocol) -> None:
    tls.set_protocol(protocol)
    protocol.connection_made(tls)
    if pending.data:
        protocol.data_received(b"".join(pending.data))
    if pending.eof:
        protocol.eof_received()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _misdirected_text(host: VirtualHost, authority: str) -> str:
    return f"421 Misdirected Request: this connection is for {host.name}, not {host_of(authority) or '(no host)'}\n"


@dataclass
class _H2Stream:
    id: int
    ended: bool = False
    task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.body: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()


class _H2:
    """One HTTP/2 connection's state shared by its stream tasks (one task reads, all may write)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.writer = writer
        self.streams: dict[int, _H2Stream] = {}
        self._window = asyncio.Event()

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.writer.write(data)

    def windows_changed(self) -> None:
        self._window.set()
        self._window = asyncio.Event()

    async def body(self, stream: _H2Stream) -> AsyncIterator[bytes]:
        """The request body, acknowledged (window given back) as the backend takes it."""
        while (item := await stream.body.get()) is not None:
            data, length = item
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.conn.acknowledge_received_data(length, stream.id)
            self.flush()
            yield data

    async def respond(self, stream_id: int, status: int, headers: list[tuple[str, str]], body: Any) -> None:
        self.conn.send_headers(stream_id, [(":status", str(status)), *headers])
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
        self.conn.end_stream(stream_id)
        self.flush()


async def _aiter(body: Any) -> AsyncIterator[bytes]:
    if hasattr(body, "__aiter__"):
        async for chunk in body:
            yield chunk
    else:
        for chunk in body:
            yield chunk
