"""hack.interop: a cell whose tests fail is run once more, and a flake stays visible."""

from __future__ import annotations

import datetime

import pytest

from hack import interop
from hack.interop import Cell


@pytest.fixture
def second_run(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """The outcome the next run_cell gives (status, failures)."""
    queued: list[tuple[str, list[str]]] = []

    def fake(cell: Cell) -> Cell:
        cell.status, cell.failures = queued.pop(0)
        cell.tests, cell.seconds = 9, 10.0
        return cell

    monkeypatch.setattr(interop, "run_cell", fake)
    return queued


def failed_cell() -> Cell:
    return Cell("0.29.2", "1.80.3", status="fail", tests=9, failures=["test_x[derp]: TimeoutError"], seconds=70.0)


def test_a_pass_on_the_second_run_is_flaky_and_keeps_the_first_failure(second_run: list[tuple[str, list[str]]]) -> None:
    second_run.append(("pass", []))
    cell = failed_cell()

    interop.rerun_flaky(cell)

    assert cell.status == "flaky"
    assert cell.failures == ["failed on a first run, passed on a second: test_x[derp]: TimeoutError"]
    assert cell.seconds == 80.0
    assert "| flaky |" in interop.table([cell], started=datetime.datetime(2026, 1, 1), wall=1.0, quick=True)


def test_a_second_failure_stays_a_failure(second_run: list[tuple[str, list[str]]]) -> None:
    second_run.append(("fail", ["test_x[derp]: TimeoutError"]))
    cell = failed_cell()

    interop.rerun_flaky(cell)

    assert cell.status == "fail"
    assert cell.failures == ["test_x[derp]: TimeoutError", "second run: test_x[derp]: TimeoutError"]
