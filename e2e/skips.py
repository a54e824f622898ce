"""Which skipped tests a run may have.

A test that cannot run here skips with its reason, and the run ends with a summary of every
skip. Two kinds of reason:

* the machine lacks something (root, nftables, network namespaces, the local node's
  prerequisites): another machine would run the test;
* by design (:func:`skip_by_design`): no machine runs it in this configuration, such as a
  tailscaled version without the feature under test, or a cluster that does not enforce
  NetworkPolicy.

With ``$TAILNET_NO_SKIPS=1`` (``.ci/run`` sets it where it runs as root and has installed every
prerequisite) a skip of the first kind fails the run: the machine could have run that test.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import NoReturn

import pytest

NO_SKIPS_ENV = "TAILNET_NO_SKIPS"
BY_DESIGN = "by design: "


def skip_by_design(reason: str) -> NoReturn:
    """Skip a test that no machine runs in this configuration (``$TAILNET_NO_SKIPS`` allows it)."""
    pytest.skip(BY_DESIGN + reason)


def reason_of(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (``pytest.skip``, a ``skipif`` mark)."""
    longrepr = report.longrepr
    message = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return message.removeprefix("Skipped: ")


def summary(reports: Iterable[pytest.TestReport]) -> list[str]:
    """One line per reason: how many tests skipped for it, and the reason."""
    counts = collections.Counter(reason_of(r) for r in reports)
    return [f"{count:4d} skipped: {reason}" for reason, count in sorted(counts.items(), key=lambda kv: -kv[1])]


def unexpected(reports: Iterable[pytest.TestReport]) -> list[str]:
    """The skips a machine with every prerequisite must not have: ``node id: reason``."""
    return [f"{r.nodeid}: {reason_of(r)}" for r in reports if not reason_of(r).startswith(BY_DESIGN)]


def account(session: pytest.Session, reporter: pytest.TerminalReporter, environ: Mapping[str, str]) -> None:
    """Print every skip's reason; with ``$TAILNET_NO_SKIPS=1`` fail the run on a skip that this
    machine could have run."""
    skipped = [r for r in reporter.stats.get("skipped", []) if isinstance(r, pytest.TestReport)]
    if not skipped:
        return
    reporter.write_line("skip summary:\n" + "\n".join(summary(skipped)), yellow=True)
    bad = unexpected(skipped)
    if environ.get(NO_SKIPS_ENV) == "1" and bad:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter.write_line(f"SKIPPED BUT RUNNABLE (${NO_SKIPS_ENV}=1: this machine has every prerequisite):\n  "
                            + "\n  ".join(bad), red=True)
