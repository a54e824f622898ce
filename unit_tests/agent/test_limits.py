"""The agent's limits: their defaults and environment variables, the connection gate and the
HTTP/2 reset budget (pure logic on a fake clock)."""

from __future__ import annotations

import pytest

from tailnet_agent.config import parse_limits
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.health import AgentMetrics
from tailnet_agent.limits import ConnectionGate, Limits, ResetBudget


def test_the_defaults_hold_when_nothing_is_set() -> None:
    assert parse_limits({}) == Limits(max_connections=4096, http2_max_streams=100, http2_max_resets=200,
                                      idle_timeout=120.0)


def test_each_variable_sets_its_limit_and_a_bad_value_names_it() -> None:
    limits = parse_limits({"TAILNET_MAX_CONNECTIONS": "0", "TAILNET_HTTP2_MAX_STREAMS": "8",
                           "TAILNET_HTTP2_MAX_RESETS": "20", "TAILNET_IDLE_TIMEOUT": "2.5"})
    assert limits == Limits(max_connections=0, http2_max_streams=8, http2_max_resets=20, idle_timeout=2.5)
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
