"""HTTP/1.1 to clients: aiohttp's server protocol, one request forwarded at a time.

HTTP/1.1 carries no trailers here (aiohttp reads and writes none). A backend that fails after the
response began aborts the connection: a client must not take a cut body for a whole one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from tailnet_agent.contract.exposes import VirtualHost
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import HTTP1_MAX_FIELDS, Limits

from ..h2backend import BackendError
from .handover import Pending, hand_over
from .headers import host_of, misdirected, misdirected_text, request_headers, response_headers
from .identity import Whois
from .routes import Reply, edit_headers
from .upstream import CHUNK, BadGateway, Upstreams

log = structlog.get_logger("agent.http")


def headers_too_large(exc: BaseException | None) -> bool:
    """aiohttp's parser refused the request for its size: a request line or header field over its
    limit (``LineTooLong``) or more fields than :data:`HTTP1_MAX_FIELDS` (a plain
    ``BadHttpMessage`` that only its message tells apart)."""
    return isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage)
                                            and exc.message.startswith("Too many headers"))


class _Handler(web.RequestHandler):
    """aiohttp's connection handler, answering a request over the header limits with 431."""

    def __init__(self, server: Http1Base, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.server = server

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400 or not headers_too_large(exc):
            return super().handle_error(request, status, exc, message)
        # Not aiohttp's own handling: it logs the offending line, which may hold a credential.
        return self.server.refuse_headers(request.remote or "")


class Http1Base(web.Server):
    """aiohttp's HTTP/1.1 server protocol factory with the agent's limits (named ``name`` in logs);
    tells each connection's end to its waiter, so that the connection stays a task of its owner
    while it lasts. A subclass answers the requests (:meth:`answer`)."""

    def __init__(self, name: str, *, limits: Limits | None = None, metrics: AgentMetrics | None = None) -> None:
        limits = limits or Limits()
        # aiohttp's keep-alive timeout is the idle timeout (0 would mean no keep-alive: a large value instead)
        super().__init__(self.answer, access_log=None, keepalive_timeout=limits.idle_timeout or 1e9,
                         max_line_size=limits.http1_max_line_size, max_field_size=limits.http1_max_field_size,
                         max_headers=HTTP1_MAX_FIELDS)
        self.name = name
        self.limits = limits
        self.metrics = metrics
        self.ends: dict[web.RequestHandler, asyncio.Future[None]] = {}

    def __call__(self) -> web.RequestHandler:
        return _Handler(self, loop=asyncio.get_running_loop(), **self._kwargs)

    def refuse_headers(self, client: str) -> web.Response:
        """431 for a request whose request line or header fields are over the limits (the
        connection then closes: aiohttp cannot tell where the next request would start)."""
        limits = self.limits
        log.info("request refused: header section too large", expose=self.name, client=client,
                 max_line_size=limits.http1_max_line_size, max_field_size=limits.http1_max_field_size,
                 max_fields=HTTP1_MAX_FIELDS)
        if self.metrics is not None:
            self.metrics.headers_refused.labels("http1").inc()
        response = web.Response(status=431, text=(
            f"request line over {limits.http1_max_line_size} bytes, a header field over "
            f"{limits.http1_max_field_size} bytes or more than {HTTP1_MAX_FIELDS} fields\n"))
        response.force_close()
        return response

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if (end := self.ends.pop(handler, None)) is not None and not end.done():
            end.set_result(None)

    async def serve(self, transport: asyncio.Transport, pending: Pending) -> None:
        """Serve the connection (TLS, or plain with reading paused) until it ends."""
        handler = self()
        end = self.ends[handler] = asyncio.get_running_loop().create_future()
        hand_over(transport, pending, handler)
        await end

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse:
        raise NotImplementedError


class Http1Server(Http1Base):
    """One expose's HTTP/1.1: over TLS, the host its SNI chose (421 for a request that names
    another); :meth:`forward` also serves the requests a plaintext port gives it."""

    def __init__(self, upstreams: Upstreams, whois: Whois, *, limits: Limits | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        super().__init__(upstreams.name, limits=limits, metrics=metrics)
        self.upstreams = upstreams
        self.whois = whois

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        host: VirtualHost = request.transport.get_extra_info("ssl_object").virtual_host
        authority = request.headers.get("Host", "")
        if misdirected(host, authority):
            return web.Response(status=421, text=misdirected_text(host, authority))
        return await self.forward(request, host)

    async def forward(self, request: web.BaseRequest, host: VirtualHost) -> web.StreamResponse:
        """The request to ``host`` where its route says (a backend's answer, or the agent's own)."""
        assert request.transport is not None
        authority = request.headers.get("Host", "")
        decision = self.upstreams.decide(host, method=request.method, target=request.rel_url.raw_path_qs,
                                         authority=authority, headers=request.headers.items())
        if isinstance(decision, Reply):
            return web.Response(status=decision.status, text=decision.text, headers=dict(decision.headers))
        upstream_client = self.upstreams.clients[decision.backend]
        client = request.remote or ""
        headers = edit_headers(request_headers(request.headers.items(), client=client, authority=authority,
                                               identity=self.whois(client), trailers=upstream_client.trailers,
                                               host=decision.authority, scheme=self.upstreams.scheme),
                               decision.request_edits)
        body = request.content.iter_chunked(CHUNK) if request.body_exists else None
        try:
            async with upstream_client.request(request.method, decision.authority, decision.target, headers,
                                               body, list) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason or None)
                for key, value in edit_headers(response_headers(upstream.headers), decision.response_edits):
                    response.headers.add(key, value)
                await response.prepare(request)
                try:
                    async for chunk in upstream.body():
                        await response.write(chunk)
                except BackendError as exc:
                    log.warning("backend failed during the response", expose=self.name, error=str(exc))
                    request.transport.abort()  # the client must not take a cut body for a whole one
                    return response
                await response.write_eof()  # HTTP/1.1 clients get no trailers (aiohttp writes none)
                return response
        except BadGateway as exc:
            return web.Response(status=502, text=f"{exc}\n")


Pick = Callable[[str], "tuple[Http1Server, VirtualHost] | None"]
"""The expose (its HTTP/1.1 server) and host a plaintext port gives a request for a host name."""


class PlainHttp1(Http1Base):
    """A plaintext port's HTTP/1.1: each request goes to the host its Host names (``pick``), of
    whichever plaintext expose on the port has it; 404 when none does."""

    def __init__(self, port: int, pick: Pick, *, limits: Limits | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        super().__init__(f"http-{port}", limits=limits, metrics=metrics)
        self.pick = pick

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse:
        name = host_of(request.headers.get("Host"))
        found = self.pick(name)
        if found is None:
            return web.Response(status=404, text=f"no host {name or '(none)'} on this port\n")
        server, host = found
        return await server.forward(request, host)
