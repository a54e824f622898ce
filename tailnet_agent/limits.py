"""What clients may hold in one agent: connections, in all and per peer, the size of a request's
header section, and per HTTP/2 connection its streams, its reset rate and how long it stays idle.

Each limit has a documented default (:class:`Limits`, read from the environment by
:mod:`tailnet_agent.config`) and shows on ``/metrics``: the configured values as
``tailnet_agent_limit{limit}``, the open connections, the connections refused at the limit and the
HTTP/2 connections the agent ended (``tailnet_agent_http2_goaway_total{reason}``).

* **Connections per agent** (:class:`ConnectionGate`): every client connection, egress listener,
  ingress tcp or http, counts from accept to close; one more than the limit is closed as it is
  accepted (a TCP close the client sees at once, not a queue that grows).
* **Connections per peer** (:meth:`ConnectionGate.hold_peer`): the same count per source address
  (ingress: the tailnet peer's; egress: the client pod's), so one client cannot take the agent's
  whole budget; one more is closed as accepted, before anything is dialled
  (``tailnet_agent_peer_connections_refused_total``).
* **Header sizes** (:func:`header_list_size`): HTTP/1.1's request line and each header field
  (aiohttp's parser; at most 128 fields), HTTP/2's header list (SETTINGS_MAX_HEADER_LIST_SIZE,
  RFC 9113 6.5.2). A request over them is answered 431 without reaching the backend; an HTTP/2
  header list over twice the limit is not decoded further and ends the connection (GOAWAY
  ENHANCE_YOUR_CALM), since HPACK lets a few bytes expand into many
  (``tailnet_agent_headers_refused_total{protocol}``).
* **Memory per connection**: bounded by the buffers' high-water marks, not by a variable (the
  table in docs/agent.md adds them up); a peer that stops reading stops the agent reading the
  other side.
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
import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tailnet_agent.health import AgentMetrics

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_PEER = 512
DEFAULT_HTTP1_MAX_LINE_SIZE = 8190
DEFAULT_HTTP1_MAX_FIELD_SIZE = 8190
HTTP1_MAX_FIELDS = 128
"""Header fields an HTTP/1.1 request may have (aiohttp's server default; not a variable)."""
DEFAULT_HTTP2_MAX_HEADER_LIST_SIZE = 65536
HEADER_LIST_HARD_FACTOR = 2
"""An HTTP/2 header list over this many times the limit is not decoded further: the connection ends."""
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
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    """Client connections open at once from one source address (ingress: the tailnet peer; egress:
    the client pod). Default 512; 0: no limit. One more is closed as it is accepted."""
    http1_max_line_size: int = DEFAULT_HTTP1_MAX_LINE_SIZE
    """Bytes of an HTTP/1.1 request line. Default 8190 (aiohttp's); a longer one gets 431."""
    http1_max_field_size: int = DEFAULT_HTTP1_MAX_FIELD_SIZE
    """Bytes of one HTTP/1.1 header field (name or value). Default 8190 (aiohttp's); a longer one gets 431."""
    http2_max_header_list_size: int = DEFAULT_HTTP2_MAX_HEADER_LIST_SIZE
    """SETTINGS_MAX_HEADER_LIST_SIZE advertised to HTTP/2 clients (each field's name and value plus
    32 bytes, RFC 9113 6.5.2). Default 65536 (h2's); a request over it gets 431, one over
    :data:`HEADER_LIST_HARD_FACTOR` times it ends the connection."""
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
        for name in LIMIT_NAMES:
            metrics.limit.labels(name).set(getattr(self, name))


LIMIT_NAMES = ("max_connections", "max_connections_per_peer", "http1_max_line_size", "http1_max_field_size",
               "http2_max_header_list_size", "http2_max_streams", "http2_max_resets", "idle_timeout")
"""The :class:`Limits` fields shown as ``tailnet_agent_limit{limit}``."""


def header_list_size(headers: Iterable[tuple[str | bytes, str | bytes]]) -> int:
    """The size of a header list as SETTINGS_MAX_HEADER_LIST_SIZE counts it (RFC 9113 6.5.2): each
    field's name and value in octets plus 32, pseudo-header fields included."""
    return sum(_octets(name) + _octets(value) + 32 for name, value in headers)


def _octets(text: str | bytes) -> int:
    return len(text.encode() if isinstance(text, str) else text)


def peer_address(transport: asyncio.BaseTransport) -> str:
    """The host part of a connection's peer address ("" when the transport does not say)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class ConnectionGate:
    """The client connections open in one agent, counted against :attr:`Limits.max_connections`
    as they are accepted (:meth:`admit`) and, once their peer's address is known, against
    :attr:`Limits.max_connections_per_peer` (:meth:`hold_peer`)."""

    def __init__(self, limit: int = DEFAULT_MAX_CONNECTIONS, metrics: AgentMetrics | None = None, *,
                 per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.open = 0
        self.peers: collections.Counter[str] = collections.Counter()
        """Open connections by peer address (an address with none is not kept)."""
        self.metrics = metrics

    @classmethod
    def of(cls, limits: Limits, metrics: AgentMetrics | None = None) -> ConnectionGate:
        return cls(limits.max_connections, metrics, per_peer=limits.max_connections_per_peer)

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

    def admit_peer(self, peer: str) -> bool:
        """Count one more connection of ``peer``; False (and counted as refused) when it holds its limit."""
        if self.per_peer and self.peers[peer] >= self.per_peer:
            if self.metrics is not None:
                self.metrics.peer_refused.inc()
            return False
        self.peers[peer] += 1
        return True

    def release_peer(self, peer: str) -> None:
        self.peers[peer] -= 1
        if self.peers[peer] <= 0:
            del self.peers[peer]

    @contextlib.contextmanager
    def hold_peer(self, transport: asyncio.BaseTransport) -> Iterator[bool]:
        """While the body runs, the connection counts against its peer's limit; over it the
        transport is closed at once (the client sees a close, as for the agent's limit) and the
        body gets False, to serve nothing."""
        peer = peer_address(transport)
        if not self.admit_peer(peer):
            transport.close()
            yield False
            return
        try:
            yield True
        finally:
            self.release_peer(peer)

    def _show(self) -> None:
        if self.metrics is not None:
            self.metrics.open_connections.set(self.open)


def hold_peer(gate: ConnectionGate | None, transport: asyncio.BaseTransport) -> contextlib.AbstractContextManager[bool]:
    """:meth:`ConnectionGate.hold_peer`, or always admitted when there is no gate."""
    return gate.hold_peer(transport) if gate is not None else contextlib.nullcontext(True)


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
