"""A benchmark row's path claim against what both of its nodes report, and the egress section
written from a run's document."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, cast

import pytest

from benchmarks import agent_profile, egress, pathcheck
from benchmarks.paths import COLUMNS, PathResult
from hack.localenv import TailscaleNode


class FakeNode:
    """Stands in for a tailscaled: its hostname and its peer entries, as ``tailscale status`` gives them."""

    def __init__(self, hostname: str, peers: list[dict[str, Any]]) -> None:
        self.hostname = hostname
        self._peers = peers

    def peers(self) -> list[dict[str, Any]]:
        return self._peers


def node(hostname: str, *peers: dict[str, Any]) -> TailscaleNode:
    return cast(TailscaleNode, FakeNode(hostname, list(peers)))


def test_a_peer_with_a_current_address_is_direct_one_with_only_a_relay_is_derp() -> None:
    client = node("client", {"HostName": "server", "CurAddr": "127.0.0.1:41641", "Relay": "999"},
                  {"HostName": "relayed", "CurAddr": "", "Relay": "999"}, {"HostName": "silent"})
    assert pathcheck.peer_path(client, "server") == "direct 127.0.0.1:41641"
    assert pathcheck.peer_path(client, "relayed") == "DERP 999"
    assert pathcheck.peer_path(client, "silent") == "none"
    assert pathcheck.peer_path(client, "absent") == "none"


def test_a_row_whose_either_end_reports_another_path_fails_the_run() -> None:
    server = node("server", {"HostName": "client", "CurAddr": "", "Relay": "999"})
    client = node("client", {"HostName": "server", "CurAddr": "127.0.0.1:41641"})
    with pytest.raises(pathcheck.PathNotAsClaimed, match="server: the row claims direct, the node reports DERP"):
        pathcheck.tailscaled_check(client, server, pathcheck.DIRECT)()
    with pytest.raises(pathcheck.PathNotAsClaimed, match="client: the row claims DERP"):
        pathcheck.tailscaled_check(client, server, pathcheck.DERP)()
    both = node("server", {"HostName": "client", "CurAddr": "127.0.0.1:5555"})
    assert pathcheck.tailscaled_check(client, both, pathcheck.DIRECT)() == (
        "client: direct 127.0.0.1:41641; server: direct 127.0.0.1:5555")


def test_the_egress_section_carries_the_runs_conditions_every_sample_and_the_checked_paths() -> None:
    results = []
    for name, scale in (("tailscaled userspace, direct", 1.0), ("agent, direct", 2.0)):
        result = PathResult(name)
        for column in COLUMNS:
            for value in (10.0, 30.0, 20.0):
                result.add(column, value * scale)
        result.setup_p50_ms, result.setup_p99_ms = 2.0, 3.0
        result.extra = {"rss_ready_kib": 1024, "rss_after_kib": 2048, "rss_100_connections_kib": 3072,
                        "path_after": f"{name}: direct 127.0.0.1:1"}
        results.append(result)
    doc = {"date": "2026-12-02", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10", "rounds": 3,
           "mib": 32, "setups": 200, "loadavg_before": (0.5, 0.4, 0.3), "loadavg_after": (1.5, 1.0, 0.6),
           "results": [asdict(r) for r in results]}

    text = egress.section(doc)

    assert text.startswith("## Egress, 2026-12-02, commit abc1234 (Headscale 0.29.2")
    assert "0.5, 0.4, 0.3 at the start, 1.5, 1.0, 0.6 at the end" in text
    assert "| agent, direct | 40.0 | 40.0 | 40.0 | 40.0 | 2.0 | 3.0 |" in text, "medians"
    assert "| direct | 2.00 | 2.00 | 2.00 | 2.00 |" in text, "the ratio row"
    assert "| agent, direct | 20.0, 60.0, 40.0 |" in text, "every sample, in round order"
    assert "| tailscaled userspace, direct | 1.0 | 2.0 | 3.0 |" in text, "RSS in MiB"
    assert "- agent, direct: agent, direct: direct 127.0.0.1:1" in text


def test_the_profile_section_carries_conditions_limits_and_checked_paths() -> None:
    cpu = {"measured": {"user_s": 0.1, "system_s": 0.1}, "tailscaled peer": {"user_s": 0.2, "system_s": 0.0},
           "client (this process)": {"user_s": 0.05, "system_s": 0.0}, "sink": {"user_s": 0.05, "system_s": 0.0}}
    doc = {"date": "2026-12-02", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10", "mib": 64,
           "streams": 1, "tools": {"perf": True, "strace": False, "py-spy": True},
           "load_before": (0.5, 0.4, 0.3), "load_after": (1.0, 0.6, 0.4),
           "limits": {"loopback_tcp_one_stream_mbs": 4245.0, "chacha20poly1305_1420b_mbs_per_core": 1013.0,
                      "chacha20poly1305_64kib_mbs_per_core": 3309.0},
           "path_before": {"agent, direct": "udp both ways"}, "path_after": {"agent, direct": "still"},
           "paths": {"agent, direct": {"up": {"plain": {"mbs": 128.1, "seconds": 0.5, "cpu": cpu}}}}}

    text = agent_profile.section(doc)

    assert text.startswith("### Where the agent's time goes, 2026-12-02, commit abc1234 (Headscale 0.29.2")
    assert "profilers present: perf, py-spy." in text and "0.5, 0.4, 0.3 at the start, 1.0, 0.6, 0.4 at the end" in text
    assert "4,245 MB/s" in text and "1,013 MB/s for 1,420-byte" in text
    assert "- agent, direct: before: udp both ways; after: still" in text
    assert "| agent, direct, up | 128.1 | 3.1 (1.6 + 1.6) | 3.1 | 1.6 | 40% |" in text
