"""The in-cluster ingress benchmark's pure parts: the server pod's script, the objects, the section."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import ingress_incluster
from benchmarks.paths import COLUMNS, PathResult
from tailnet_operator.resources.agent import DEFAULT_RESOURCES


def test_the_server_script_runs_paths_py_serve_on_every_address() -> None:
    script = ingress_incluster.server_script(9000)
    assert "sys.argv = ['paths.py', 'serve', '0.0.0.0', '9000']" in script
    compile(script, "server", "exec")


def test_the_ingress_exposes_the_sink_service_over_tcp() -> None:
    obj = ingress_incluster.ingress_object("bench")
    assert obj["spec"]["exposes"] == [{"name": "sink", "port": 9000, "backend": {"service": "sink", "port": 9000}}]
    assert obj["spec"]["tag"] == ingress_incluster.INGRESS_TAG


def test_the_agents_address_is_read_once_the_ingress_is_ready() -> None:
    status = {"node": {"addresses": ["fd7a:115c:a1e0::1", "100.64.0.7"]},
              "conditions": [{"type": "Ready", "status": "False"}]}
    assert ingress_incluster.node_address({"status": status}) is None
    status["conditions"] = [{"type": "Ready", "status": "True"}]
    assert ingress_incluster.node_address({"status": status}) == "100.64.0.7"
    assert ingress_incluster.node_address({}) is None


def test_the_section_sets_the_agent_beside_the_kernel_mode_proxy() -> None:
    results = []
    for name, scale in ((ingress_incluster.AGENT, 1.0), (ingress_incluster.KERNEL, 2.0)):
        result = PathResult(name)
        for column in COLUMNS:
            for value in (10.0, 30.0, 20.0):
                result.add(column, value * scale)
        result.setup_p50_ms, result.setup_p99_ms = 2.0, 4.0
        result.extra = {"rss_ready_kib": 1024, "rss_after_kib": 2048, "path_after": f"{name} checked"}
        results.append(result)
    doc = {"date": "2026-12-08", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10",
           "resources": DEFAULT_RESOURCES, "tailscaled_gomemlimit": "235929KiB", "rounds": 3, "mib": 32,
           "setups": 200, "loadavg_before": (0.5, 0.4, 0.3), "loadavg_after": (1.5, 1.0, 0.6),
           "kernel_rules": ["-A PREROUTING -d 100.64.0.9/32 -j DNAT --to-destination 198.19.128.20"],
           "results": [asdict(r) for r in results]}

    text = ingress_incluster.section(doc)

    assert text.startswith("### Ingress in the cluster, 2026-12-08, commit abc1234 (local node")
    assert "0.5, 0.4, 0.3 at the start, 1.5, 1.0, 0.6 at the end" in text
    assert f"| {ingress_incluster.AGENT} | 20.0 | 20.0 | 20.0 | 20.0 | 2.0 | 4.0 | 1.0 | 2.0 |" in text
    assert f"- agent / {ingress_incluster.KERNEL}: one stream up 0.50" in text
    assert "setup p50 1.00, p99 1.00; pod RSS ready 1.00, after 1.00." in text
    assert f"| {ingress_incluster.KERNEL} | 20.0, 60.0, 40.0 |" in text
    assert "    -A PREROUTING -d 100.64.0.9/32 -j DNAT --to-destination 198.19.128.20" in text
    assert f"- {ingress_incluster.KERNEL}: {ingress_incluster.KERNEL} checked" in text
