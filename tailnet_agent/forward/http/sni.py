"""SNI port sharing: the TLS http exposes on one tailnet port share its listener (:mod:`.ports`).

Each accepted connection is held paused (:class:`~.handover.Held`) until :meth:`HttpPort._serve`
runs ``loop.start_tls``: the SNI callback finds the host named in SNI among the hosts of every http
expose on that port, the closest (an exact name, then a ``*.`` name, then ``*``), and switches to
its certificate (a name no host answers to is refused with
``unrecognized_name``; no SNI means the first host of the first of those exposes in the file). The
host so chosen binds the connection to its expose (:class:`~.service.HttpService`).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable

import structlog

from tailnet_agent.contract.exposes import VirtualHost, closest
from tailnet_agent.limits import ConnectionGate

from .certs import server_context
from .handover import Pending
from .ports import SharedPort
from .service import HttpService

log = structlog.get_logger("agent.http")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client has to finish its TLS handshake."""


class HttpPort(SharedPort[HttpService]):
    """The tailnet listener of one port, shared by the http exposes on it: SNI picks the host and
    with it the expose whose :class:`HttpService` serves the connection (:class:`~.ports.SharedPort`:
    the listener's leases). A connection being handshaken is a task of the port; once it belongs
    to an expose it is one of that service's connections and ends when that expose stops (its
    siblings' connections stay).
    """

    kind = "https"

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None, *,
                 gate: ConnectionGate | None = None) -> None:
        super().__init__(port, order, gate=gate)
        self.context = server_context()
        self.context.sni_callback = self.sni

    def route(self, server_name: str | None) -> tuple[HttpService, VirtualHost] | None:
        services = self.ordered()
        if not server_name:
            return (services[0], services[0].expose.hosts[0]) if services else None
        name = server_name.lower().rstrip(".")
        return closest(((service, h) for service in services for h in service.expose.hosts), name)

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


