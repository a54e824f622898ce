"""The egress benchmark's section, against the userspace peer and against the kernel-mode one."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import egress
from benchmarks.paths import COLUMNS, PathResult


def _doc(names: list[str], *, kernel_peer: bool) -> dict[str, object]:
    results = []
    for k, name in enumerate(names):
        result = PathResult(name)
        for column in COLUMNS:
            result.add(column, 10.0 * (k + 1))
        result.setup_p50_ms, result.setup_p99_ms = 1.0, 2.0
        result.extra = {"rss_ready_kib": 1024, "rss_after_kib": 2048, "rss_100_connections_kib": 3072,
                        "path_after": f"{name} checked"}
        results.append(result)
    return {"date": "2026-12-08", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10", "rounds": 3,
            "mib": 32, "setups": 200, "loadavg_before": (0.5, 0.4, 0.3), "loadavg_after": (1.5, 1.0, 0.6),
            "kernel_peer": kernel_peer, "results": [asdict(r) for r in results]}


def test_against_the_kernel_mode_peer_the_section_has_its_own_heading_and_only_direct_rows() -> None:
    text = egress.section(_doc(["tailscaled userspace, direct", "agent, direct"], kernel_peer=True))
    assert text.startswith("### Egress against a kernel-mode peer, 2026-12-08, commit abc1234")
    assert "TUN device" in text and "DERP only" not in text
    assert "| direct | 2.00 | 2.00 | 2.00 | 2.00 |" in text
    assert "| DERP |" not in text
    assert "- agent, direct: agent, direct checked" in text


def test_against_the_userspace_peer_the_section_is_the_egress_one() -> None:
    text = egress.section(_doc(["tailscaled userspace, DERP", "tailscaled userspace, direct", "agent, DERP",
                                "agent, direct"], kernel_peer=False))
    assert text.startswith("## Egress, 2026-12-08, commit abc1234")
    assert "| DERP | 3.00 | 3.00 | 3.00 | 3.00 |" in text and "| direct | 2.00 | 2.00 | 2.00 | 2.00 |" in text
