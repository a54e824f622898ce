"""HTTP/1.1 to clients: aiohttp's server protocol, one request forwarded at a time.

HTTP/1.1 carries no trailers here (aiohttp reads and writes none). A backend that fails after the
response began aborts the connection: a client must not take a cut body for a whole one.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from tailnet_agent.contract.exposes import VirtualHost
from tailnet_agent.limits import DEFAULT_IDLE_TIMEOUT

from ..h2backend import BackendError
from .handover import Pending, hand_over
from .headers import misdirected, misdirected_text, request_headers, response_headers
from .identity import Whois
from .upstream import CHUNK, BadGateway, UpstreamClient

log = structlog.get_logger("agent.http")


class Http1Server(web.Server):
    """aiohttp's HTTP/1.1 server protocol factory for one expose; tells each connection's end to
    its waiter, so that the connection stays a task of the expose while it lasts."""

    def __init__(self, upstream: UpstreamClient, whois: Whois, *, idle_timeout: float = DEFAULT_IDLE_TIMEOUT) -> None:
        # aiohttp's keep-alive timeout is the idle timeout (0 would mean no keep-alive: a large value instead)
        super().__init__(self._request, access_log=None, keepalive_timeout=idle_timeout or 1e9)
        self.upstream = upstream
        self.whois = whois
        self.ends: dict[web.RequestHandler, asyncio.Future[None]] = {}

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if (end := self.ends.pop(handler, None)) is not None and not end.done():
            end.set_result(None)

    async def serve(self, tls: asyncio.Transport, pending: Pending) -> None:
        """Serve the TLS connection until it ends."""
        handler = self()
        end = self.ends[handler] = asyncio.get_running_loop().create_future()
        hand_over(tls, pending, handler)
        await end

    async def _request(self, request: web.BaseRequest) -> web.StreamResponse:
        assert request.transport is not None
        host: VirtualHost = request.transport.get_extra_info("ssl_object").virtual_host
        authority = request.headers.get("Host", "")
        if misdirected(host, authority):
            return web.Response(status=421, text=misdirected_text(host, authority))
        client = request.remote or ""
        headers = request_headers(request.headers.items(), client=client, authority=authority,
                                  identity=self.whois(client), trailers=self.upstream.trailers)
        body = request.content.iter_chunked(CHUNK) if request.body_exists else None
        try:
            async with self.upstream.request(request.method, authority, request.rel_url.raw_path_qs, headers,
                                             body, list) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason or None)
                for key, value in response_headers(upstream.headers):
                    response.headers.add(key, value)
                await response.prepare(request)
                try:
                    async for chunk in upstream.body():
                        await response.write(chunk)
                except BackendError as exc:
                    log.warning("backend failed during the response", expose=self.upstream.expose.name,
                                error=str(exc))
                    request.transport.abort()  # the client must not take a cut body for a whole one
                    return response
                await response.write_eof()  # HTTP/1.1 clients get no trailers (aiohttp writes none)
                return response
        except BadGateway as exc:
            return web.Response(status=502, text=f"{exc}\n")
