"""The tailnet-scale benchmark's pure parts: its policy, the agent's trace summary, the tables."""

from __future__ import annotations

import json
from typing import Any

from benchmarks import tailnet_scale as scale


def test_the_policy_is_the_policy_benchmarks_with_the_benchmarks_tags_and_rules() -> None:
    text, teams, services = scale.scale_policy(2000)
    doc = json.loads(text)
    assert (teams, services) == (50, 200)
    assert len(doc["grants"]) + len(doc["acls"]) == 2002
    assert {scale.CLIENT_TAG, scale.SERVER_TAG, scale.PEER_TAG} <= set(doc["tagOwners"])
    assert {"action": "accept", "src": ["*"], "dst": [f"{scale.CLIENT_TAG}:*"]} in doc["acls"]


def _line(**fields: Any) -> dict[str, Any]:
    return {"t": 0.0, "ms": 10.0, "cpu_ms": 8.0, "peers": 3, "full": False, "filter_count": 4, "added": [],
            "on_netmap": 6.0, **fields}


def test_the_trace_summary_takes_the_last_full_netmap_and_the_median_of_the_updates_after_it() -> None:
    lines = [_line(full=True, ms=500.0), _line(full=True, ms=100.0, filter_count=7, set_filter=3.0),
             _line(ms=1.0, on_netmap=0.5), _line(ms=3.0, on_netmap=1.0), _line(ms=2.0, on_netmap=2.0)]
    summary = scale.trace_summary(lines)
    assert summary["filter_rules_count"] == 7
    assert summary["updates"] == 3
    assert summary["full"]["ms"] == 100.0 and summary["full"]["set_filter"] == 3.0
    assert summary["full"]["decode"] == 94.0
    assert summary["update"]["ms"] == 2.0
    assert summary["update"]["decode"] == 0.5  # the median of 0.5, 2.0 and 0.0
    assert scale.trace_summary([_line()]) == {}


def _side(rss: float, update: float, setup: float) -> dict[str, Any]:
    return {"peers": 1002, "rss_ready_mib": rss, "rss_after_mib": rss + 1, "update_ms": [update, update + 2],
            "cpu_per_update_ms": 5.0, "setup_ms": [setup] * 99 + [setup * 10]}


def test_the_size_table_gives_the_median_of_the_rounds_and_every_round_in_brackets() -> None:
    rounds = [{"agent": _side(50, 100, 2), "tailscaled": _side(60, 200, 3)},
              {"agent": _side(70, 300, 4), "tailscaled": _side(40, 100, 1)},
              {"agent": _side(60, 200, 3), "tailscaled": _side(50, 300, 2)}]
    header, rule, agent, tailscaled = scale.size_table(rounds)
    assert header.count("|") == rule.count("|") == agent.count("|") == tailscaled.count("|")
    assert agent.startswith("| agent | 1,002 | **60.0** (50.0, 70.0, 60.0) |")
    assert "**201** (101, 301, 201)" in agent  # map update p50 of each round: the median of its two
    assert tailscaled.startswith("| tailscaled userspace | 1,002 | **50.0** (60.0, 40.0, 50.0) |")
    goals = scale.goals(rounds)
    assert goals[0].startswith("RSS ≤ tailscaled's: missed (61.0 against 51.0")
    assert goals[1].startswith("map update (CPU per update) ≤ tailscaled's: met (5.0 against 5.0")
    assert goals[2].startswith("setup p50 ≤ tailscaled's: missed (3.0 against 2.0")


def test_a_round_whose_cpu_figure_was_lost_shows_a_dash_and_stays_out_of_the_median() -> None:
    lost = {**_side(50, 100, 2), "cpu_per_update_ms": 0.0}
    rounds = [{"agent": lost, "tailscaled": _side(60, 200, 3)},
              {"agent": {**_side(50, 100, 2), "cpu_per_update_ms": 9.0}, "tailscaled": _side(60, 200, 3)}]
    agent = scale.size_table(rounds)[2]
    assert "**9.0** (-, 9.0)" in agent
    assert scale.goals(rounds)[1].startswith("map update (CPU per update) ≤ tailscaled's: missed (9.0 against 5.0")
    assert scale.goals(rounds[:1])[1].endswith("not measured (no round gave the figure for both)")


def test_a_stopped_runs_progress_lines_give_its_rounds_with_medians_only() -> None:
    side = {"peers": 1002, "rss": [70.0, 80.0], "update_p50": 3000.0, "cpu_update": 600.0, "setup_p50": 12.0}
    line = json.dumps({"size": 1000, "round": 0, "load": 3.2, "agent": side, "tailscaled": side,
                       "trace": {}, "stream": {}})
    rounds = scale.rounds_from_log(f"1000 peers registered in 92 s\n{line}\nregistered 1500\n")
    assert len(rounds) == 1 and rounds[0]["size"] == 1000 and rounds[0]["loadavg"] == 3.2
    figures = scale.side_figures(rounds[0]["agent"])
    assert (figures["rss_after"], figures["update_p50"], figures["setup_p50"]) == (80.0, 3000.0, 12.0)
    assert figures["setup_p99"] != figures["setup_p99"]  # unknown: NaN
    assert scale.size_table(rounds)[2].endswith("| **12.0** (12.0) | - |")
