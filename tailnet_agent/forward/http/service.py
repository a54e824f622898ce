"""One http expose while it listens: its certificates, its backend client, its connections.

A connection arrives here once SNI chose one of the expose's hosts (:mod:`.sni`); it is served by
HTTP/2 (ALPN ``h2``) or HTTP/1.1 and stays a task of the expose, so that stopping the expose ends
its connections and only its.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tailnet_agent.contract.exposes import Expose, VirtualHost
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import Limits

from .certs import CertificateStore
from .handover import Pending
from .http1 import Http1Server
from .http2 import Http2Server
from .identity import Whois
from .upstream import Upstreams


class HttpService:
    """One http expose while it listens: certificates, the backend client, the requests."""

    def __init__(self, expose: Expose, whois: Whois | None = None, *, limits: Limits | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        self.expose = expose
        self.whois = whois or (lambda ip: None)
        self.certs = CertificateStore(() if expose.plaintext else expose.hosts)
        self.upstreams = Upstreams(expose)
        limits = limits or Limits()
        self.http1 = Http1Server(self.upstreams, self.whois, limits=limits, metrics=metrics)
        self.http2 = Http2Server(self.upstreams, limits, metrics, whois=self.whois)
        self.connections: set[asyncio.Task[Any]] = set()
        """The tasks serving this expose's client connections (cancelled when it stops)."""

    async def __aenter__(self) -> HttpService:
        self.upstreams.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tasks = [t for t in self.connections if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self.upstreams.close()

    async def drain(self) -> None:
        """Finish the requests in progress and end the connections (listener closed by then):
        HTTP/1.1 connections close after their current request, HTTP/2 ones refuse new streams
        (REFUSED_STREAM, safe to retry elsewhere) and send GOAWAY once their streams are done."""
        self.http2.drain()
        await self.http1.shutdown(None)
        if tasks := [t for t in self.connections if t is not asyncio.current_task()]:
            await asyncio.wait(tasks)

    async def serve_connection(self, tls: asyncio.Transport, pending: Pending, host: VirtualHost,
                               client: str) -> None:
        """A TLS connection whose SNI chose one of this expose's hosts, until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            identity = self.whois(client)
            if tls.get_extra_info("ssl_object").selected_alpn_protocol() == "h2":
                await self.http2.serve(tls, pending, host, client, identity)
            else:
                await self.http1.serve(tls, pending)
        finally:
            self.connections.discard(task)
