"""The tls expose: TLS passed through untouched, to the backend of the host the ClientHello names.

The tls exposes on one tailnet port share its listener (:class:`PassthroughPort`, a
:class:`~.http.ports.SharedPort`). The agent never terminates their TLS: it reads each accepted
connection until the client's ClientHello is whole (:func:`~.clienthello.read_client_hello`, at
most :data:`~.clienthello.READ_LIMIT` bytes, within :data:`~.http.sni.HANDSHAKE_TIMEOUT` seconds),
and its SNI name picks the closest host among the hosts of every tls expose on the port (an exact
name or alias, then the longest ``*.`` name, then ``*``: :func:`~tailnet_agent.contract.exposes.closest`,
the http mode's rule) and with it the expose (:class:`PassthroughService`). The bytes read so far go
to that expose's backend first; from then on the connection is a tcp expose's
(:meth:`Forwarder.forward <tailnet_agent.forward.egress.Forwarder.forward>`: the dial, half-close,
the byte and dial-error counts), and it ends when its expose stops.

Refused before any backend is dialled, each counted in
``tailnet_agent_passthrough_refused_total{reason}`` and logged with the client's address:

* ``no_server_name``: a ClientHello without SNI goes to the port's ``*`` host (any name, so no name
  too); with none, a fatal ``missing_extension`` alert is written and the connection closed;
* ``unknown_name``: a name no host of the port answers to gets a fatal ``unrecognized_name`` alert
  (RFC 6066 §3), then the connection closes. An alert before the ServerHello is a plaintext record,
  the one a terminating server sends, so the client reads why instead of a bare close;
* ``invalid``: what is not a ClientHello (:mod:`.clienthello`'s rules and limits) is closed
  without a word: it may not be TLS at all;
* ``timeout`` and ``closed``: no whole ClientHello within the timeout, or the client closed first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from tailnet_agent.contract.exposes import Expose, closest
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, peer_address

from .clienthello import READ_LIMIT, ClientHello, ClientHelloError, read_client_hello
from .egress import Forwarder
from .http.ports import SharedPort
from .http.sni import HANDSHAKE_TIMEOUT

log = structlog.get_logger("agent.tls")

ALERT = 21
"""The record content type of alerts."""
FATAL = 2
UNRECOGNIZED_NAME = 112
MISSING_EXTENSION = 109


def alert_record(description: int) -> bytes:
    """A fatal alert as a plaintext TLS 1.2-versioned record (what precedes the ServerHello)."""
    return bytes([ALERT, 3, 3, 0, 2, FATAL, description])


class PassthroughService:
    """One tls expose while it listens: its backend (through the forwarder) and its connections,
    which end when it stops (its siblings' on the port stay)."""

    def __init__(self, expose: Expose, forwarder: Forwarder[Expose]) -> None:
        self.expose = expose
        self.forwarder = forwarder
        self.connections: set[asyncio.Task[Any]] = set()
        """The tasks of this expose's client connections (cancelled when it stops)."""

    async def __aenter__(self) -> PassthroughService:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if tasks := [t for t in self.connections if t is not asyncio.current_task()]:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    async def drain(self) -> None:
        """Wait until the open connections end (the listener is closed by then), as a tcp expose does."""
        if tasks := [t for t in self.connections if t is not asyncio.current_task()]:
            await asyncio.wait(tasks)

    async def serve_connection(self, transport: asyncio.Transport, hello: bytes, *, eof: bool) -> None:
        """Send ``hello`` (what the client sent so far; ``eof``: and then its EOF) to the backend
        and splice the two until both end."""
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            splice = self.forwarder.splice(self.expose)
            transport.set_protocol(splice.a)
            splice.a.connection_made(transport)  # paused until the dial is joined
            splice.a.early.append(hello)
            splice.a.eof = eof
            await self.forwarder.forward(self.expose, self.expose.ports[0], splice)
        finally:
            self.connections.discard(task)


class _HelloReader(asyncio.Protocol):
    """Keeps what the client sends until its ClientHello is whole (then pauses the transport)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.data = bytearray()
        self.eof = False
        self.lost = False
        self.hello: asyncio.Future[ClientHello] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.hello.done():
            return  # came with the chunk that completed it: passed on with the rest
        try:
            hello = read_client_hello(self.data)
            if hello is None and len(self.data) >= READ_LIMIT:
                raise ClientHelloError(f"no whole ClientHello in {READ_LIMIT} bytes")
        except ClientHelloError as exc:
            self.transport.pause_reading()
            self.hello.set_exception(exc)
            return
        if hello is not None:
            self.transport.pause_reading()
            self.hello.set_result(hello)

    def eof_received(self) -> bool:
        self.eof = True
        if not self.hello.done():
            self.hello.set_exception(ConnectionResetError("the client closed before its ClientHello was whole"))
        return True  # a whole hello's EOF is passed on to the backend with it

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.hello.done():
            self.hello.set_exception(ConnectionResetError("the connection was lost before its ClientHello"))


class PassthroughPort(SharedPort[PassthroughService]):
    """The tailnet listener of one port shared by tls exposes (:class:`SharedPort`): the
    ClientHello's SNI picks the expose. A connection being read is a task of the port; once it
    belongs to an expose it is one of that expose's connections."""

    kind = "tls"

    def __init__(self, port: int, order: Callable[[], Iterable[str]] | None = None, *,
                 gate: ConnectionGate | None = None, metrics: AgentMetrics | None = None,
                 timeout: float = HANDSHAKE_TIMEOUT) -> None:
        super().__init__(port, order, gate=gate)
        self.metrics = metrics
        self.timeout = timeout
        """Seconds a client has to send its whole ClientHello. Default :data:`HANDSHAKE_TIMEOUT` (10)."""

    def route(self, server_name: str | None) -> PassthroughService | None:
        """The expose whose host answers ``server_name`` most closely; without a name, the one
        with a ``*`` host (None when no host answers)."""
        found = closest(((service, host) for service in self.ordered() for host in service.expose.hosts),
                        server_name or "")
        return found[0] if found is not None else None

    async def _serve(self, transport: asyncio.Transport) -> None:
        client = peer_address(transport)
        reader = _HelloReader(transport)
        transport.set_protocol(reader)
        transport.resume_reading()
        try:
            async with asyncio.timeout(self.timeout):
                hello = await reader.hello
        except ClientHelloError as exc:
            return self._refused("invalid", client, str(exc))
        except TimeoutError:
            return self._refused("timeout", client, f"no whole ClientHello within {self.timeout:g}s")
        except ConnectionError as exc:
            return self._refused("closed", client, str(exc))
        finally:
            if not reader.hello.done():
                reader.hello.cancel()
        if reader.lost:
            return self._refused("closed", client, "the connection was lost before it was routed")
        service = self.route(hello.server_name)
        if service is None:
            reason, alert, why = ("unknown_name", UNRECOGNIZED_NAME, "no host of the port answers to it") \
                if hello.server_name else ("no_server_name", MISSING_EXTENSION, "no SNI, and no host of the port is *")
            transport.write(alert_record(alert))
            transport.close()
            return self._refused(reason, client, why, hello.server_name)
        self._tasks.discard(asyncio.current_task())  # the expose's connection now, not the port's
        await service.serve_connection(transport, bytes(reader.data), eof=reader.eof)

    def _refused(self, reason: str, client: str, why: str, server_name: str | None = None) -> None:
        if self.metrics is not None:
            self.metrics.passthrough_refused.labels(reason).inc()
        log.info("tls connection refused", port=self.port, client=client, reason=reason, error=why,
                 server_name=server_name)
