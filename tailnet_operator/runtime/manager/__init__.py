"""The manager: owns the client, the shared cache, the controllers and the metrics registry.

``run()`` starts, in this order, under one TaskGroup:

1. the probe server (``/healthz``, ``/readyz``) and the metrics server (``/metrics``);
2. the shared cache, and waits for it to sync (``/readyz`` passes from then on, on a standby
   as on the leader; a leader fails it while its Lease is not renewed in time);
3. leader election, when enabled, and waits to lead;
4. every controller.

It returns when ``stop()`` is called (or SIGTERM/SIGINT arrive, with ``handle_signals``):
controllers take no new work and the reconciles in progress get
``graceful_shutdown_timeout`` seconds to finish, then everything is cancelled and the Lease
is released. Losing the Lease is different: reconciling stops at once and ``run()`` raises
:class:`LeadershipLost`, so the process exits and restarts as a follower, as with
controller-runtime.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..cache import DEFAULT_SYNC_TIMEOUT, SharedCache
from ..client import DEFAULT_FIELD_MANAGER, Client
from ..client.apply import Applier
from ..client.config import RestConfig
from ..clock import Clock, RealClock
from ..controller import Controller, ControllerOptions, Reconciler
from ..leaderelection import LeaderElectionConfig, LeaderElectionMetrics, LeaderElector
from ..metrics import ControllerMetrics, RestClientMetrics
from ..scheme import Scheme

log = structlog.get_logger("manager")

HealthCheck = Callable[[], Awaitable[None] | None]
"""Raises (or returns an awaitable that raises) when unhealthy."""


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed; the process must stop reconciling and exit."""


@dataclass
class ManagerOptions:
    """Settings of the manager; every default is controller-runtime's unless noted."""

    field_manager: str = DEFAULT_FIELD_MANAGER
    """The server-side apply field manager (and user agent) of every write without its own."""
    metrics_bind_address: str = "0"
    """host:port of ``/metrics``; "0" disables (the command line turns it on at :8080)."""
    health_probe_bind_address: str = "0"
    """host:port of ``/healthz`` and ``/readyz``; "0" disables."""
    leader_election: bool = False
    """Elect a leader on a coordination.k8s.io Lease before running controllers."""
    leader_election_id: str = ""
    """Name of the Lease (required with ``leader_election``)."""
    leader_election_namespace: str = ""
    """Namespace of the Lease (required with ``leader_election``)."""
    leader_election_config: LeaderElectionConfig = field(default_factory=LeaderElectionConfig)
    """Lease duration 15 s, renew deadline 10 s, retry period 2 s."""
    graceful_shutdown_timeout: float = 30.0
    """Seconds in-flight reconciles get to finish on stop; 0 cancels them at once."""
    cache_sync_timeout: float = DEFAULT_SYNC_TIMEOUT
    """Seconds to wait for the caches' first lists (120 s)."""


class Manager:
    """Build with ``Manager(config, options)``, add controllers, then ``await run()``.

    ``scheme`` says which models the cache reads kinds as (default: none, raw dicts only);
    ``clock`` is the one clock of every controller, the cache and leader election (default:
    the event loop's and the system's). Every object a write returns goes into the cache at
    once (see :meth:`SharedCache.observe`).
    """

    def __init__(self, config: RestConfig, options: ManagerOptions | None = None, *,
                 registry: CollectorRegistry | None = None, scheme: Scheme | None = None,
                 clock: Clock | None = None) -> None:
        self.options = options or ManagerOptions()
        self.registry = registry or CollectorRegistry()
        self.clock: Clock = clock or RealClock()
        self.client = Client(config, field_manager=self.options.field_manager,
                             metrics=RestClientMetrics(registry=self.registry))
        self.cache = SharedCache(self.client, scheme=scheme, clock=self.clock)
        self.client.add_write_observer(self.cache.observe)
        self.controller_metrics = ControllerMetrics(registry=self.registry)
        self.controllers: list[Controller] = []
        self.elector: LeaderElector | None = None
        if self.options.leader_election:
            if not (self.options.leader_election_id and self.options.leader_election_namespace):
                raise ValueError("leader election needs leader_election_id and leader_election_namespace: "
                                 "the Lease every replica competes for")
            self.elector = LeaderElector(
                self.client, name=self.options.leader_election_id,
                namespace=self.options.leader_election_namespace,
                config=self.options.leader_election_config,
                metrics=LeaderElectionMetrics(registry=self.registry), clock=self.clock)
        self._health_checks: dict[str, HealthCheck] = {"ping": lambda: None}
        self._ready_checks: dict[str, HealthCheck] = {"informer-sync": self._check_synced}
        if self.elector is not None:
            self._health_checks["leaderElection"] = self.elector.check_health
            self._ready_checks["leaderElection"] = self.elector.check_ready
        self._synced = False
        self._stop = asyncio.Event()
        self.bound_addresses: dict[str, tuple[str, int]] = {}

    def controller(self, name: str, reconciler: Reconciler, *,
                   options: ControllerOptions | None = None) -> Controller:
        """A new controller named ``name`` (its metrics label), registered with this manager."""
        ctrl = Controller(name, reconciler, self.cache, options=options, metrics=self.controller_metrics,
                          clock=self.clock)
        self.controllers.append(ctrl)
        return ctrl

    def writer(self, field_manager: str | None = None) -> Applier:
        """A :class:`Writer` for one controller: applies as ``field_manager`` (default the
        manager's), skipping applies that would not change the cached object."""
        return Applier(self.cache, self.client, field_manager=field_manager or self.options.field_manager)

    def stop(self) -> None:
        """Begin a graceful shutdown; ``run()`` returns when it is complete."""
        self._stop.set()

    # -- running -------------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = False) -> None:
        if handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        async with self.client, asyncio.TaskGroup() as group:
            servers = await self._start_servers()
            try:
                lost = await self._run_in(group)
            finally:
                for runner in servers:
                    await runner.cleanup()
        if lost:
            raise LeadershipLost("leader election lost: stopped reconciling")

    async def _run_in(self, group: asyncio.TaskGroup) -> bool:
        """Start everything in ``group``; return True if the Lease was lost."""
        background = [group.create_task(self.cache.run(), name="cache")]
        if not await self._wait(self.cache.wait_for_sync(self.options.cache_sync_timeout)):
            self._cancel(background)
            return False
        self._synced = True
        if self.elector is not None:
            background.append(group.create_task(self.elector.run(), name="leader election"))
            if not await self._wait(self.elector.wait_leading()):
                self._cancel(background)
                return False
        log.info("starting controllers", controllers=[c.name for c in self.controllers])
        running = [group.create_task(c.run(), name=f"controller {c.name}") for c in self.controllers]
        if await self._wait_lost():
            self._cancel(running + background)
            return True
        await self._drain(running)
        self._cancel(background)
        return False

    async def _wait(self, awaitable: Awaitable[None]) -> bool:
        """Await ``awaitable`` unless a stop comes first; True if it completed."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            completed = task.done()
        finally:
            # Neither outlives this call, whether a stop, the awaitable or our own cancellation won.
            stop.cancel()
            if not task.done():
                task.cancel()
        if not completed:
            return False
        task.result()
        return True

    async def _wait_lost(self) -> bool:
        """Wait for a stop (False) or the loss of the Lease (True)."""
        if self.elector is None:
            await self._stop.wait()
            return False
        return await self._wait(self.elector.wait_lost())

    async def _drain(self, running: list[asyncio.Task[None]]) -> None:
        log.info("stopping controllers", timeout=self.options.graceful_shutdown_timeout)
        for ctrl in self.controllers:
            ctrl.shutdown()
        if running and self.options.graceful_shutdown_timeout > 0:
            _, pending = await asyncio.wait(running, timeout=self.options.graceful_shutdown_timeout)
            if pending:
                log.warning("reconciles still running at the shutdown deadline; cancelling",
                            count=len(pending))
        self._cancel(running)

    @staticmethod
    def _cancel(tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()

    # -- probes and metrics --------------------------------------------------------------------

    def _check_synced(self) -> None:
        if not self._synced:
            raise RuntimeError("caches not synced")

    async def _start_servers(self) -> list[web.AppRunner]:
        runners = []
        for role, address, routes in (
            ("probes", self.options.health_probe_bind_address, [
                web.get("/healthz", self._probe_handler(self._health_checks)),
                web.get("/readyz", self._probe_handler(self._ready_checks)),
                web.get("/readyz/{check}", self._probe_handler(self._ready_checks))]),
            ("metrics", self.options.metrics_bind_address, [web.get("/metrics", self._metrics)]),
        ):
            if address in ("0", ""):
                continue
            app = web.Application()
            app.add_routes(routes)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            host, _, port = address.rpartition(":")
            site = web.TCPSite(runner, host or "0.0.0.0", int(port))
            await site.start()
            sockets = [s.getsockname() for s in (site._server.sockets if site._server else [])]  # type: ignore[attr-defined]
            if sockets:
                self.bound_addresses[role] = (str(sockets[0][0]), int(sockets[0][1]))
            runners.append(runner)
        return runners

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    def _probe_handler(checks: dict[str, HealthCheck]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            only = request.match_info.get("check")
            excluded = set(request.query.getall("exclude", []))
            lines, healthy = [], True
            for name, check in checks.items():
                if (only and name != only) or name in excluded:
                    continue
                try:
                    result = check()
                    if result is not None:
                        await result
                    lines.append(f"[+]{name} ok")
                except Exception:
                    healthy = False
                    lines.append(f"[-]{name} failed: reason withheld")
            if only and not lines:
                return web.Response(status=404, text=f"no check named {only}\n")
            if healthy and "verbose" not in request.query:
                return web.Response(text="ok")
            body = "\n".join(lines) + ("\nhealthz check passed\n" if healthy else "\nhealthz check failed\n")
            return web.Response(status=200 if healthy else 500, text=body)

        return handler

