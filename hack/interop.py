"""The interop matrix: a focused slice of the e2e suite for each Headscale and tailscale pair.

Cells: every Headscale of ``versions.HEADSCALE_RANGE`` with the newest tailscale, and every
tailscale of ``versions.TAILSCALE_RANGE`` with the newest Headscale. ``--quick`` (CI) runs only
the oldest of each range (the newest pair is already in ``make test``). Each cell is one pytest
process of :data:`SELECTION` with ``$TAILNET_HEADSCALE_VERSION`` / ``$TAILNET_TAILSCALE_VERSION``
set, so every fixture starts those binaries (built on demand, cached by version). A version that
cannot be built is a failed cell whose reason is the build's error.

The results table (date, versions, pass/fail with the reason, wall time per cell and in total) is
written between the markers of ``docs/compatibility.md`` (or ``--output``) by the run itself.

Usage: ``python -m hack.interop [--quick] [--output PATH] [--cell HEADSCALE:TAILSCALE ...]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from hack import binaries, versions

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- interop-results:begin -->", "<!-- interop-results:end -->"
CELL_TIMEOUT = 1200.0
"""Seconds one cell may take (pytest's own deadlines are far shorter; this only stops a hang)."""

SELECTION = (
    "e2e/test_interop.py",
    "e2e/test_tailnet_reconciler.py::test_working_key_is_minted_used_and_rotated_old_key_expired_only_after",
    "e2e/test_policy_reconciler.py::test_a_route_advertised_before_its_site_existed_is_approved_and_carries_traffic",
)
"""The slice: key calls, grants or their condition, the capability check, agent -> tailscaled egress
over DERP and direct (test_interop); Tailnet key mint and rotate; policy apply and a site route."""

NOT_BUILDABLE = {
    "0.30.0": "no release to build: the Go module proxy answers 403 'This module version is not available' for "
              "github.com/juanfont/headscale v0.30.0 and v0.30.0-beta.1, and GOPROXY=direct cannot reach the "
              "repository; the client's 0.30 behaviour is covered by unit tests written from its sources",
}


@dataclass
class Cell:
    headscale: str
    tailscale: str
    status: str = "not run"
    tests: int = 0
    failures: list[str] = field(default_factory=list)
    """Why a test failed or was skipped (a pass may carry skips: a known limitation of that pair)."""
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.headscale}:{self.tailscale}"


def cells(*, quick: bool) -> list[Cell]:
    newest_hs, newest_ts = versions.HEADSCALE_RANGE[-1], versions.TAILSCALE_RANGE[-1]
    if quick:
        return [Cell(versions.HEADSCALE_RANGE[0], newest_ts), Cell(newest_hs, versions.TAILSCALE_RANGE[0])]
    matrix = [Cell(hs, newest_ts) for hs in versions.HEADSCALE_RANGE]
    matrix += [Cell(newest_hs, ts) for ts in versions.TAILSCALE_RANGE[:-1]]
    return matrix


def _ready(cell: Cell) -> bool:
    return (binaries.at_version(binaries.HEADSCALE, cell.headscale).is_built()
            and binaries.at_version(binaries.TAILSCALE, cell.tailscale).is_built())


def _next(pending: list[Cell], *, wait: float) -> Cell:
    """The first pending cell whose binaries are cached, waiting up to ``wait`` s for one; else the first."""
    deadline = time.monotonic() + wait
    while True:
        ready = next((c for c in pending if _ready(c)), None)
        if ready is not None or time.monotonic() >= deadline:
            return ready or pending[0]
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


def _build(cell: Cell) -> str:
    """Build the cell's binaries; "" when ready, else the reason they are not."""
    for pinned, version in ((binaries.HEADSCALE, cell.headscale), (binaries.TAILSCALE, cell.tailscale)):
        try:
            binaries.build(binaries.at_version(pinned, version))
        except (RuntimeError, binaries.MissingToolError) as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            return f"{pinned.name} {version} did not build: {lines[-1] if lines else exc}"
    return ""


def _reasons(junit: Path) -> tuple[int, list[str]]:
    tree = ET.parse(junit)
    tests, failures = 0, []
    for case in tree.iter("testcase"):
        tests += 1
        for outcome in ("failure", "error", "skipped"):
            node = case.find(outcome)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                first = (message[0] if message else outcome).removeprefix("Skipped: ")
                label = "skipped: " if outcome == "skipped" else ""
                failures.append(f"{case.get('name')}: {label}{first[:300]}")
    return tests, failures


def run_cell(cell: Cell) -> Cell:
    started = time.monotonic()
    print(f"interop: {cell.name}: building what is missing", file=sys.stderr, flush=True)
    reason = _build(cell)
    if reason:
        cell.status, cell.failures = "fail", [reason]
        cell.seconds = time.monotonic() - started
        return cell
    built = time.monotonic()
    env = {**os.environ, binaries.VERSION_ENV["headscale"]: cell.headscale,
           binaries.VERSION_ENV["tailscale"]: cell.tailscale}
    with tempfile.TemporaryDirectory(prefix="interop-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *SELECTION, "-q", "-p", "no:cacheprovider", "-m", "not cluster",
               f"--junitxml={junit}"]
        print(f"interop: {cell.name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CELL_TIMEOUT)
        except subprocess.TimeoutExpired:
            cell.status, cell.failures = "fail", [f"the cell did not finish within {CELL_TIMEOUT:.0f}s"]
            cell.seconds = time.monotonic() - built
            return cell
        cell.tests, cell.failures = _reasons(junit) if junit.exists() else (0, [])
        if proc.returncode != 0 and not cell.failures:
            tail = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-3:]
            cell.failures = [f"pytest exited {proc.returncode}: {' / '.join(tail)}"]
        cell.status = "pass" if proc.returncode == 0 and cell.tests else "fail"
        if cell.status == "fail":
            print(proc.stdout[-6000:], file=sys.stderr)
    cell.seconds = time.monotonic() - built
    return cell


def rerun_flaky(cell: Cell) -> None:
    """Run a cell whose tests failed once more: a pass then makes it ``flaky``, and the table keeps
    the first run's failures, so a flake is seen (and counted as a pass) but never hidden; a second
    failure keeps it ``fail``. Build failures are never re-run."""
    first = list(cell.failures)
    again = run_cell(Cell(cell.headscale, cell.tailscale))
    if again.status == "pass":
        cell.status, cell.tests = "flaky", again.tests
        cell.failures = [f"failed on a first run, passed on a second: {'; '.join(first)}", *again.failures]
    else:
        cell.failures = [*first, f"second run: {'; '.join(again.failures) or again.status}"]
    cell.seconds += again.seconds


def table(results: list[Cell], *, started: dt.datetime, wall: float, quick: bool, finished: bool = True) -> str:
    done = sum(c.status != "not run" for c in results)
    progress = "" if finished else f" (in progress: {done} of {len(results)} cells so far)"
    lines = [
        f"Run of {started:%Y-%m-%d %H:%M} UTC ({'quick: the oldest of each range' if quick else 'full matrix'}), "
        f"{len(results)} cells, wall time {wall / 60:.1f} min{progress}, building included (a cell's own time "
        "excludes building its binaries). Each cell runs the same "
        f"{len(SELECTION)}-module slice (`hack/interop.py` SELECTION).",
        "",
        "| Headscale | tailscale | result | tests | time | reason (failures, and skips for a known limitation) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in results:
        reason = "; ".join(cell.failures).replace("|", "\\|") or "-"
        lines.append(f"| {cell.headscale} | {cell.tailscale} | {cell.status} | {cell.tests} | "
                     f"{cell.seconds:.0f} s | {reason} |")
    for version, why in NOT_BUILDABLE.items():
        lines.append(f"| {version} | - | not run | 0 | - | {why} |")
    return "\n".join(lines)


def write(path: Path, text: str) -> None:
    current = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in current or END not in current:
        current += f"\n{BEGIN}\n{END}\n"
    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.interop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the oldest of each range (CI)")
    parser.add_argument("--output", type=Path, help="where the table goes (default docs/compatibility.md; "
                                                     "_artifacts/interop-quick.md with --quick)")
    parser.add_argument("--cell", action="append", default=[], metavar="HEADSCALE:TAILSCALE",
                        help="run only these cells (repeatable)")
    parser.add_argument("--wait-for-builds", type=float, default=0.0, metavar="SECONDS",
                        help="when no remaining cell's binaries are cached, wait up to this long for a build "
                             "running elsewhere (python -m hack.binaries build ...) before building here")
    args = parser.parse_args(argv)
    chosen = cells(quick=args.quick)
    if args.cell:
        chosen = [Cell(*spec.split(":", 1)) for spec in args.cell]
    output = args.output or (ROOT / "_artifacts" / "interop-quick.md" if args.quick else DOC)
    started, clock = dt.datetime.now(dt.UTC), time.monotonic()
    # Cells whose binaries are cached run first, so that builds still running elsewhere overlap
    # with tests (--wait-for-builds: how long to wait for one before building it here); the table
    # keeps the matrix order.
    # The table is rewritten after every cell, so a run stopped part way leaves what it found
    # (the cells it did not reach say "not run").
    pending = list(chosen)
    while pending:
        cell = _next(pending, wait=args.wait_for_builds)
        pending.remove(cell)
        run_cell(cell)
        if cell.status == "fail" and cell.tests:
            rerun_flaky(cell)
        print(f"interop: {cell.name}: {cell.status} ({cell.tests} tests, {cell.seconds:.0f}s)"
              + (f": {'; '.join(cell.failures)}" if cell.failures else ""), file=sys.stderr, flush=True)
        write(output, table(chosen, started=started, wall=time.monotonic() - clock, quick=args.quick,
                            finished=not pending))
    wall = time.monotonic() - clock
    results = chosen
    text = table(results, started=started, wall=wall, quick=args.quick)
    write(output, text)
    print(text)
    passed = sum(c.status in ("pass", "flaky") for c in results)
    flaky = [c.name for c in results if c.status == "flaky"]
    print(f"interop: {passed} passed{f' ({len(flaky)} only on a second run: {flaky})' if flaky else ''}, "
          f"{len(results) - passed} failed ({wall:.0f}s) -> {output}", file=sys.stderr)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
