"""The agent's limits: their defaults and environment variables, the connection gate (per agent
and per peer), header sizes as HTTP/2 counts them and as aiohttp's parser refuses them, and the
HTTP/2 reset budget (pure logic on a fake clock)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser

from tailnet_agent.config import parse_limits
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.forward.http.http1 import headers_too_large
from tailnet_agent.forward.http.http2 import Http2Base, _Connection
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import LIMIT_NAMES, ConnectionGate, Limits, ResetBudget, header_list_size, peer_address


def test_the_defaults_hold_when_nothing_is_set() -> None:
    assert parse_limits({}) == Limits(max_connections=4096, max_connections_per_peer=512, http1_max_line_size=8190,
                                      http1_max_field_size=8190, http2_max_header_list_size=65536,
                                      http2_max_streams=100, http2_max_resets=200, idle_timeout=120.0)


def test_each_variable_sets_its_limit_and_a_bad_value_names_it() -> None:
    limits = parse_limits({"TAILNET_MAX_CONNECTIONS": "0", "TAILNET_HTTP2_MAX_STREAMS": "8",
                           "TAILNET_HTTP2_MAX_RESETS": "20", "TAILNET_IDLE_TIMEOUT": "2.5",
                           "TAILNET_MAX_CONNECTIONS_PER_PEER": "0", "TAILNET_HTTP1_MAX_LINE_SIZE": "4096",
                           "TAILNET_HTTP1_MAX_FIELD_SIZE": "2048", "TAILNET_HTTP2_MAX_HEADER_LIST_SIZE": "16384"})
    assert limits == Limits(max_connections=0, max_connections_per_peer=0, http1_max_line_size=4096,
                            http1_max_field_size=2048, http2_max_header_list_size=16384, http2_max_streams=8,
                            http2_max_resets=20, idle_timeout=2.5)
    with pytest.raises(ConfigError, match=r"^TAILNET_HTTP2_MAX_HEADER_LIST_SIZE must be at least 256, got '0'$"):
        parse_limits({"TAILNET_HTTP2_MAX_HEADER_LIST_SIZE": "0"})
    with pytest.raises(ConfigError, match=r"^TAILNET_MAX_CONNECTIONS_PER_PEER must be a whole number, got '1.5'$"):
        parse_limits({"TAILNET_MAX_CONNECTIONS_PER_PEER": "1.5"})
    with pytest.raises(ConfigError, match=r"^TAILNET_HTTP2_MAX_STREAMS must be at least 1, got '0'$"):
        parse_limits({"TAILNET_HTTP2_MAX_STREAMS": "0"})
    with pytest.raises(ConfigError, match=r"^TAILNET_MAX_CONNECTIONS must be a whole number, got 'many'$"):
        parse_limits({"TAILNET_MAX_CONNECTIONS": "many"})
    with pytest.raises(ConfigError, match=r"^TAILNET_IDLE_TIMEOUT must be at least 0, got '-1'$"):
        parse_limits({"TAILNET_IDLE_TIMEOUT": "-1"})


def test_the_gate_refuses_over_the_limit_and_counts() -> None:
    metrics = AgentMetrics()
    Limits(max_connections=2).report(metrics)
    gate = ConnectionGate(2, metrics)
    assert [gate.admit(), gate.admit(), gate.admit()] == [True, True, False]
    gate.release()
    assert gate.admit()
    sample = metrics.registry.get_sample_value
    assert sample("tailnet_agent_connections_refused_total") == 1
    assert sample("tailnet_agent_open_connections") == 2
    assert sample("tailnet_agent_limit", {"limit": "max_connections"}) == 2
    unlimited = ConnectionGate(0)
    assert all(unlimited.admit() for _ in range(10_000))


class FakeTransport(asyncio.Transport):
    def __init__(self, peer: str) -> None:
        super().__init__({"peername": (peer, 40000)})
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_gate_holds_each_peer_to_its_own_limit_and_closes_the_one_over_it() -> None:
    metrics = AgentMetrics()
    gate = ConnectionGate.of(Limits(max_connections_per_peer=2), metrics)
    one, two, three, other = (FakeTransport(ip) for ip in ("100.64.0.1", "100.64.0.1", "100.64.0.1", "100.64.0.2"))
    with gate.hold_peer(one) as first, gate.hold_peer(two) as second, gate.hold_peer(three) as third, \
            gate.hold_peer(other) as elsewhere:
        assert (first, second, third, elsewhere) == (True, True, False, True)
        assert (one.closed, three.closed, other.closed) == (False, True, False)
        assert gate.peers == {"100.64.0.1": 2, "100.64.0.2": 1}
    assert gate.peers == {}, "every hold was given back, the refused one's never taken"
    with gate.hold_peer(FakeTransport("100.64.0.1")) as again:
        assert again
    assert metrics.registry.get_sample_value("tailnet_agent_peer_connections_refused_total") == 1
    assert metrics.registry.get_sample_value("tailnet_agent_connections_refused_total") == 0
    assert peer_address(FakeTransport("fd7a:115c:a1e0::1")) == "fd7a:115c:a1e0::1"
    unlimited = ConnectionGate(per_peer=0)
    assert all(unlimited.admit_peer("10.0.0.1") for _ in range(10_000))


def test_every_limit_is_reported_by_name() -> None:
    metrics = AgentMetrics()
    Limits().report(metrics)
    shown = {name: metrics.registry.get_sample_value("tailnet_agent_limit", {"limit": name}) for name in LIMIT_NAMES}
    assert shown == {"max_connections": 4096, "max_connections_per_peer": 512, "http1_max_line_size": 8190,
                     "http1_max_field_size": 8190, "http2_max_header_list_size": 65536, "http2_max_streams": 100,
                     "http2_max_resets": 200, "idle_timeout": 120}


def test_a_header_list_is_sized_as_rfc_9113_counts_it() -> None:
    """Name and value octets plus 32 per field, pseudo-header fields included (6.5.2)."""
    assert header_list_size([(":method", "GET"), (b"cookie", b"a=1")]) == (7 + 3 + 32) + (6 + 3 + 32)
    assert header_list_size([("x", "é")]) == 1 + 2 + 32, "octets, not characters"
    assert header_list_size([]) == 0


def parse(data: bytes) -> HttpProcessingError | None:
    """What aiohttp's HTTP/1.1 parser (the server's, with the agent's default limits) makes of ``data``."""
    protocol: Any = object()
    loop = asyncio.new_event_loop()
    try:
        HttpRequestParser(protocol, loop, 2 ** 16, max_line_size=8190, max_field_size=8190,
                          max_headers=128).feed_data(data)
    except HttpProcessingError as exc:
        return exc
    finally:
        loop.close()
    return None


@pytest.mark.parametrize(("data", "too_large"), [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-" + b"n" * 9000 + b": v\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 8000 + b"\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n", False),
], ids=["request-line", "field-value", "field-name", "129-fields", "under", "malformed"])
def test_the_parsers_size_refusals_and_only_they_are_answered_431(data: bytes, too_large: bool) -> None:
    error = parse(data)
    assert headers_too_large(error) is too_large, error
    assert (error is None) is (not too_large and b"Bad Header" not in data)


def test_the_reset_budget_refills_evenly_over_its_period() -> None:
    now = [0.0]
    budget = ResetBudget(10, lambda: now[0], period=10.0)
    assert all(budget.spend() for _ in range(10))
    assert not budget.spend()
    now[0] = 1.0  # one reset's worth back per second
    assert budget.spend() and not budget.spend()
    now[0] = 1000.0  # never more than the limit
    assert sum(budget.spend() for _ in range(20)) == 10
    assert all(ResetBudget(0, lambda: 0.0).spend() for _ in range(1000))


class Writer:
    """A StreamWriter whose client takes what it is sent (``drain`` returns) or nothing at all."""

    def __init__(self, *, taking: bool) -> None:
        self.taking = taking
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        if not self.taking:
            await asyncio.Event().wait()


@pytest.mark.parametrize("taking", [True, False])
async def test_the_http2_read_loop_goes_on_only_once_the_client_took_what_it_was_sent(taking: bool) -> None:
    """The loop waits for the writer to drain before it reads more (PING answers cannot pile up);
    a client that takes nothing for an idle timeout ends the connection as ``write_stalled``."""
    server = Http2Base("h2", Limits(idle_timeout=0.05))
    h2c = _Connection(cast(Any, Writer(taking=taking)), server.limits)
    assert await asyncio.wait_for(server._taken(h2c), 5) is taking
    assert h2c.ending == (None if taking else "write_stalled")


async def test_an_http2_connection_advertises_its_header_list_limit_and_decodes_up_to_twice_it() -> None:
    """Between the two a request is decoded and answered 431; past twice it h2 ends the connection."""
    h2c = _Connection(cast(Any, Writer(taking=True)), Limits(http2_max_header_list_size=4096))
    assert h2c.conn.local_settings.max_header_list_size == 4096
    assert h2c.conn.decoder.max_header_list_size == 8192
