"""HTTP backends on 127.0.0.1 for the agent tests: an aiohttp application served until the block ends."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

from aiohttp import web

from hack.localenv import free_port


@contextlib.asynccontextmanager
async def served(app: web.Application, port: int | None = None, *,
                 tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serve ``app`` on 127.0.0.1 (``port``, or a free one; over TLS with ``tls``) and yield the
    port; stopped at the end with half a second for the requests in progress."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    try:
        yield port
    finally:
        await runner.cleanup()
