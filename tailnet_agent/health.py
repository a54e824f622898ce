"""The agent's health, status and metrics endpoints: ``/healthz``, ``/readyz``, ``/status``, ``/metrics``.

* ``/healthz`` is 200 while the process serves requests (liveness);
* ``/readyz`` is 200 once the node has a netmap and its home DERP region is connected (and an
  egress agent's targets have answered once, :class:`tailnet_agent.probe.Warmup`), else 503 with
  the missing piece named; 503 from SIGTERM on (the agent drains, then exits);
* ``/status`` is the JSON document of :mod:`tailnet_agent.contract.status` (node, targets, routes, probes),
  404 when the server was given no status provider;
* ``/metrics`` is Prometheus text from the agent's own registry (never the global one, so tests and
  several agents in one process do not collide).

Metrics (``direction`` is ``sent`` towards the target or ``received`` from it)::

    tailnet_agent_connections_total{target}          accepted local connections
    tailnet_agent_active_connections{target}         connections being forwarded
    tailnet_agent_bytes_total{target,direction}      bytes copied
    tailnet_agent_dial_errors_total{target,reason}   reason: no_route, timeout, refused, unknown_name, ...
    tailnet_agent_target_reachable{target}           1 if the last reachability probe connected, else 0
    tailnet_agent_target_probe_seconds{target}       histogram of successful probes' connect time
    tailnet_agent_targets_reload_errors_total        targets files that could not be applied
    tailnet_agent_targets_file_valid                 0 while the file on disk is not the one in force
    tailnet_agent_limit{limit}                       configured limits (tailnet_agent.limits)
    tailnet_agent_open_connections                   client connections open, all listeners together
    tailnet_agent_connections_refused_total          connections closed as accepted, over the limit
    tailnet_agent_peer_connections_refused_total     connections closed as accepted, over their peer's limit
    tailnet_agent_headers_refused_total{protocol}    requests whose header section was over the limits
    tailnet_agent_http2_goaway_total{reason}         reason: idle, rapid_reset, protocol_error, headers_too_large,
                                                     write_stalled, shutdown
    tailnet_agent_control_connected                  1 while the control connection is up
    tailnet_agent_derp_connected                     1 while the home DERP region is connected
    tailnet_agent_direct_peers                       peers reached over a direct UDP path (not DERP)
    tailnet_agent_dataplane_<counter>_total          the data plane's counters (packets, bytes, drops)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tailnet_agent.contract.endpoints import HEALTH_PORT, HEALTHZ_PATH, METRICS_PATH, READYZ_PATH, STATUS_PATH

log = structlog.get_logger("agent.health")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeStatus(Protocol):
    """What the endpoints read from the node (:class:`tailnet_agent.node.Node` fits)."""

    @property
    def ready(self) -> bool: ...

    @property
    def control_connected(self) -> bool: ...

    @property
    def netmap(self) -> object | None: ...

    @property
    def home_region(self) -> int: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def derp_connections(self) -> Mapping[int, object]: ...

    @property
    def direct_peer_count(self) -> int: ...


class _NodeCollector(Collector):
    def __init__(self, node: NodeStatus) -> None:
        self._node = node

    def collect(self) -> Iterator[Metric]:
        node = self._node
        yield GaugeMetricFamily("tailnet_agent_control_connected", "1 while the control connection is up.",
                                value=1 if node.control_connected else 0)
        home = node.home_region
        yield GaugeMetricFamily("tailnet_agent_derp_connected", "1 while the home DERP region is connected.",
                                value=1 if home and home in node.derp_connections else 0)
        yield GaugeMetricFamily("tailnet_agent_direct_peers", "Peers reached over a direct UDP path, not DERP.",
                                value=node.direct_peer_count)
        for name, value in sorted(node.counters.items()):
            metric = re.sub(r"[^a-zA-Z0-9_]", "_", name)
            yield CounterMetricFamily(f"tailnet_agent_dataplane_{metric}", f"Data plane counter {name}.",
                                      value=value)


class AgentMetrics:
    """The agent's metrics in a registry of their own; pass ``node`` to include its state."""

    def __init__(self, node: NodeStatus | None = None) -> None:
        self.registry = CollectorRegistry()
        self.connections = Counter("tailnet_agent_connections", "Local connections accepted per target.",
                                   ["target"], registry=self.registry)
        self.active = Gauge("tailnet_agent_active_connections", "Connections being forwarded per target.",
                            ["target"], registry=self.registry)
        self.bytes = Counter("tailnet_agent_bytes", "Bytes forwarded per target and direction.",
                             ["target", "direction"], registry=self.registry)
        self.dial_errors = Counter("tailnet_agent_dial_errors", "Failed tailnet dials per target and reason.",
                                   ["target", "reason"], registry=self.registry)
        self.target_reachable = Gauge("tailnet_agent_target_reachable",
                                      "1 if the last reachability probe of the target connected, else 0.",
                                      ["target"], registry=self.registry)
        self.target_probe_seconds = Histogram(
            "tailnet_agent_target_probe_seconds", "Connect time of successful reachability probes per target.",
            ["target"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.targets_reload_errors = Counter("tailnet_agent_targets_reload_errors",
                                             "Targets files that could not be applied (the old targets stay).",
                                             registry=self.registry)
        self.targets_file_valid = Gauge("tailnet_agent_targets_file_valid",
                                        "0 while the targets file on disk is not the one in force.",
                                        registry=self.registry)
        self.targets_file_valid.set(1)
        self.limit = Gauge("tailnet_agent_limit", "The agent's configured limits (0: none).", ["limit"],
                           registry=self.registry)
        self.open_connections = Gauge("tailnet_agent_open_connections",
                                      "Client connections open, all listeners, against the connection limit.",
                                      registry=self.registry)
        self.refused = Counter("tailnet_agent_connections_refused",
                               "Client connections closed as accepted because the agent held its limit.",
                               registry=self.registry)
        self.peer_refused = Counter("tailnet_agent_peer_connections_refused",
                                    "Client connections closed as accepted because their peer address held "
                                    "its limit.", registry=self.registry)
        self.headers_refused = Counter("tailnet_agent_headers_refused",
                                       "HTTP requests refused because their header section was over the limits "
                                       "(431, or an HTTP/2 connection ended), by protocol.",
                                       ["protocol"], registry=self.registry)
        self.http2_goaway = Counter("tailnet_agent_http2_goaway", "HTTP/2 connections the agent ended, by reason.",
                                    ["reason"], registry=self.registry)
        self.passthrough_refused = Counter(
            "tailnet_agent_passthrough_refused",
            "tls expose connections closed before reaching a backend, by reason: no whole ClientHello within the "
            "handshake timeout (timeout), the client closed first (closed), not a ClientHello or one over the read "
            "limit (invalid), no host for its SNI name (unknown_name), no SNI and no * host (no_server_name).",
            ["reason"], registry=self.registry)
        if node is not None:
            self.registry.register(_NodeCollector(node))

    def targets_reload_outcome(self, error: str | None) -> None:
        """A targets file was applied (None) or refused (its error): the two targets-file metrics."""
        if error is None:
            self.targets_file_valid.set(1)
        else:
            self.targets_reload_errors.inc()
            self.targets_file_valid.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """Serves the endpoints on ``host:port`` (port 0 picks one; see :attr:`port`). ``run`` blocks
    until cancelled."""

    def __init__(self, node: NodeStatus, metrics: AgentMetrics, *, host: str = "0.0.0.0", port: int = HEALTH_PORT,
                 status: Callable[[], Mapping[str, object]] | None = None,
                 warmup: Callable[[], Sequence[str]] | None = None) -> None:
        self.node = node
        self.warmup = warmup
        """What readiness still waits for once the node is ready (an egress agent's targets that
        have not answered yet: :class:`tailnet_agent.probe.Warmup`); nothing by default."""
        self.status = status
        """Builds the ``/status`` document (:func:`tailnet_agent.status.egress_status` or
        :func:`~tailnet_agent.status.ingress_status`)."""
        self.metrics = metrics
        self.host = host
        self.port = port
        self.started = asyncio.Event()
        self.stopping = False
        """Set on SIGTERM: ``/readyz`` answers 503 from then on, so the Service stops sending here."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(HEALTHZ_PATH, self._healthz)
        app.router.add_get(READYZ_PATH, self._readyz)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(METRICS_PATH, self._metrics)
        return app

    async def run(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            for address in runner.addresses:
                if isinstance(address, tuple) and len(address) >= 2:
                    self.port = int(address[1])
                    break
            log.info("health endpoints listening", address=f"{self.host}:{self.port}")
            self.started.set()
            await asyncio.get_running_loop().create_future()
        finally:
            await runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        node = self.node
        if self.stopping:
            return web.Response(status=503, text="not ready: shutting down\n")
        if node.ready:
            if self.warmup is not None and (waiting := self.warmup()):
                return web.Response(status=503, text=f"not ready: no target has answered a probe yet: "
                                                      f"{', '.join(waiting)}\n")
            return web.Response(text="ready\n")
        if node.netmap is None:
            why = "no netmap from control yet"
        elif not node.home_region:
            why = "the DERP map has no usable home region"
        else:
            why = f"home DERP region {node.home_region} not connected and no peer reached directly"
        return web.Response(status=503, text=f"not ready: {why}\n")

    async def _status(self, request: web.Request) -> web.Response:
        if self.status is None:
            raise web.HTTPNotFound(text="no status in this mode\n")
        return web.json_response(self.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
