"""The in-cluster egress benchmark's equal limits and the section it writes from a run's document."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks import egress_incluster
from benchmarks.paths import COLUMNS, PathResult
from tailnet_operator.resources.agent import DEFAULT_RESOURCES


def test_tailscaled_gets_a_go_memory_limit_under_the_agents_memory_limit() -> None:
    assert egress_incluster.go_memory_limit(DEFAULT_RESOURCES) == f"{256 * 1024 * 9 // 10}KiB"
    assert egress_incluster.go_memory_limit({"limits": {"memory": "1Gi"}}) == f"{1024 * 1024 * 9 // 10}KiB"
    assert egress_incluster.go_memory_limit({"requests": {"memory": "64Mi"}}) is None
    with pytest.raises(ValueError, match="'300M'"):
        egress_incluster.go_memory_limit({"limits": {"memory": "300M"}})


def test_the_tailscaled_pod_carries_the_resources_it_is_given_and_gomemlimit() -> None:
    class Headscale:
        url = "https://headscale.example.internal"

        class ca_bundle:
            @staticmethod
            def read_text() -> str:
                return "CA"

    objects = egress_incluster.tailscaled_objects("ns", "ref", Headscale(), "key", DEFAULT_RESOURCES)  # type: ignore[arg-type]
    container = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == DEFAULT_RESOURCES
    assert {"name": "GOMEMLIMIT", "value": egress_incluster.go_memory_limit(DEFAULT_RESOURCES)} in container["env"]


def test_the_section_carries_conditions_limits_ratios_samples_and_checked_paths() -> None:
    results = []
    for name, scale in ((egress_incluster.AGENT, 2.0), (egress_incluster.TAILSCALED, 1.0)):
        result = PathResult(name)
        for column in COLUMNS:
            for value in (10.0, 30.0, 20.0):
                result.add(column, value * scale)
        result.setup_p50_ms, result.setup_p99_ms = 2.0 * scale, 4.0 * scale
        result.extra = {"rss_ready_kib": 1024, "rss_after_kib": 2048, "path_after": f"{name} checked"}
        results.append(result)
    doc = {"date": "2026-12-02", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10",
           "resources": DEFAULT_RESOURCES, "tailscaled_gomemlimit": "235929KiB", "rounds": 3, "mib": 32,
           "setups": 200, "loadavg_before": (0.5, 0.4, 0.3), "loadavg_after": (1.5, 1.0, 0.6),
           "first_byte_s": 7.1, "first_byte_milestones_s": {"agent_pod_ready": 7.0},
           "results": [asdict(r) for r in results]}

    text = egress_incluster.section(doc)

    assert text.startswith("## Egress in the cluster, 2026-12-02, commit abc1234 (local node, Headscale 0.29.2")
    assert '"limits": {"memory": "256Mi"}' in text and "GOMEMLIMIT=235929KiB" in text
    assert "0.5, 0.4, 0.3 at the start, 1.5, 1.0, 0.6 at the end" in text
    assert f"| {egress_incluster.AGENT} | 40.0 | 40.0 | 40.0 | 40.0 | 4.0 | 8.0 | 1.0 | 2.0 |" in text
    assert "one stream up 2.00" in text and "setup p50 2.00, p99 2.00" in text
    assert f"| {egress_incluster.TAILSCALED} | 10.0, 30.0, 20.0 |" in text, "every sample, in round order"
    assert "first byte echoed through it: 7.1 s** (on the way, s after creation, 1 s resolution: agent pod " \
        "ready 7.0)" in text
    assert f"- {egress_incluster.AGENT}: {egress_incluster.AGENT} checked" in text


def test_the_section_sets_the_agent_beside_both_tailscaled_pods_and_prints_the_kernel_pods_rules() -> None:
    results = []
    for name, scale in ((egress_incluster.AGENT, 2.0), (egress_incluster.TAILSCALED, 1.0),
                        (egress_incluster.KERNEL, 4.0)):
        result = PathResult(name)
        for column in COLUMNS:
            result.add(column, 10.0 * scale)
        result.setup_p50_ms, result.setup_p99_ms = 2.0 * scale, 4.0 * scale
        result.extra = {"rss_ready_kib": 1024 * scale, "rss_after_kib": 2048 * scale, "path_after": "checked"}
        results.append(result)
    doc = {"date": "2026-12-08", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10",
           "resources": DEFAULT_RESOURCES, "tailscaled_gomemlimit": "235929KiB", "rounds": 3, "mib": 32,
           "setups": 200, "loadavg_before": (0.5, 0.4, 0.3), "loadavg_after": (1.5, 1.0, 0.6),
           "first_byte_s": 7.1, "first_byte_milestones_s": {"agent_pod_ready": 7.0},
           "kernel_rules": ["-A PREROUTING ! -i tailscale0 -j DNAT --to-destination 198.18.7.2"],
           "results": [asdict(r) for r in results]}

    text = egress_incluster.section(doc)

    assert f"| {egress_incluster.KERNEL} | 40.0 | 40.0 | 40.0 | 40.0 | 8.0 | 16.0 | 4.0 | 8.0 |" in text
    assert (f"- agent / {egress_incluster.KERNEL}: one stream up 0.50, one stream down 0.50, eight streams up "
            "0.50, eight streams down 0.50; setup p50 0.50, p99 0.50; pod RSS ready 0.50, after 0.50.") in text
    assert f"- agent / {egress_incluster.TAILSCALED}: one stream up 2.00" in text
    assert "    -A PREROUTING ! -i tailscale0 -j DNAT --to-destination 198.18.7.2" in text
    assert text.index(f"agent / {egress_incluster.KERNEL}") < text.index(f"agent / {egress_incluster.TAILSCALED}")
