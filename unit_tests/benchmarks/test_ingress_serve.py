"""The ingress benchmark's section, written from a run's document."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import ingress_serve
from benchmarks.ingress_serve import AGENT, CPU_COLUMNS, SERVE, HttpPath, Load
from benchmarks.paths import COLUMNS, PathResult


def http_path(name: str, rps: tuple[float, ...]) -> HttpPath:
    path = HttpPath(name, "tcp:127.0.0.1:1", "web.bench.test", False)
    for clients in ingress_serve.CONCURRENCY:
        path.runs[clients] = [Load(clients, 6.0, int(r * 6), r, 1.0, 2.0) for r in rps]
        path.cpu[clients] = [dict.fromkeys(CPU_COLUMNS, 0.1) for _ in rps]
    return path


def test_the_section_carries_conditions_checked_paths_tables_and_every_round() -> None:
    bulk = PathResult("agent tcp expose")
    for column in COLUMNS:
        for value in (50.0, 70.0, 60.0, 80.0):
            bulk.add(column, value)
    doc = {"date": "2026-12-02", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10",
           "settings": {"seconds": 6.0, "rounds": 3, "mib": 32, "body_bytes": 256},
           "loadavg_before": [0.2, 0.3, 0.4], "loadavg_after": [1.2, 0.8, 0.5], "cpus": 2,
           "path_before": {"agent": "agent before"}, "path_after": {"agent": "agent after"},
           "http": [asdict(http_path("agent tcp expose -> HTTP backend (no TLS)", (900.0, 1100.0, 1000.0)))],
           "bulk": [asdict(bulk)], "rss_after_kib": {AGENT: 65 * 1024, SERVE: 300 * 1024},
           "serve_https_probe": "refused"}

    text = ingress_serve.section(doc)

    assert text.startswith("### Ingress against tailscale serve, 2026-12-02, commit abc1234 (Headscale 0.29.2")
    assert "0.2, 0.3, 0.4 at the start, 1.2, 0.8, 0.5 at the end of the measurements, on 2 CPUs" in text
    assert "- agent: before: agent before; after: agent after" in text
    assert "| agent tcp expose -> HTTP backend (no TLS) | 1000 | 1.00 | 2.00 | 1000 | 1.00 | 2.00 |" in text
    assert "- agent tcp expose -> HTTP backend (no TLS): 900, 1100, 1000" in text, "every round at 32 clients"
    assert "| agent tcp expose | 65.0 | 65.0 | 65.0 | 65.0 |" in bulk_table_of(text), "medians of the bulk rounds"
    assert "| agent tcp expose | 50.0, 70.0, 60.0, 80.0 |" in text, "every bulk sample"
    assert "agent 65 MiB, the serve node's tailscaled 300 MiB" in text and text.endswith("refused")


def bulk_table_of(text: str) -> str:
    return text.partition("| tcp expose, bulk | 1 stream up MB/s")[2]
