"""The gateway routing benchmark's pure parts: the exposes the operator's translation makes, what
each row is checked to be, and the section written from a run's document."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks import gateway_routing as bench
from benchmarks.ingress_serve import CONCURRENCY, HttpPath, Load
from benchmarks.pathcheck import PathNotAsClaimed
from tailnet_agent.contract.exposes import parse_exposes
from tailnet_agent.forward.http.routes import choose
from tailnet_operator.api.ingress import PATHS_MAX


def test_the_routed_row_is_the_translated_route_and_its_request_takes_the_last_rule() -> None:
    parsed = parse_exposes(json.dumps(bench.exposes(5000, 5001)))

    claims = bench.routing_claims(parsed, 5000)

    _, routed = bench.host_of_port(parsed, bench.ROUTED_PORT, bench.ROUTED_HOST)
    assert [r.path for r in routed.routes] == bench.flat_paths() and len(routed.routes) == bench.RULES
    assert choose(routed.routes, bench.TARGET) is routed.routes[-1]
    assert choose(routed.routes, "/elsewhere") is None and not routed.fallback, "no rule: 404"
    assert claims["routed"].startswith(f"{bench.RULES} rules /r00")
    _, plain = bench.host_of_port(parsed, bench.PLAIN_PORT, bench.PLAIN_HOST)
    assert plain.routes == ()


def test_a_route_whose_request_would_reach_the_backend_by_another_rule_is_refused() -> None:
    document = bench.exposes(5000, 5001)
    routes = document[0]["hosts"][0]["routes"]
    routes[0]["backend"]["port"] = 5000  # a second rule to the backend: a misroute would not show

    with pytest.raises(PathNotAsClaimed):
        bench.routing_claims(parse_exposes(json.dumps(document)), 5000)


def test_only_backend_hosts_move_to_loopback() -> None:
    document = [{"backend": {"host": "web.bench.svc", "port": 80}, "hosts": [{"name": "web.bench.svc"}]},
                {"backend": {"host": "db.other.svc", "port": 5432}}]

    assert bench.on_loopback(document) == [
        {"backend": {"host": "127.0.0.1", "port": 80}, "hosts": [{"name": "web.bench.svc"}]},
        {"backend": {"host": "db.other.svc", "port": 5432}}]


def test_twenty_rules_are_served_and_one_more_than_a_host_takes_is_refused() -> None:
    assert bench.RULES == 20 <= PATHS_MAX
    assert "TooManyPaths" in bench.refusal()
    assert bench.refusal(bench.RULES) == "20 rules are served"


def run_of(name: str, target: str, rps: tuple[float, ...], agent_ms: float) -> HttpPath:
    path = HttpPath(name, "tcp:127.0.0.1:1", "h", False, target=target)
    for clients in CONCURRENCY:
        path.runs[clients] = [Load(clients, 6.0, int(r * 6), r, 1.0, 2.0) for r in rps]
        path.cpu[clients] = [dict.fromkeys(bench.CPU_COLUMNS, agent_ms) for _ in rps]
    return path


def test_the_section_states_the_rule_the_checks_the_tables_and_every_round() -> None:
    doc = {"date": "2026-12-07", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10",
           "settings": {"seconds": 6.0, "rounds": 3, "body_bytes": 256, "rules": bench.RULES},
           "loadavg_before": [1.0, 2.0, 3.0], "loadavg_after": [1.5, 2.0, 3.0], "cpus": 2,
           "http": [asdict(run_of(bench.ROUTED, bench.TARGET, (900.0, 1000.0, 1100.0), 0.4)),
                    asdict(run_of(bench.PLAIN, "/", (1000.0, 1250.0, 1200.0), 0.3))],
           "claims": {"routed": "routed claim", "plain": "plain claim"}, "live": ["port 80 GET /r15/bench: 200"],
           "path_before": "before", "path_after": "after", "twenty_rules": "refused",
           "choice_us": {"no paths": 2.5}}
    doc = json.loads(json.dumps(doc))  # as read back: the concurrency keys become strings

    text = bench.section(doc)

    assert text.startswith("### The cost of routing, 2026-12-07, commit abc1234")
    assert f"`{bench.flat_paths()[-1]}` is the rule the agent's `choose` reaches last" in text
    assert "routed: routed claim; plain: plain claim" in text and "before: before; after: after" in text
    assert f"| {bench.ROUTED} | 1000 | 1.00 | 2.00 | 1000 | 1.00 | 2.00 |" in text
    assert f"| {bench.PLAIN} | 32 | 0.300 | 0.300 | 0.300 | 0.300 | 1.200 |" in text
    assert ("at 32 clients 0.90x the plain row's requests/s (per round: 0.90, 0.80, 0.92), p50 +0.00 ms, "
            "agent CPU +100 µs per request") in text
    assert f"- {bench.ROUTED}, 32 clients: 900, 1000, 1100" in text
    assert "1.0, 2.0, 3.0 at the start" in text and text.endswith("| no paths | 2.50 |")
