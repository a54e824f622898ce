"""The disruption benchmark's tally and table: how lost requests failed, and a node drain's rows
where a run measured it (kind) against the note where it could not (the single local node)."""

from __future__ import annotations

from typing import Any

from benchmarks.disruption import DRAIN, DRAIN_NOTE, table
from e2e.disruption import tally


def test_a_tally_says_how_its_lost_requests_failed_and_counts_the_rest_as_late() -> None:
    samples = [(0.0, 0.1, True), (0.2, 2.2, False), (0.3, 0.31, False), (2.3, 4.4, False), (4.5, 4.6, True)]
    counted = tally(samples, {"hung": 1, "ConnectionError": 1, "wrong answer": 0})
    assert (counted.sent, counted.lost) == (5, 3)
    assert counted.how == {"hung": 1, "ConnectionError": 1, "late": 1}
    assert counted.longest_gap_s == 4.5
    assert tally(samples).how == {}  # a load that does not tell says nothing


def _doc(where: str, disruptions: list[str], how: dict[str, int]) -> dict[str, Any]:
    streams = {"https": {"sent": 100, "lost": sum(how.values()), "longest_gap_s": 2.0, "how": how}}
    rows = [{"subject": "ingress", "replicas": 1, "round": 1, "disruption": what, "shape": "now",
             "streams": streams, "done_s": 10.0, "named_s": 11.0, "loadavg": 1.0} for what in disruptions]
    return {"date": "2026-12-03", "commit": "abc1234", "rounds": 1, "where": where, "disruptions": disruptions,
            "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0], "rss": {}, "rows": rows}


def test_a_run_on_kind_has_drain_rows_and_no_note_saying_a_drain_cannot_be_measured() -> None:
    text = table(_doc("A kind cluster on this machine (3 nodes, 2 of them workers", ["rollout", DRAIN],
                      {"ConnectionError": 2}))
    assert text.count("| ingress | now | 1 |") == 2 and f"| {DRAIN} | https |" in text
    assert DRAIN_NOTE not in text and "not measurable" not in text
    assert "A kind cluster on this machine (3 nodes, 2 of them workers, kube-apiserver" in text
    assert "ingress x1 rollout https (round 1): 2 ConnectionError" in text


def test_a_run_on_the_local_node_says_why_it_has_no_drain_rows() -> None:
    text = table(_doc("The local node (one node", ["rollout"], {}))
    assert DRAIN_NOTE in text and "| ingress | - | - | node drain | not measurable on one node" in text
    assert "How the lost ingress requests failed" not in text


def test_a_run_on_kind_that_left_the_drain_out_says_nothing_of_one_node() -> None:
    """A run on kind told to measure only some disruptions (``--disruptions``) did not measure a
    drain because it was not asked to, not because the cluster has one node."""
    text = table(_doc("A kind cluster on this machine (3 nodes, 2 of them workers", ["rollout"], {}))
    assert DRAIN_NOTE not in text and "not measurable" not in text and "| node drain |" not in text
