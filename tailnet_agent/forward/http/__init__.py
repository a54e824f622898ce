"""The http expose: TLS terminated on the agent, HTTP/1.1 and HTTP/2 to clients and to the app.

The http exposes on one tailnet port share its listener (:class:`HttpPort`). Each accepted
tailnet connection is paused until :meth:`HttpPort.serve` runs ``loop.start_tls``: the SNI
callback finds the host named in SNI among the hosts of every http expose on that port and
switches to its certificate (an unknown name is refused with ``unrecognized_name``; no SNI means
the first host of the first of those exposes in the file). The host so chosen binds the
connection to its expose (:class:`HttpService`): a request whose Host (or ``:authority``) is not
that host's name or alias gets 421 Misdirected Request. ALPN ``h2`` is served with the ``h2``
library, anything else by aiohttp's HTTP/1.1 server protocol.

Requests go to the backend over HTTP/1.1 with an aiohttp client (``protocol: http1``) or over
HTTP/2 (``protocol: h2``: h2c with prior knowledge for ``scheme: http``, h2 over TLS for
``https``; :mod:`.h2backend`); HTTPS to the app is verified against the expose's CA file (or the
system roots) for its server name, always. Hop-by-hop headers are dropped,
X-Forwarded-For/-Proto/-Host set, and the caller's identity from the netmap is sent in the
``Tailnet-*`` headers (:func:`identity_headers`). Every header the client sent in the identity
namespace (:func:`identity_named`: ``Tailnet-*`` and ``Tailscale-*``, in any case, ``_`` read as
``-``) is dropped, from HTTP/1.1 and HTTP/2 requests and HTTP/2 request trailers alike, so the
only ones a backend receives are the agent's. Trailers cross only where both sides are HTTP/2
(gRPC): an HTTP/2 client's request trailers reach an h2 backend, an h2 backend's response
trailers reach an HTTP/2 client; HTTP/1.1 on either side drops them (aiohttp reads and writes
none). A backend that cannot be reached, or whose certificate does not verify, gives 502 and a
log line naming why; one that fails after the response began resets the stream (HTTP/2) or
aborts the connection (HTTP/1.1).

Certificates are read again when their files change (checked, by ``stat``, before each handshake and
for ``/status``): new handshakes get the new certificate, open connections keep theirs. A file that
does not load keeps the certificate in force and shows its error on ``/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.charset
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import aiohttp
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import structlog
from aiohttp import web
from cryptography import x509

from tailnet_agent.contract.exposes import H2, Expose, VirtualHost
from tailnet_agent.contract.status import HostEntry
from tailnet_agent.control.netmap import NetMap

from ..egress import Closable
from ..h2backend import BackendError, H2Backend

log = structlog.get_logger("agent.http")

HANDSHAKE_TIMEOUT = 10.0
CHUNK = 64 << 10
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "http2-settings"})
FORWARDED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})
IDENTITY_PREFIXES = ("tailnet-", "tailscale-")
"""The identity namespace: headers the agent owns (``Tailnet-*``) and those backends written for
``tailscale serve`` trust (``Tailscale-*``). Any the client sends is dropped before the agent's own
are added."""
USER_LOGIN, USER_NAME = "Tailnet-User-Login", "Tailnet-User-Name"
NODE_NAME, NODE_TAGS = "Tailnet-Node-Name", "Tailnet-Node-Tags"
Headers = list[tuple[str, str]]


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


@dataclass(frozen=True)
class Identity:
    """Who is calling, from the netmap: the peer node and its owner (a user, or its tags)."""

    node_name: str
    tags: tuple[str, ...] = ()
    login_name: str | None = None
    display_name: str | None = None


def identify(netmap: NetMap | None, ip: str) -> Identity | None:
    """The peer whose tailnet address ``ip`` is; None when the netmap has no such peer."""
    peer = netmap.peer_by_address(ip) if netmap is not None else None
    if peer is None or netmap is None:
        return None
    name = peer.name.rstrip(".") or peer.hostname
    if peer.tags:
        return Identity(node_name=name, tags=peer.tags)
    profile = netmap.user_profiles.get(peer.user)
    return Identity(node_name=name, login_name=profile.login_name if profile else None,
                    display_name=profile.display_name if profile else None)


def header_value(text: str) -> str:
    """``text`` as a header value: printable ASCII as is, anything else RFC 2047 Q-encoded UTF-8
    (as ``tailscale serve`` encodes its identity headers)."""
    if all(c == "\t" or " " <= c <= "~" for c in text):
        return text
    charset = email.charset.Charset("utf-8")
    charset.header_encoding = email.charset.QP
    return charset.header_encode(text)


def identity_headers(identity: Identity | None) -> Headers:
    """``Tailnet-Node-Name`` always; ``Tailnet-Node-Tags`` (comma-separated) for a tagged node, else
    ``Tailnet-User-Login`` and ``Tailnet-User-Name`` when the netmap has the owner's profile."""
    if identity is None:
        return []
    out = [(NODE_NAME, header_value(identity.node_name))]
    if identity.tags:
        return [*out, (NODE_TAGS, header_value(",".join(identity.tags)))]
    if identity.login_name:
        out.append((USER_LOGIN, header_value(identity.login_name)))
    if identity.display_name:
        out.append((USER_NAME, header_value(identity.display_name)))
    return out


def identity_named(name: str) -> bool:
    """``name`` is in the identity namespace as a backend may read it: lower-cased, with ``_`` read
    as ``-`` (CGI and WSGI servers turn both ``Tailnet-User-Login`` and ``Tailnet_User_Login`` into
    ``HTTP_TAILNET_USER_LOGIN``), it starts with ``tailnet-`` or ``tailscale-``."""
    return name.lower().replace("_", "-").startswith(IDENTITY_PREFIXES)


def wants_trailers(headers: Iterable[tuple[str, str]]) -> bool:
    """The client said ``TE: trailers`` (gRPC does; it is the only TE value HTTP/2 allows)."""
    return any(k.lower() == "te" and "trailers" in {t.strip().lower() for t in v.split(",")} for k, v in headers)


def request_headers(headers: Iterable[tuple[str, str]], *, client: str, authority: str,
                    identity: Identity | None = None, trailers: bool = False) -> Headers:
    """Headers for the backend: hop-by-hop (and those ``Connection`` names), the client's
    forwarding headers and every header in the identity namespace (:func:`identity_named`)
    dropped; Host kept; X-Forwarded-For/-Proto/-Host and the identity headers set; ``TE:
    trailers`` kept when ``trailers`` (an HTTP/2 backend)."""
    items = [(k, v) for k, v in headers if not k.startswith(":")]
    named = {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}
    te = [("te", "trailers")] if trailers and wants_trailers(items) else []
    out = [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | FORWARDED | named | {"host"}
           and not identity_named(k)]
    return [("Host", authority), *out, *te, ("X-Forwarded-For", client), ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", authority), *identity_headers(identity)]


def response_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    """The backend's response headers without hop-by-hop ones."""
    items = list(headers)
    named = {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | named]


def trailer_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    """Trailers as they may be forwarded: no pseudo-headers, no hop-by-hop fields, lower-case names."""
    return [(k.lower(), v) for k, v in headers if not k.startswith(":") and k.lower() not in HOP_BY_HOP]


def request_trailers(headers: Iterable[tuple[str, str]]) -> Headers:
    """A client's trailers for the backend: :func:`trailer_headers` without the identity namespace."""
    return [(k, v) for k, v in trailer_headers(headers) if not identity_named(k)]


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

    def status(self) -> list[HostEntry]:
        """Each host's entry of ``/status`` (its files are checked for a change first)."""
        self.refresh()
        return [{"name": h.name, "alias": h.alias, "error": self._loaded[h.name].error,
                 "notAfter": _iso(self._loaded[h.name].not_after)} for h in self.hosts]

    def host(self, name: str) -> VirtualHost | None:
        """The host that answers to ``name`` (lower-case, no trailing dot)."""
        return self._by_name.get(name)

    def context(self, host: VirtualHost) -> ssl.SSLContext | None:
        """The host's TLS context; None while none could be loaded."""
        return self._loaded[host.name].context


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


Bind = Callable[[Callable[[], asyncio.Protocol], int], Any]
"""Opens the real listener of a port (awaitable; raises OSError when it cannot bind)."""


class HttpPort:
    """The tailnet listener of one port, shared by the http exposes on it: SNI picks the host and
    with it the expose whose :class:`HttpService` serves the connection.

    Each expose on the port holds a lease (:meth:`lease`, the forwarder's ``listen``): the
    listener is bound with the first and closed with the last. A connection being handshaken is
    a task of the port; once it belongs to an expose it is one of that service's connections and
    ends when that expose stops (its siblings' connections stay).
    """

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None) -> None:
        self.port = port
        self.services: dict[str, HttpService] = {}
        """The http exposes on the port, by name."""
        self._order = order
        self._listener: Closable | None = None
        self._leases = 0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.context = server_context()
        self.context.sni_callback = self.sni

    @property
    def idle(self) -> bool:
        return not self.services and not self._leases

    def ordered(self) -> list[HttpService]:
        """The services in the order of the exposes file (else in the order they started)."""
        names = [n for n in self._order() if n in self.services] if self._order else []
        return [self.services[n] for n in dict.fromkeys([*names, *self.services])]

    def route(self, server_name: str | None) -> tuple[HttpService, VirtualHost] | None:
        services = self.ordered()
        if not server_name:
            return (services[0], services[0].expose.hosts[0]) if services else None
        name = server_name.lower().rstrip(".")
        for service in services:
            if (host := service.certs.host(name)) is not None:
                return service, host
        return None

    def sni(self, sslobj: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> int | None:
        """``sni_callback``: switch to the named host's context; remember host and expose on ``sslobj``."""
        found = self.route(server_name)
        if found is None:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        service, host = found
        context = service.certs.context(host)
        if context is None:
            return ssl.ALERT_DESCRIPTION_INTERNAL_ERROR
        sslobj.context = context
        sslobj.virtual_host = host  # type: ignore[attr-defined]
        sslobj.http_service = service  # type: ignore[attr-defined]
        return None

    async def lease(self, bind: Bind) -> Closable:
        async with self._lock:
            if self._listener is None:
                self._listener = await bind(self.protocol, self.port)
            self._leases += 1
        return _Lease(self)

    def release(self) -> None:
        self._leases -= 1
        if self._leases > 0 or self._listener is None:
            return
        self._listener.close()
        self._listener = None
        for task in self._tasks:
            task.cancel()

    async def drain(self) -> None:
        """Wait for the connections still being handshaken after the last lease went."""
        if tasks := [t for t in self._tasks if t is not asyncio.current_task()]:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    def protocol(self) -> asyncio.Protocol:
        """The listener's protocol factory: hold the connection, serve it in a task of the port."""
        held = _Held()
        task = asyncio.get_running_loop().create_task(self.serve(held), name=f"https-{self.port}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return held

    async def serve(self, held: _Held) -> None:
        """One connection: handshake, then HTTP/2 or HTTP/1.1 until it ends; a failure ends it alone."""
        try:
            transport = await held.made
        except ConnectionError:
            return
        try:
            await self._serve(transport)
        except Exception:
            log.exception("https connection failed", port=self.port)
        finally:
            transport.abort()  # a no-op after a clean close

    async def _serve(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        client = str((transport.get_extra_info("peername") or ("?",))[0])
        for service in self.ordered():
            service.certs.refresh()
        try:
            pending = _Pending()
            tls = await loop.start_tls(transport, pending, self.context, server_side=True,
                                       ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            log.info("TLS handshake failed", port=self.port, client=client, error=str(exc) or repr(exc))
            return
        assert tls is not None
        sslobj = tls.get_extra_info("ssl_object")
        chosen: HttpService = sslobj.http_service
        if self.services.get(chosen.expose.name) is not chosen:
            return  # its expose stopped during the handshake
        await chosen.serve_connection(tls, pending, sslobj.virtual_host, client)


class _Lease:
    def __init__(self, port: HttpPort) -> None:
        self._port: HttpPort | None = port

    def close(self) -> None:
        port, self._port = self._port, None
        if port is not None:
            port.release()


class Upstream(Protocol):
    """A backend's response, whichever protocol brought it."""

    status: int
    reason: str
    headers: Headers

    @property
    def trailers(self) -> Headers: ...

    @property
    def headers_only(self) -> bool:
        """The response ended with its headers (to be passed on as one HEADERS frame)."""

    def body(self) -> AsyncIterator[bytes]: ...


class _Http1Response:
    """aiohttp's response as an :class:`Upstream` (HTTP/1.1 brings no trailers here)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status, self.reason = response.status, response.reason or ""
        self.trailers: Headers = []
        self.headers = list(response.headers.items())
        self.headers_only = False
        self._response = response

    async def body(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(CHUNK):
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendError(str(exc) or type(exc).__name__) from exc


Whois = Callable[[str], Identity | None]


class HttpService:
    """One http expose while it listens: certificates, the backend client, the requests."""

    def __init__(self, expose: Expose, whois: Whois | None = None) -> None:
        self.expose = expose
        self.whois = whois or (lambda ip: None)
        self.certs = CertificateStore(expose.hosts)
        backend = expose.backend
        self.base = f"{backend.scheme}://{backend.host}:{backend.port}"
        self.backend_tls: ssl.SSLContext | None = None
        if backend.scheme == "https":
            self.backend_tls = ssl.create_default_context(cafile=backend.ca_file)  # verified, always
            if backend.protocol == H2:
                self.backend_tls.set_alpn_protocols(["h2"])
        self.client: aiohttp.ClientSession | None = None
        self.h2: H2Backend | None = None
        self.http1 = _Http1(self._http1_request)
        self.connections: set[asyncio.Task[Any]] = set()
        """The tasks serving this expose's client connections (cancelled when it stops)."""

    async def __aenter__(self) -> HttpService:
        backend = self.expose.backend
        if backend.protocol == H2:
            self.h2 = H2Backend(backend.host, backend.port, tls=self.backend_tls,
                                server_name=backend.server_name or backend.host)
        else:
            self.client = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10), connector=aiohttp.TCPConnector(ssl=self.backend_tls or True))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tasks = [t for t in self.connections if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self.client is not None:
            await self.client.close()
        if self.h2 is not None:
            await self.h2.close()

    async def serve_connection(self, tls: asyncio.Transport, pending: _Pending, host: VirtualHost,
                               client: str) -> None:
        """A TLS connection whose SNI chose one of this expose's hosts, until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            loop = asyncio.get_running_loop()
            identity = self.whois(client)
            if tls.get_extra_info("ssl_object").selected_alpn_protocol() == "h2":
                reader = asyncio.StreamReader(limit=1 << 20)
                protocol: asyncio.Protocol = asyncio.StreamReaderProtocol(reader)
                _hand_over(tls, pending, protocol)
                await self._serve_h2(reader, asyncio.StreamWriter(tls, protocol, reader, loop), host, client,
                                     identity)
            else:
                handler = self.http1()
                end = self.http1.ends[handler] = loop.create_future()
                _hand_over(tls, pending, handler)
                await end
        finally:
            self.connections.discard(task)

    # -- HTTP/1.1 --

    async def _http1_request(self, request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        host: VirtualHost = request.transport.get_extra_info("ssl_object").virtual_host
        authority = request.headers.get("Host", "")
        if misdirected(host, authority):
            return web.Response(status=421, text=_misdirected_text(host, authority))
        client = request.remote or ""
        headers = request_headers(request.headers.items(), client=client, authority=authority,
                                  identity=self.whois(client), trailers=self.h2 is not None)
        body = request.content.iter_chunked(CHUNK) if request.body_exists else None
        try:
            async with self._upstream(request.method, authority, request.rel_url.raw_path_qs, headers, body,
                                      list) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason or None)
                for key, value in response_headers(upstream.headers):
                    response.headers.add(key, value)
                await response.prepare(request)
                try:
                    async for chunk in upstream.body():
                        await response.write(chunk)
                except BackendError as exc:
                    log.warning("backend failed during the response", expose=self.expose.name, error=str(exc))
                    request.transport.abort()  # the client must not take a cut body for a whole one
                    return response
                await response.write_eof()  # HTTP/1.1 clients get no trailers (aiohttp writes none)
                return response
        except BadGateway as exc:
            return web.Response(status=502, text=f"{exc}\n")

    # -- HTTP/2 --

    async def _serve_h2(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: VirtualHost,
                        client: str, identity: Identity | None) -> None:
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
                        stream = h2c.streams.get(getattr(event, "stream_id", None) or 0)
                        if isinstance(event, h2.events.RequestReceived) and event.stream_id is not None:
                            stream = h2c.streams[event.stream_id] = _H2Stream(event.stream_id)
                            stream.ended = event.stream_ended is not None
                            stream.task = tg.create_task(self._h2_request(h2c, stream, list(event.headers or ()),
                                                                          host, client, identity))
                        elif isinstance(event, h2.events.DataReceived) and stream is not None:
                            stream.body.put_nowait((event.data or b"", event.flow_controlled_length or 0))
                        elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
                            stream.trailers.extend((_text(k), _text(v)) for k, v in event.headers or ())
                        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
                            stream.body.put_nowait(None)
                        elif isinstance(event, h2.events.StreamReset) and stream is not None:
                            del h2c.streams[stream.id]
                            if stream.task is not None:
                                stream.task.cancel()
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
                          client: str, identity: Identity | None) -> None:
        headers = [(_text(k), _text(v)) for k, v in raw]
        pseudo = dict(h for h in headers if h[0].startswith(":"))
        authority = pseudo.get(":authority") or next((v for k, v in headers if k == "host"), "")
        try:
            if misdirected(host, authority):
                await h2c.respond(stream.id, 421, [("content-type", "text/plain; charset=utf-8")],
                                  [_misdirected_text(host, authority).encode()])
                return
            forwarded = request_headers(headers, client=client, authority=authority, identity=identity,
                                        trailers=self.h2 is not None)
            body = None if stream.ended else h2c.body(stream)
            try:
                async with self._upstream(pseudo.get(":method", "GET"), authority, pseudo.get(":path", "/"),
                                          forwarded, body, lambda: request_trailers(stream.trailers)) as upstream:
                    out = [(k.lower(), v) for k, v in response_headers(upstream.headers)]
                    if upstream.headers_only:  # gRPC's trailers-only answer stays one HEADERS frame
                        await h2c.respond(stream.id, upstream.status, out, [], end_with_headers=True)
                    else:
                        await h2c.respond(stream.id, upstream.status, out, upstream.body(),
                                          lambda: trailer_headers(upstream.trailers))
            except BadGateway as exc:
                await h2c.respond(stream.id, 502, [("content-type", "text/plain; charset=utf-8")],
                                  [f"{exc}\n".encode()])
            except BackendError as exc:  # after the response began: the client must see it fail
                log.warning("backend failed during the response", expose=self.expose.name, error=str(exc))
                h2c.reset(stream.id)
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass
        finally:
            h2c.streams.pop(stream.id, None)

    # -- the backend --

    @contextlib.asynccontextmanager
    async def _upstream(self, method: str, authority: str, path: str, headers: Headers,
                        body: AsyncIterator[bytes] | None, trailers: Callable[[], Headers],
                        ) -> AsyncIterator[Upstream]:
        """The backend's response once its head arrived; BadGateway when there is none."""
        backend = self.expose.backend
        if self.h2 is not None:
            h2_headers = [(k, v) for k, v in headers if k.lower() != "host"]  # :authority carries it
            async with contextlib.AsyncExitStack() as stack:
                try:
                    response = await stack.enter_async_context(
                        self.h2.request(method, authority, path, h2_headers, body, trailers))
                except BackendError as exc:
                    raise self._bad_gateway(str(exc)) from None
                yield response
            return
        assert self.client is not None
        extra: dict[str, Any] = {}
        if backend.scheme == "https":
            extra["server_hostname"] = backend.server_name or backend.host
        try:
            answer = await self.client.request(method, self.base + path, headers=headers, data=body,
                                               allow_redirects=False, **extra)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._bad_gateway(str(exc) or type(exc).__name__) from None
        async with answer:
            yield _Http1Response(answer)

    def _bad_gateway(self, error: str) -> BadGateway:
        backend = self.expose.backend
        message = f"backend {backend.host}:{backend.port} failed: {error}"
        log.warning("bad gateway", expose=self.expose.name, error=message)
        return BadGateway(message)


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
    trailers: Headers = field(default_factory=list)
    """The request's trailers (complete once its body ended)."""

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

    def reset(self, stream_id: int) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
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


async def _aiter(body: Any) -> AsyncIterator[bytes]:
    if hasattr(body, "__aiter__"):
        async for chunk in body:
            yield chunk
    else:
        for chunk in body:
            yield chunk
