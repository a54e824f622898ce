"""A small fault-injecting HTTP proxy on 127.0.0.1 in front of a real Headscale (HTTPS).

Requests are forwarded as they are; a test queues faults for the next requests that match a
method and path prefix. A fault either answers for Headscale (``status``: Headscale never sees
the request) or spoils Headscale's own answer (``cut``: the body truncated, ``delay``: the answer
held back longer than the client waits, ``lost``: the connection closed once Headscale has
answered, so the client never reads what was done, ``rewrite``: the request body replaced before
it is forwarded, as a server that stores something else than it was sent).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from hack.localenv import free_port


@dataclass
class Fault:
    method: str
    path: str
    """A path prefix, without the query."""
    status: int = 0
    """Answer with this status and ``body`` instead of forwarding."""
    body: bytes = b"Internal Server Error"
    cut: bool = False
    """Forward, then answer with the first half of Headscale's body (status 200 kept)."""
    delay: float = 0.0
    """Forward, then hold the answer this many seconds."""
    rewrite: Callable[[bytes], bytes] | None = None
    """Forward the request body this function returns instead of the one sent."""
    lost: bool = False
    """Forward, then close the connection instead of answering (an answer lost on the way back)."""


@dataclass
class FaultProxy:
    upstream: str
    ca_bundle: Path
    faults: list[Fault] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    """``METHOD path`` of every request received, in order."""
    injected: list[str] = field(default_factory=list)
    """``METHOD path fault`` of every fault used."""
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def _take(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.method == method and path.startswith(fault.path):
                self.faults.remove(fault)
                return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(f"{request.method} {request.path}")
        fault = self._take(request.method, request.path)
        body = await request.read()
        if fault is not None:
            what = (f"status {fault.status}" if fault.status else "cut" if fault.cut
                    else f"delay {fault.delay:g}s" if fault.delay else "lost" if fault.lost else "rewrite")
            self.injected.append(f"{request.method} {request.path} {what}")
            if fault.status:
                return web.Response(status=fault.status, body=fault.body, content_type="text/plain")
            if fault.rewrite is not None:
                body = fault.rewrite(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "accept")}
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body or None) as upstream:
            answer = await upstream.read()
            status = upstream.status
            content_type = upstream.headers.get("Content-Type", "application/json")
        if fault is not None and fault.lost:
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("the answer is lost on purpose")
        if fault is not None and fault.delay:
            await asyncio.sleep(fault.delay)
        if fault is not None and fault.cut:
            answer = answer[: len(answer) // 2]
        return web.Response(status=status, body=answer, headers={"Content-Type": content_type})

    async def __aenter__(self) -> FaultProxy:
        self._session: aiohttp.ClientSession | None = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(self.ca_bundle))))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


def replace_policy(text: str) -> Callable[[bytes], bytes]:
    """A ``rewrite`` that stores ``text`` whatever policy was sent."""
    def rewrite(body: bytes) -> bytes:
        doc = json.loads(body)
        doc["policy"] = text
        return json.dumps(doc).encode()
    return rewrite
