"""The failover benchmark's section, written from a run's document."""

from __future__ import annotations

from benchmarks import failover


def test_the_section_gives_medians_every_sample_and_who_took_over() -> None:
    samples = [{"way": "crash", "round": 0, "lease_s": 16.0, "reconciled_s": 16.3, "taken_by": "the standby"},
               {"way": "delete", "round": 1, "lease_s": 0.4, "reconciled_s": 0.7, "taken_by": "the standby"},
               {"way": "crash", "round": 2, "lease_s": 17.0, "reconciled_s": 17.5, "taken_by": "the restarted leader"},
               {"way": "delete", "round": 3, "lease_s": 0.6, "reconciled_s": 0.9, "taken_by": "the standby"},
               {"way": "crash", "round": 4, "lease_s": 15.5, "reconciled_s": 15.9, "taken_by": "the standby"}]
    doc = {"date": "2026-12-02", "commit": "abc1234", "kubernetes": "1.36.3", "lease_duration_s": 15, "rounds": 3,
           "loadavg_before": (0.1, 0.2, 0.3), "loadavg_after": (0.4, 0.5, 0.6), "samples": samples}

    text = failover.section(doc)

    assert text.startswith("## Operator failover, 2026-12-02, commit abc1234 (Helm chart defaults, local node")
    assert "lease duration of 15 s" in text and "0.1, 0.2, 0.3 at the start, 0.4, 0.5, 0.6 at the end" in text
    assert (f"| {failover.WAYS['crash']} | 16.0 | 16.3 | 16.0 / 16.3, 17.0 / 17.5, 15.5 / 15.9 "
            "| the restarted leader, the standby |") in text
    assert f"| {failover.WAYS['delete']} | 0.5 | 0.8 | 0.4 / 0.7, 0.6 / 0.9 | the standby |" in text
