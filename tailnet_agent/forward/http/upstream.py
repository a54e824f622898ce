"""The backend side of an http expose: one client, HTTP/1.1 or HTTP/2, and its answer's shape.

Requests go to the backend over HTTP/1.1 with an aiohttp client (``protocol: http1``) or over
HTTP/2 (``protocol: h2``: h2c with prior knowledge for ``scheme: http``, h2 over TLS for
``https``; :mod:`tailnet_agent.forward.h2backend`); HTTPS to the app is verified against the
expose's CA file (or the system roots) for its server name, always. Either way the answer is an
:class:`Upstream`, so the client side (:mod:`.http1`, :mod:`.http2`) need not know which protocol
brought it. A backend that cannot be asked is :class:`BadGateway` (502); one that fails after its
head arrived raises :class:`~tailnet_agent.forward.h2backend.BackendError` from the body.

An expose has one client per backend (:class:`Upstreams`): its own, and each distinct backend of
its hosts' routes (every weighted one); :meth:`Upstreams.decide` says where a request goes (:mod:`.routes`).
"""

from __future__ import annotations

import contextlib
import random
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

import aiohttp
import structlog

from tailnet_agent.contract.exposes import H2, Backend, Expose, VirtualHost

from ..h2backend import BackendError, H2Backend
from .headers import Headers
from .routes import Forward, Reply, decide

log = structlog.get_logger("agent.http")

CHUNK = 64 << 10
"""Bytes read at a time, from a client or a backend."""


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


class BadGateway(Exception):
    """The backend could not be asked (refused, unreachable, TLS verification failed)."""


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


class UpstreamClient:
    """The client of one backend of an expose (named ``expose`` in logs), open between :meth:`open`
    and :meth:`close`."""

    def __init__(self, backend: Backend, *, expose: str) -> None:
        self.backend = backend
        self.expose = expose
        self.base = f"{backend.scheme}://{backend.host}:{backend.port}"
        self.tls: ssl.SSLContext | None = None
        if backend.scheme == "https":
            self.tls = ssl.create_default_context(cafile=backend.ca_file)  # verified, always
            if backend.protocol == H2:
                self.tls.set_alpn_protocols(["h2"])
        self.client: aiohttp.ClientSession | None = None
        self.h2: H2Backend | None = None

    @property
    def trailers(self) -> bool:
        """The backend speaks HTTP/2, so ``TE: trailers`` and request trailers reach it."""
        return self.h2 is not None

    def open(self) -> None:
        """Create the client of the backend's protocol (it connects on the first request)."""
        backend = self.backend
        if backend.protocol == H2:
            self.h2 = H2Backend(backend.host, backend.port, tls=self.tls,
                                server_name=backend.server_name or backend.host)
        else:
            self.client = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10), connector=aiohttp.TCPConnector(ssl=self.tls or True))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.h2 is not None:
            await self.h2.close()

    @contextlib.asynccontextmanager
    async def request(self, method: str, authority: str, path: str, headers: Headers,
                      body: AsyncIterator[bytes] | None, trailers: Callable[[], Headers],
                      ) -> AsyncIterator[Upstream]:
        """The backend's response once its head arrived; BadGateway when there is none."""
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
        backend = self.backend
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
        backend = self.backend
        message = f"backend {backend.host}:{backend.port} failed: {error}"
        log.warning("bad gateway", expose=self.expose, error=message)
        return BadGateway(message)


class Upstreams:
    """The clients of every backend of one expose, open between :meth:`open` and :meth:`close`."""

    def __init__(self, expose: Expose, *, rng: random.Random | None = None) -> None:
        self.expose = expose
        self.name = expose.name
        self.rng = rng
        backends = [expose.backend, *(w.backend for h in expose.hosts for r in h.routes for w in r.weighted)]
        self.clients = {b: UpstreamClient(b, expose=expose.name) for b in dict.fromkeys(backends)}

    @property
    def default(self) -> UpstreamClient:
        """The expose's own backend's client."""
        return self.clients[self.expose.backend]

    def decide(self, host: VirtualHost, *, method: str, target: str, authority: str,
               headers: Iterable[tuple[str, str]]) -> Forward | Reply:
        """What becomes of a request to ``host`` (:func:`.routes.decide`); a :class:`Forward`'s
        backend has its client in :attr:`clients`."""
        return decide(host, self.expose.backend, method=method, target=target, authority=authority,
                      headers=headers, port=self.expose.port, scheme=self.scheme, rng=self.rng)

    @property
    def scheme(self) -> str:
        """What clients speak to the expose: ``http`` (plaintext) or ``https``."""
        return "http" if self.expose.plaintext else "https"

    def open(self) -> None:
        for client in self.clients.values():
            client.open()

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
