"""SNI port sharing: the http exposes on one tailnet port share its listener.

Each accepted connection is held paused (:class:`~.handover.Held`) until :meth:`HttpPort.serve`
runs ``loop.start_tls``: the SNI callback finds the host named in SNI among the hosts of every http
expose on that port and switches to its certificate (an unknown name is refused with
``unrecognized_name``; no SNI means the first host of the first of those exposes in the file). The
host so chosen binds the connection to its expose (:class:`~.service.HttpService`).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from tailnet_agent.contract.exposes import VirtualHost
from tailnet_agent.limits import ConnectionGate, Refused, hold_peer

from ..egress import Closable
from .certs import server_context
from .handover import Held, Pending
from .service import HttpService

log = structlog.get_logger("agent.http")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client has to finish its TLS handshake."""

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

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None, *,
                 gate: ConnectionGate | None = None) -> None:
        self.port = port
        self.gate = gate
        """Counts the port's connections against the agent's limit (None: not counted)."""
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
        """The listener's protocol factory: hold the connection, serve it in a task of the port (a
        connection over the agent's limit is closed at once)."""
        gate = self.gate
        if gate is not None and not gate.admit():
            return Refused()
        held = Held()
        task = asyncio.get_running_loop().create_task(self.serve(held), name=f"https-{self.port}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if gate is not None:
            task.add_done_callback(lambda _: gate.release())
        return held

    async def serve(self, held: Held) -> None:
        """One connection: handshake, then HTTP/2 or HTTP/1.1 until it ends; a failure ends it alone."""
        try:
            transport = await held.made
        except ConnectionError:
            return
        with hold_peer(self.gate, transport) as admitted:  # over its peer's limit: closed, not served
            if admitted:
                await self._serve_admitted(transport)

    async def _serve_admitted(self, transport: asyncio.Transport) -> None:
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
            pending = Pending()
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
        self._tasks.discard(asyncio.current_task())  # the expose's connection now, not the port's
        await chosen.serve_connection(tls, pending, sslobj.virtual_host, client)


class _Lease:
    """One expose's hold on the shared listener; closing it twice releases once."""

    def __init__(self, port: HttpPort) -> None:
        self._port: HttpPort | None = port

    def close(self) -> None:
        port, self._port = self._port, None
        if port is not None:
            port.release()
