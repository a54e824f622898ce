"""What clients may hold in one agent: connections, and per HTTP/2 connection its streams, its
reset rate and how long it stays idle.

Each limit has a documented default (:class:`Limits`, read from the environment by
:mod:`tailnet_agent.config`) and shows on ``/metrics``: the configured values as
``tailnet_agent_limit{limit}``, the open connections, the connections refused at the limit and the
HTTP/2 connections the agent ended (``tailnet_agent_http2_goaway_total{reason}``).

* **Connections per agent** (:class:`ConnectionGate`): every client connection, egress listener,
  ingress tcp or http, counts from accept to close; one more than the limit is closed as it is
  accepted (a TCP close the client sees at once, not a queue that grows).
* **HTTP/2 concurrent streams**: SETTINGS_MAX_CONCURRENT_STREAMS, enforced by ``h2`` (a client that
  opens more gets a connection error).
* **HTTP/2 reset rate** (:class:`ResetBudget`): a client that resets more streams than the budget
  within :data:`RESET_PERIOD` gets GOAWAY ENHANCE_YOUR_CALM and the connection ends, so opening
  and cancelling streams cannot make the backend start requests without bound (CVE-2023-44487).
* **Idle timeout**: an HTTP connection with no request in progress is ended after it (HTTP/2:
  GOAWAY NO_ERROR first; HTTP/1.1: aiohttp's keep-alive timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tailnet_agent.health import AgentMetrics

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_HTTP2_MAX_STREAMS = 100
DEFAULT_HTTP2_MAX_RESETS = 200
DEFAULT_IDLE_TIMEOUT = 120.0
RESET_PERIOD = 10.0
"""Seconds over which :attr:`Limits.http2_max_resets` is counted (a bucket refilled at that rate)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Client connections open at once in the agent, all listeners together. Default 4096; 0: no
    limit. A connection over the limit is closed as it is accepted."""
    http2_max_streams: int = DEFAULT_HTTP2_MAX_STREAMS
    """SETTINGS_MAX_CONCURRENT_STREAMS advertised to HTTP/2 clients. Default 100 (at least 1)."""
    http2_max_resets: int = DEFAULT_HTTP2_MAX_RESETS
    """Streams an HTTP/2 client may reset per :data:`RESET_PERIOD` (10 s); one more ends the
    connection with GOAWAY ENHANCE_YOUR_CALM. Default 200; 0: no limit."""
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    """Seconds an HTTP connection with no request in progress stays open (HTTP/2: checked every
    timeout, so it ends between one and two timeouts after its last request). Default 120; 0: no
    timeout."""

    def report(self, metrics: AgentMetrics) -> None:
        """Show the configured values as ``tailnet_agent_limit{limit}``."""
        for name in ("max_connections", "http2_max_streams", "http2_max_resets", "idle_timeout"):
            metrics.limit.labels(name).set(getattr(self, name))


class ConnectionGate:
    """The client connections open in one agent, counted against :attr:`Limits.max_connections`."""

    def __init__(self, limit: int = DEFAULT_MAX_CONNECTIONS, metrics: AgentMetrics | None = None) -> None:
        self.limit = limit
        self.open = 0
        self.metrics = metrics

    def admit(self) -> bool:
        """Count one more connection; False (and counted as refused) when the agent holds its limit."""
        if self.limit and self.open >= self.limit:
            if self.metrics is not None:
                self.metrics.refused.inc()
            return False
        self.open += 1
        self._show()
        return True

    def release(self) -> None:
        self.open -= 1
        self._show()

    def _show(self) -> None:
        if self.metrics is not None:
            self.metrics.open_connections.set(self.open)


class Refused(asyncio.Protocol):
    """The protocol of a connection accepted over the limit: closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class ResetBudget:
    """Stream resets a client may still make: ``limit`` per ``period`` seconds, refilled evenly
    (a token bucket); ``now`` is the clock in seconds. A limit of 0 never runs out."""

    def __init__(self, limit: int, now: Callable[[], float], period: float = RESET_PERIOD) -> None:
        self.limit, self.period, self.now = limit, period, now
        self.tokens = float(limit)
        self.at = now()

    def spend(self) -> bool:
        """One reset; False once the client reset more than the budget allows."""
        if not self.limit:
            return True
        now = self.now()
        self.tokens = min(float(self.limit), self.tokens + (now - self.at) * self.limit / self.period)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
