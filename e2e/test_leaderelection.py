"""Leader election against a real kube-apiserver, with short timings.

Timings: lease 3 s, renew deadline 2 s, retry period 0.25 s. A standby that never saw the crash
takes over at most `lease + 2 * 2.2 * retry` = lease + 1.1 s after the leader's last renewal
(it may see that renewal up to one jittered campaign wait late, then waits a full lease, then
up to one more jittered wait), which is inside the protocol bound asserted here,
lease + retry + 1 s = lease + 1.25 s, with 0.15 s left for request latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from hack.localenv import ControlPlane
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.client.config import load
from tailnet_operator.runtime.kinds import LEASE
from tailnet_operator.runtime.leaderelection import (
    LeaderElectionConfig,
    LeaderElectionMetrics,
    LeaderElectionUnhealthy,
    LeaderElector,
)

from .leases import hijack, lease_history
from .polling import eventually

pytestmark = pytest.mark.integration

LEASE_DURATION = 3.0
RENEW_DEADLINE = 2.0
RETRY_PERIOD = 0.25
TAKEOVER_DEADLINE = 30.0
"""How long a test waits for a takeover or a loss before it fails: a deadline for liveness, far
above the lease duration, never a measure of speed."""
NAMESPACE = "default"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
REPO = Path(__file__).resolve().parent.parent


def config(identity: str, **overrides: Any) -> LeaderElectionConfig:
    timings: dict[str, Any] = {"lease_duration": LEASE_DURATION, "renew_deadline": RENEW_DEADLINE,
                               "retry_period": RETRY_PERIOD}
    return LeaderElectionConfig(identity=identity, **(timings | overrides))



async def within(awaitable: Awaitable[None], limit: float) -> float:
    """Await with a deadline; returns the seconds it took."""
    start = time.monotonic()
    async with asyncio.timeout(limit):
        await awaitable
    return time.monotonic() - start


@pytest.fixture
async def client(control_plane: ControlPlane) -> AsyncIterator[Client]:
    async with Client(load(control_plane.kubeconfig)) as c:
        yield c


@pytest.fixture
def lease_name() -> str:
    return f"election-{uuid.uuid4().hex[:8]}"


class Candidates:
    """Electors started as tasks; every task is cancelled at the end of the test."""

    def __init__(self, client: Client, lease_name: str) -> None:
        self.client = client
        self.lease_name = lease_name
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, identity: str, *, client: Client | None = None, registry: CollectorRegistry | None = None,
              **overrides: Any) -> LeaderElector:
        metrics = LeaderElectionMetrics(registry=registry) if registry is not None else None
        elector = LeaderElector(client or self.client, name=self.lease_name, namespace=NAMESPACE,
                                config=config(identity, **overrides), metrics=metrics)
        self.tasks[identity] = asyncio.create_task(elector.run(), name=identity)
        return elector

    async def lease(self) -> dict[str, Any]:
        return await self.client.get(LEASE, self.lease_name, NAMESPACE)

    async def holder(self) -> str:
        try:
            spec = (await self.lease()).get("spec", {})
        except Exception:
            return ""
        return str(spec.get("holderIdentity") or "")

    async def stop_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


@pytest.fixture
async def candidates(client: Client, lease_name: str) -> AsyncIterator[Candidates]:
    group = Candidates(client, lease_name)
    try:
        yield group
    finally:
        await group.stop_all()
        with contextlib.suppress(Exception):
            await client.delete(LEASE, lease_name, NAMESPACE)


async def first_leader(*electors: LeaderElector, timeout: float) -> LeaderElector:
    waits = {asyncio.ensure_future(e.wait_leading()): e for e in electors}
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    assert done, f"nobody led within {timeout}s"
    return waits[next(iter(done))]


# -- configuration ----------------------------------------------------------------------------


def test_defaults_are_controller_runtimes() -> None:
    cfg = LeaderElectionConfig()
    assert (cfg.lease_duration, cfg.renew_deadline, cfg.retry_period) == (15.0, 10.0, 2.0)
    assert re.fullmatch(r".+_[0-9a-f-]{36}", cfg.identity)
    assert cfg.request_timeout == 5.0


@pytest.mark.parametrize(("lease", "renew", "retry"), [(15, 10, 10 / 1.2), (10, 10, 2), (15, 10, 0)])
def test_invalid_timings_are_rejected(lease: float, renew: float, retry: float) -> None:
    with pytest.raises(ValueError):
        LeaderElectionConfig(lease_duration=lease, renew_deadline=renew, retry_period=retry)


# -- against the apiserver --------------------------------------------------------------------


async def test_exactly_one_of_two_leads_and_the_lease_names_it(candidates: Candidates) -> None:
    registries = {"a": CollectorRegistry(), "b": CollectorRegistry()}
    a = candidates.start("candidate-a", registry=registries["a"])
    b = candidates.start("candidate-b", registry=registries["b"])
    leader = await first_leader(a, b, timeout=10)
    standby = b if leader is a else a

    first = (await candidates.lease())["spec"]
    assert first["holderIdentity"] == leader.identity
    assert first["leaseDurationSeconds"] == 3
    assert first["leaseTransitions"] == 0
    assert MICRO_TIME.match(first["acquireTime"]) and MICRO_TIME.match(first["renewTime"])

    # Several renewals later: still one leader, same acquireTime, a newer renewTime.
    deadline = time.monotonic() + 4 * RETRY_PERIOD * 2.2
    while time.monotonic() < deadline:
        assert leader.is_leader and not standby.is_leader
        await asyncio.sleep(RETRY_PERIOD / 2)
    later = (await candidates.lease())["spec"]
    assert later["holderIdentity"] == leader.identity
    assert later["acquireTime"] == first["acquireTime"]
    assert later["renewTime"] > first["renewTime"]
    assert later["leaseTransitions"] == 0
    assert standby.leader == leader.identity

    leader_registry = registries["a" if leader is a else "b"]
    standby_registry = registries["b" if leader is a else "a"]
    labels = {"name": candidates.lease_name}
    assert leader_registry.get_sample_value("leader_election_master_status", labels) == 1
    assert standby_registry.get_sample_value("leader_election_master_status", labels) == 0
    assert standby_registry.get_sample_value("leader_election_slowpath_total", labels) == 0


async def test_a_vanished_leader_is_replaced_after_the_lease_expires(candidates: Candidates) -> None:
    leader = candidates.start("crashing", release_on_cancel=False)
    await within(leader.wait_leading(), 10)
    standby = candidates.start("standby")
    await eventually(lambda: _is(standby.leader, "crashing"), timeout=5, what="standby sees the leader")

    # Stops renewing and writes nothing: a crash, as far as the Lease can tell.
    async with lease_history(candidates.client, candidates.lease_name, NAMESPACE) as history:
        candidates.tasks["crashing"].cancel()
        took = await within(standby.wait_leading(), TAKEOVER_DEADLINE)
        await eventually(lambda: history.holders()[-1] == "standby", what="the takeover in the Lease")

    # A lower bound holds however loaded the machine is: the lease had to expire first.
    assert took >= LEASE_DURATION - RETRY_PERIOD - 0.5, "took over before the lease could have expired"
    assert history.holders() == ["crashing", "standby"], "taken over without a release"
    assert history.specs[-1]["leaseTransitions"] == 1


async def test_a_killed_leader_process_is_replaced_within_lease_plus_retry(
        candidates: Candidates, control_plane: ControlPlane, tmp_path: Path) -> None:
    with leader_process(control_plane, candidates.lease_name, "doomed", tmp_path / "leader.log") as proc:
        await eventually(lambda: _holder_is(candidates, "doomed"), timeout=20, what="the child leads")
        standby = candidates.start("survivor")
        await eventually(lambda: _is(standby.leader, "doomed"), timeout=5, what="standby sees the child")

        async with lease_history(candidates.client, candidates.lease_name, NAMESPACE) as history:
            proc.send_signal(signal.SIGKILL)
            took = await within(standby.wait_leading(), TAKEOVER_DEADLINE)
            assert proc.wait(timeout=5) == -signal.SIGKILL
            await eventually(lambda: history.holders()[-1] == "survivor", what="the takeover in the Lease")

    assert took >= LEASE_DURATION - RETRY_PERIOD - 0.5, "took over before the lease could have expired"
    assert history.holders() == ["doomed", "survivor"]
    assert history.specs[-1]["leaseTransitions"] == 1


async def test_a_graceful_stop_releases_so_the_standby_takes_over_at_once(candidates: Candidates) -> None:
    leader = candidates.start("leaving")
    await within(leader.wait_leading(), 10)
    standby = candidates.start("next")
    await eventually(lambda: _is(standby.leader, "leaving"), timeout=5, what="standby sees the leader")

    async with lease_history(candidates.client, candidates.lease_name, NAMESPACE) as history:
        task = candidates.tasks["leaving"]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not leader.is_leader
        await within(standby.wait_leading(), TAKEOVER_DEADLINE)
        await eventually(lambda: history.holders()[-1] == "next", what="the takeover in the Lease")

    # The leaving leader released the Lease (holder "", as client-go does), so the standby did not
    # have to wait for it to expire; how fast that is on an idle machine is the benchmarks' business.
    assert history.holders() == ["leaving", "", "next"]
    spec = history.specs[-1]
    assert spec["leaseDurationSeconds"] == 3
    assert spec["leaseTransitions"] == 1


async def test_a_leader_that_sees_another_holder_reports_the_loss_at_once(candidates: Candidates) -> None:
    registry = CollectorRegistry()
    leader = candidates.start("hijacked", registry=registry)
    await within(leader.wait_leading(), 10)

    await hijack(candidates.client, candidates.lease_name, NAMESPACE, "usurper")

    await within(leader.wait_lost(), TAKEOVER_DEADLINE)
    assert not leader.is_leader
    await within(candidates.tasks["hijacked"], 1)  # run() returns after a loss
    labels = {"name": candidates.lease_name}
    assert registry.get_sample_value("leader_election_master_status", labels) == 0
    assert (registry.get_sample_value("leader_election_slowpath_total", labels) or 0) >= 1
    assert await candidates.holder() == "usurper", "a lost leader must not write the lease again"


async def test_a_leader_that_cannot_renew_loses_after_the_deadline_and_turns_unhealthy(
        candidates: Candidates, control_plane: ControlPlane) -> None:
    cut_off = Client(load(control_plane.kubeconfig))
    cut_off.open()
    leader = candidates.start("cut-off", client=cut_off, health_tolerance=0.5)
    await within(leader.wait_leading(), 10)
    leader.check_health()

    await cut_off.close()  # every renewal now fails before reaching the apiserver
    took = await within(leader.wait_lost(), TAKEOVER_DEADLINE)
    assert took >= RENEW_DEADLINE - 0.1, "gave up before the renew deadline"
    assert not leader.is_leader

    # The Lease still names us and nobody renews it: /healthz must fail after lease + tolerance.
    async def unhealthy() -> bool:
        try:
            leader.check_health()
        except LeaderElectionUnhealthy:
            return True
        return False

    await eventually(unhealthy, timeout=LEASE_DURATION + 0.5 + 1.0, what="the health check fails")


# -- helpers ------------------------------------------------------------------------------------


async def _is(value: str, expected: str) -> bool:
    return value == expected


async def _holder_is(candidates: Candidates, identity: str) -> bool:
    return await candidates.holder() == identity


@contextlib.contextmanager
def leader_process(control_plane: ControlPlane, lease_name: str, identity: str,
                   log_file: Path) -> Iterator[subprocess.Popen[bytes]]:
    argv = [sys.executable, "-m", "e2e.leader_process", "--kubeconfig", str(control_plane.kubeconfig),
            "--name", lease_name, "--namespace", NAMESPACE, "--identity", identity,
            "--lease-duration", str(LEASE_DURATION), "--renew-deadline", str(RENEW_DEADLINE),
            "--retry-period", str(RETRY_PERIOD)]
    with log_file.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
