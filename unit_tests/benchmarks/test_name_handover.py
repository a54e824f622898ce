"""The name hand-over benchmark's pure parts: the refused window of a trial and the table."""

from __future__ import annotations

from benchmarks.name_handover import WAYS, section, window


def test_the_window_covers_the_failures_from_the_first_rename_on() -> None:
    samples = [(0.0, 0.01, False),  # before the trial: not its own
               (1.0, 1.01, True), (1.10, 1.12, False), (1.20, 1.30, False), (1.4, 1.41, True)]
    assert window(samples, since=1.0) == (2, 200.0)
    assert window(samples, since=1.5) == (0, 0.0)


def test_the_table_has_a_row_per_way_and_counts_only_the_trials_that_were_hit() -> None:
    def trial(way: str, renames_s: float, resent: bool, refused: int, window_ms: float) -> dict[str, object]:
        return {"way": way, "holder": "a", "renames_s": renames_s, "resent": resent, "refused": refused,
                "window_ms": window_ms}

    trials = [trial("one after the other", 0.504, False, 0, 0.0), trial("one after the other", 0.506, False, 12, 640.0),
              trial("together", 0.255, True, 0, 0.0), trial("together, after a batch", 0.9, False, 0, 0.0)]
    text = section({"trials": trials, "ways": list(WAYS), "count": 2, "loadavg": [[1, 1, 1], [2, 1, 1]],
                    "date": "2026-12-07", "commit": "abc1234", "headscale": "0.29.2", "tailscale": "1.98.10"})
    assert "| one after the other | 2 | 1 | 12 | 640.0 | 640.0 | 505.0 | 0 |" in text
    assert "| together | 1 | 0 | 0 | - | - | 255.0 | 1 |" in text
    assert "| together, after a batch | 1 | 0 | 0 | - | - | 900.0 | 0 |" in text
    assert "commit abc1234" in text
