"""The interop driver's pure parts: which cells, how a junit report becomes a reason, the table."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from hack import interop, versions


def test_the_matrix_covers_each_range_against_the_newest_of_the_other() -> None:
    full = [(c.headscale, c.tailscale) for c in interop.cells(quick=False)]
    newest_hs, newest_ts = versions.HEADSCALE_RANGE[-1], versions.TAILSCALE_RANGE[-1]
    assert {(hs, newest_ts) for hs in versions.HEADSCALE_RANGE} <= set(full)
    assert {(newest_hs, ts) for ts in versions.TAILSCALE_RANGE} <= set(full)
    assert len(full) == len(set(full)) == len(versions.HEADSCALE_RANGE) + len(versions.TAILSCALE_RANGE) - 1
    quick = [(c.headscale, c.tailscale) for c in interop.cells(quick=True)]
    assert quick == [(versions.HEADSCALE_RANGE[0], newest_ts), (newest_hs, versions.TAILSCALE_RANGE[0])]


def test_failures_and_skips_become_reasons(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text("""<?xml version="1.0"?><testsuites><testsuite>
      <testcase name="test_ok"/>
      <testcase name="test_bad"><failure message="AssertionError: 3 != 4&#10;more">trace</failure></testcase>
      <testcase name="test_old"><skipped message="tailscaled 1.80.3 closes both directions"/></testcase>
    </testsuite></testsuites>""")
    tests, reasons = interop._reasons(junit)
    assert tests == 3
    assert reasons == ["test_bad: AssertionError: 3 != 4",
                       "test_old: skipped: tailscaled 1.80.3 closes both directions"]


def test_the_table_replaces_only_the_marked_block(tmp_path: Path) -> None:
    doc = tmp_path / "compatibility.md"
    doc.write_text(f"# title\n\nprose\n\n{interop.BEGIN}\nold table\n{interop.END}\n\nafter\n")
    cells = [interop.Cell("0.26.1", "1.98.10", status="pass", tests=9, seconds=95.4),
             interop.Cell("0.29.2", "1.80.3", status="fail", tests=9, failures=["test_x: boom | bang"], seconds=120)]
    text = interop.table(cells, started=dt.datetime(2026, 11, 30, 16, 0, tzinfo=dt.UTC), wall=215.4, quick=False)
    interop.write(doc, text)
    written = doc.read_text()
    assert written.startswith("# title\n\nprose\n\n") and written.endswith("\n\nafter\n")
    assert "old table" not in written
    assert "| 0.26.1 | 1.98.10 | pass | 9 | 95 s | - |" in written
    assert "| 0.29.2 | 1.80.3 | fail | 9 | 120 s | test_x: boom \\| bang |" in written
    assert "2026-11-30 16:00 UTC" in written and "3.6 min" in written
    assert "| 0.30.0 | - | not run |" in written
