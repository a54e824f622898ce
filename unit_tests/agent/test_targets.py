"""The targets file followed while the agent runs: diffs by name, reloads on a content change,
a malformed file keeping the targets in force (on a fake clock, no sleeping)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

from tailnet_agent.contract.clock import FakeClock
from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.targets import TargetsWatcher, diff_targets


def t(name: str, address: str, *ports: int) -> Target:
    return Target(name=name, address=address, ports=tuple(PortMapping(port=p, listen=p) for p in ports))


def doc(*targets: Target) -> str:
    return json.dumps([{"name": x.name, "address": x.address, "ports": [m.port for m in x.ports]} for x in targets])


def test_diff_by_name_address_and_ports() -> None:
    a, c, d = t("a", "100.64.0.2", 80), t("c", "100.64.0.3", 81), t("d", "100.64.0.4", 82)
    b, c2 = t("b", "100.64.0.5", 83), t("c", "100.64.0.3", 84)
    diff = diff_targets((a, c, d), (a, b, c2))
    assert (diff.added, diff.removed, diff.changed, diff.unchanged) == ((b,), (d,), (c2,), (a,))
    assert not diff.empty
    assert diff_targets((a, c), (c, a)).empty  # order alone changes nothing


def write_like_kubelet(directory: Path, text: str) -> None:
    """Kubelet's atomic writer: a fresh ``..<stamp>`` directory, ``..data`` swapped by rename."""
    stamp = directory / f"..{os.urandom(4).hex()}"
    stamp.mkdir()
    (stamp / "targets.json").write_text(text)
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp.name)
    tmp.rename(directory / "..data")
    if not (directory / "targets.json").is_symlink():
        (directory / "targets.json").symlink_to("..data/targets.json")


class Recorder:
    def __init__(self) -> None:
        self.applied: list[tuple[Target, ...]] = []
        self.reports: list[str | None] = []

    async def apply(self, targets: tuple[Target, ...]) -> None:
        self.applied.append(targets)


async def step(clock: FakeClock, watcher: TargetsWatcher[Target]) -> None:
    """One poll: wait until the watcher sleeps, move the clock past its interval, let it run."""
    await clock.wait_for_sleepers()
    clock.advance(watcher.interval)
    await clock.wait_for_sleepers()


async def test_reload_on_swap_malformed_keeps_old_and_reports_once(tmp_path: Path) -> None:
    first = doc(t("a", "100.64.0.2", 80))
    write_like_kubelet(tmp_path, first)

    clock, rec = FakeClock(), Recorder()
    watcher = TargetsWatcher(tmp_path / "targets.json", rec.apply, clock=clock,
                             initial_digest=hashlib.sha256(first.encode()).hexdigest(), report=rec.reports.append)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watcher.run())
        await step(clock, watcher)
        assert rec.applied == [] and rec.reports == []  # unchanged file: nothing to do

        write_like_kubelet(tmp_path, doc(t("a", "100.64.0.2", 80), t("b", "100.64.0.3", 443)))
        await step(clock, watcher)
        assert [x.name for x in rec.applied[-1]] == ["a", "b"]
        assert rec.reports == [None] and watcher.state.error is None and watcher.state.reloads == 1

        write_like_kubelet(tmp_path, '[{"name": "a", "address": "100.64.0.2"}]')
        await step(clock, watcher)
        await step(clock, watcher)
        assert len(rec.applied) == 1, "a malformed file applies nothing"
        assert watcher.state.error == "TAILNET_TARGETS_FILE[0] (a): ports must be a non-empty list"
        assert rec.reports == [None, watcher.state.error], "reported once, not every poll"

        write_like_kubelet(tmp_path, "[]")
        await step(clock, watcher)
        assert watcher.state.error is not None and "is empty" in watcher.state.error and len(rec.applied) == 1

        write_like_kubelet(tmp_path, doc(t("b", "100.64.0.3", 443)))
        await step(clock, watcher)
        assert [x.name for x in rec.applied[-1]] == ["b"] and watcher.state.error is None
        assert rec.reports[-1] is None and watcher.state.errors == 2
        task.cancel()


async def test_a_missing_file_is_an_error_not_an_empty_list(tmp_path: Path) -> None:
    clock, rec = FakeClock(), Recorder()
    watcher = TargetsWatcher(tmp_path / "absent.json", rec.apply, clock=clock, report=rec.reports.append)
    assert not await watcher.check()
    assert rec.applied == [] and rec.reports[0] is not None and "cannot read" in rec.reports[0]


