"""A run lists every skip with its reason, and with ``$TAILNET_NO_SKIPS=1`` fails on a skip the
machine could have run (only skips by design pass)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from e2e import skips


def skipped(nodeid: str, reason: str) -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {}, "skipped", ("f.py", 1, f"Skipped: {reason}"), "call")


@dataclass
class Reporter:
    stats: dict[str, list[Any]]
    lines: list[str] = field(default_factory=list)

    def write_line(self, line: str, **markup: bool) -> None:
        self.lines.append(line)


@dataclass
class Session:
    exitstatus: int | pytest.ExitCode = pytest.ExitCode.OK


def run(reports: list[pytest.TestReport], environ: dict[str, str]) -> tuple[Session, Reporter]:
    session, reporter = Session(), Reporter({"skipped": list(reports)})
    skips.account(cast(pytest.Session, session), cast(pytest.TerminalReporter, reporter), environ)
    return session, reporter


def test_every_skip_is_summed_up_by_reason() -> None:
    reports = [skipped("a", "needs root"), skipped("b", "needs root"), skipped("c", skips.BY_DESIGN + "old")]
    assert skips.summary(reports) == ["   2 skipped: needs root", f"   1 skipped: {skips.BY_DESIGN}old"]
    session, reporter = run(reports, {})
    assert session.exitstatus == pytest.ExitCode.OK
    assert "needs root" in reporter.lines[0]


def test_a_runnable_skip_fails_a_run_that_has_every_prerequisite() -> None:
    session, reporter = run([skipped("e2e/t.py::x", "network namespaces unavailable: no ip")],
                            {skips.NO_SKIPS_ENV: "1"})
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert "e2e/t.py::x: network namespaces unavailable" in reporter.lines[-1]


def test_skips_by_design_pass_even_then() -> None:
    session, _ = run([skipped("x", skips.BY_DESIGN + "no NetworkPolicy here")], {skips.NO_SKIPS_ENV: "1"})
    assert session.exitstatus == pytest.ExitCode.OK


def test_skip_by_design_marks_its_reason() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^by design: old tailscaled"):
        skips.skip_by_design("old tailscaled")
