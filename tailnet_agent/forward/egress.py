"""A listener per port of each entry, each connection dialled and spliced: egress (local listeners,
tailnet dials) and, with another ``listen`` and dialer, ingress (:mod:`tailnet_agent.forward.ingress`).

Egress: a local TCP listener per target port, each connection dialled over the tailnet and spliced.

The operator points one Service per target at these listeners. A connection is accepted (and not
read from yet), the node waits (at most ``dial_timeout`` seconds) until it is ready, dials
``address:port`` over the tailnet, and then copies both ways with half-close
(:class:`~tailnet_agent.forward.splice.Splice`, protocol to protocol). A failed dial resets the local
connection (the client sees ECONNRESET, as with a plain proxy) and is counted by reason. Every
connection runs as a task of its target's TaskGroup, inside the forwarder's. When an egress client
half-closes while the reply still flows, a second, idle connection to the target (the pin) is
opened before its EOF goes on and closed once the connection ends (:meth:`Forwarder._pin`).

Targets change while the agent runs (:meth:`EgressForwarder.apply`, fed by
:class:`~tailnet_agent.targets.TargetsWatcher`): new targets get listeners, removed ones lose
theirs and their connections, a changed one (address or ports) is replaced, and the listeners
and connections of every other target stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, Protocol, TypeVar

import structlog

from tailnet_agent.config import Forwarded
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Refused, hold_peer
from tailnet_agent.probe import Prober
from tailnet_agent.streams import error_reason
from tailnet_agent.targets import TargetsDiff, diff_targets

from .splice import Splice

log = structlog.get_logger("agent.egress")


class Dialer(Protocol):
    """What egress needs from the node (:class:`tailnet_agent.node.Node` is the real one)."""

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                                timeout: float | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]: ...

    async def wait_ready(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


Listen = Callable[[Callable[[], asyncio.Protocol], int], Awaitable[Closable]]
"""Opens a listener on a port that makes each connection's protocol with the factory."""
Connection = tuple[asyncio.Protocol, Coroutine[Any, Any, None], Callable[[], None]]
"""An accepted connection: its protocol, the coroutine that serves it (a task of the entry's
TaskGroup, first run after ``connection_made``), and how to abort it if it cannot be served."""
Accept = Callable[[PortMapping], Connection]
Session = Callable[[Any], AbstractAsyncContextManager[Accept | None]]
"""Entered while an entry listens; gives how its connections are served (None: spliced to a dial)."""

F = TypeVar("F", bound=Forwarded)


class ListenError(OSError):
    """A target's listener could not be bound (e.g. its port is taken)."""


class _Running(Generic[F]):
    """One target's task (its listeners, connections and probe) and whether it bound."""

    def __init__(self, target: F) -> None:
        self.target = target
        self.bound: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None


async def listen_locally(bind_address: str, factory: Callable[[], asyncio.Protocol], port: int) -> Closable:
    """A TCP listener on ``bind_address:port``, its error naming the address."""
    try:
        return await asyncio.get_running_loop().create_server(factory, bind_address, port, reuse_address=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {bind_address}:{port}: {exc.strerror or exc}") from None


class Forwarder(Generic[F]):
    """Runs the listeners of ``targets``; ``run`` blocks until cancelled; :meth:`apply` changes the targets.

    Each target runs as one task of the forwarder's TaskGroup, with a TaskGroup of its own holding
    its connections (and its reachability probe when a ``prober`` is given). Removing a target
    cancels that task: its listeners close and its connections end; other targets are not touched.

    ``listen`` opens a listener (default: a local TCP listener on ``bind_address``); ``node`` dials
    the far end; ``session`` (optional) may serve a target's connections itself (ingress http).
    """

    def __init__(self, node: Dialer, targets: tuple[F, ...], *, bind_address: str = "0.0.0.0",
                 dial_timeout: float = 30.0, metrics: AgentMetrics | None = None,
                 prober: Prober | None = None, listen: Listen | None = None, session: Session | None = None,
                 kind: str = "egress", pin_half_closed: bool | None = None,
                 gate: ConnectionGate | None = None) -> None:
        self.node = node
        self.gate = gate
        """Counts the client connections against the agent's limit (None: not counted)."""
        self.targets = targets
        """The targets in force (in the order of the file)."""
        self.bind_address = bind_address
        self.dial_timeout = dial_timeout
        """Seconds for readiness plus the dial. Default 30."""
        self.metrics = metrics or AgentMetrics()
        self.prober = prober
        self.listen: Listen = listen or functools.partial(listen_locally, bind_address)
        self.session = session
        self.kind = kind
        """``egress`` or ``ingress``: the log lines' and task names' prefix."""
        self.pin_half_closed = kind == "egress" if pin_half_closed is None else pin_half_closed
        """Hold a second, idle connection to the target while a half-closed one drains (egress
        default; see :meth:`_pin`)."""
        self.listening = asyncio.Event()
        """Set once every listener of the first targets is bound."""
        self.listen_errors: dict[str, str] = {}
        """Targets whose listeners could not be bound, with why."""
        self._running: dict[str, _Running[F]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._lock = asyncio.Lock()
        self.draining = asyncio.Event()
        """Set by :meth:`drain`: the listeners are closed and no target starts any more."""
        self._last_sought = float("-inf")

    def quiet_for(self) -> float:
        """Seconds since a client last connected (refused by a limit or not); infinite before any."""
        return asyncio.get_running_loop().time() - self._last_sought

    async def drain(self) -> None:
        """Stop accepting (every listener closes at once) and wait until the open connections ended.

        ``run`` keeps running (cancel it to end what is left); a bound on the wait is the caller's."""
        self.draining.set()
        async with self._lock:  # no apply() half done
            tasks = [r.task for r in self._running.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks)

    async def run(self) -> None:
        """Bind every target (a listener that cannot bind ends the run: a startup error), then serve."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            try:
                for target in self.targets:
                    await self._start(target, strict=True)
                self.listening.set()
                await asyncio.get_running_loop().create_future()  # until cancelled
            finally:
                self._tg = None
                for running in self._running.values():
                    if running.task is not None:
                        running.task.cancel()
                self._running.clear()

    def is_listening(self, name: str) -> bool:
        """Every listener of the target ``name`` is bound."""
        running = self._running.get(name)
        return running is not None and running.bound.done() and not running.bound.cancelled() \
            and running.bound.exception() is None

    async def apply(self, targets: tuple[F, ...]) -> TargetsDiff[F]:
        """Move to ``targets``: stop removed and changed ones first (freeing their ports), then start
        changed and added ones. A listener that cannot bind is logged and kept in :attr:`listen_errors`."""
        async with self._lock:
            if self.draining.is_set():
                return diff_targets(self.targets, self.targets)  # shutting down: nothing changes
            diff = diff_targets(self.targets, targets)
            for target in (*diff.removed, *diff.changed):
                await self._stop(target.name)
            self.targets = targets
            for target in (*diff.changed, *diff.added):
                await self._start(target, strict=False)
            if not diff.empty:
                log.info(f"{self.kind} entries changed", added=[t.name for t in diff.added],
                         changed=[t.name for t in diff.changed], removed=[t.name for t in diff.removed])
            return diff

    async def _start(self, target: F, *, strict: bool) -> None:
        if self._tg is None:
            raise RuntimeError(f"the {self.kind} forwarder is not running")
        running = _Running(target)
        self._running[target.name] = running
        self.listen_errors.pop(target.name, None)
        running.task = self._tg.create_task(self._serve(running), name=f"{self.kind}-{target.name}")
        try:
            await asyncio.shield(running.bound)
        except ListenError as exc:
            if strict:
                raise
            self.listen_errors[target.name] = str(exc)
            log.error(f"{self.kind} entry not listening", target=target.name, error=str(exc))

    async def _stop(self, name: str) -> None:
        running = self._running.pop(name, None)
        self.listen_errors.pop(name, None)
        if running is None or running.task is None:
            return
        running.task.cancel()
        await asyncio.wait([running.task])  # its ports are free after this; our own cancel still propagates
        log.info(f"{self.kind} entry stopped", target=name)

    async def _serve(self, running: _Running[F]) -> None:
        """One target: bind its listeners, probe it, accept until cancelled."""
        target = running.target
        async with contextlib.AsyncExitStack() as stack:
            accept = await stack.enter_async_context(self.session(target)) if self.session else None
            await self._serve_in_session(running, accept)

    async def _serve_in_session(self, running: _Running[F], accept: Accept | None) -> None:
        target = running.target
        servers: list[Closable] = []
        async with asyncio.TaskGroup() as tg:
            try:
                for mapping in target.ports:
                    try:
                        server = await self.listen(self._factory(tg, target, mapping, accept), mapping.listen)
                    except OSError as exc:
                        running.bound.set_exception(ListenError(exc.errno, f"{target.name}: {exc.strerror or exc}"))
                        return
                    servers.append(server)
                    log.info(f"{self.kind} listening", target=target.name, listen=mapping.listen,
                             to=f"{target.address}:{mapping.port}")
                running.bound.set_result(None)
                probe = None
                if self.prober is not None:
                    probe = tg.create_task(self.prober.run(target), name=f"probe-{target.name}")
                await self.draining.wait()  # or cancelled; connections are tasks of tg
                if probe is not None:
                    probe.cancel()
            finally:
                for server in servers:
                    server.close()  # no new connections; tg waits for (drain) or cancels the open ones
                if not running.bound.done():
                    running.bound.cancel()

    def splice(self, target: F) -> Splice:
        """A splice for a connection of ``target`` (``a`` the client), its bytes counted as the target's."""
        bytes_of = self.metrics.bytes
        return Splice(count_a_to_b=bytes_of.labels(target.name, "sent").inc,
                      count_b_to_a=bytes_of.labels(target.name, "received").inc)

    def _factory(self, tg: asyncio.TaskGroup, target: F, mapping: PortMapping, serve: Accept | None,
                 ) -> Callable[[], asyncio.Protocol]:
        def splice_to_dial(mapping: PortMapping) -> Connection:
            splice = self.splice(target)
            return splice.a, _peer_held(self.gate, splice, lambda: self.forward(target, mapping, splice)), splice.abort

        def accept() -> asyncio.Protocol:
            self._last_sought = asyncio.get_running_loop().time()
            gate = self.gate
            if gate is not None and not gate.admit():
                return Refused()
            # The task first runs after connection_made has given the protocol its transport.
            protocol, coro, abort = (serve or splice_to_dial)(mapping)
            try:
                task = tg.create_task(coro, name=f"{self.kind}-{target.name}-{mapping.port}")
            except RuntimeError:  # the target is being removed: refuse the connection
                coro.close()
                asyncio.get_running_loop().call_soon(abort)
                if gate is not None:
                    gate.release()
            else:
                if gate is not None:
                    task.add_done_callback(lambda _: gate.release())
            return protocol

        return accept

    async def forward(self, target: F, mapping: PortMapping, splice: Splice) -> None:
        """Dial ``target`` for the attached client ``splice.a`` (what it holds goes first), splice until both end."""
        m = self.metrics
        m.connections.labels(target.name).inc()
        active = m.active.labels(target.name)
        active.inc()
        client = splice.a.transport.get_extra_info("peername") if splice.a.transport else None
        pins = _Pins()
        try:
            try:
                async with asyncio.timeout(self.dial_timeout):
                    await self.node.wait_ready()
                    await self.node.create_connection(lambda: splice.b, target.address, mapping.port,
                                                      timeout=self.dial_timeout)
            except (OSError, TimeoutError) as exc:
                reason = error_reason(exc)
                message = str(exc) or f"tailnet node not ready within {self.dial_timeout:g}s"
                m.dial_errors.labels(target.name, reason).inc()
                log.warning(f"{self.kind} dial failed", target=target.name, to=f"{target.address}:{mapping.port}",
                            client=client, reason=reason, error=message)
                splice.abort()
                return
            if self.pin_half_closed:
                splice.eof_gate = lambda: self._pin(target, mapping, pins)
            splice.join()
            try:
                await splice.done
            except OSError as exc:
                log.info(f"{self.kind} connection ended with an error", target=target.name, client=client,
                         error=str(exc) or repr(exc))
        except Exception:
            log.exception(f"{self.kind} connection failed", target=target.name, client=client)
            splice.abort()
        except BaseException:
            splice.abort()
            raise
        finally:
            active.dec()
            pins.close()
            if splice.done.done() and not splice.done.cancelled():
                splice.done.exception()  # retrieved: an early failure is not "never retrieved"

    async def _pin(self, target: F, mapping: PortMapping, pins: _Pins) -> None:
        """Dial a second connection to the target and keep it (in ``pins``) until the first ends.

        Called when the client half-closes, before its EOF goes over the tailnet. A tailscaled
        subnet router in userspace networking (1.98) removes the LAN address from its netstack
        as soon as its last forwarder for that address returns, which happens once both
        directions reached EOF even while the reply's tail is still queued in its TCP endpoint
        (the agent's window was closed): every later segment of that endpoint then fails to
        send and the reply is cut. The router counts forwarders per address, so an idle second
        connection to the same address keeps it until the first connection has drained.
        A failed dial only costs the protection: the EOF goes on either way."""
        try:
            async with asyncio.timeout(min(self.dial_timeout, PIN_DIAL_TIMEOUT)):
                transport, _ = await self.node.create_connection(asyncio.Protocol, target.address, mapping.port,
                                                                 timeout=min(self.dial_timeout, PIN_DIAL_TIMEOUT))
        except (OSError, TimeoutError) as exc:
            log.debug(f"{self.kind} half-close pin not opened", target=target.name, error=str(exc) or repr(exc))
            return
        pins.add(transport)


async def _peer_held(gate: ConnectionGate | None, splice: Splice, forward: Callable[[], Awaitable[None]]) -> None:
    """Serve an accepted connection while it counts against its peer's limit; over the limit it is
    closed before anything is dialled."""
    with hold_peer(gate, await splice.a.made) as admitted:
        if admitted:
            await forward()


class _Pins:
    """A connection's half-close pins: closed with it (one dialled after it ended is closed at once)."""

    def __init__(self) -> None:
        self._transports: list[asyncio.Transport] = []
        self._closed = False

    def add(self, transport: asyncio.Transport) -> None:
        if self._closed:
            transport.close()
        else:
            self._transports.append(transport)

    def close(self) -> None:
        self._closed = True
        for transport in self._transports:
            transport.close()
        self._transports.clear()


PIN_DIAL_TIMEOUT = 5.0
"""Seconds the half-close pin may take to connect before the EOF is passed on without it."""

EgressForwarder = Forwarder[Target]
