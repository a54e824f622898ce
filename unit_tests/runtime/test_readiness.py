"""/readyz with leader election: a standby with synced caches is Ready, a leader only while it
renews its Lease (docs/decisions.md, "High availability")."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tailnet_agent.contract.clock import FakeClock
from tailnet_operator.runtime.errors import AlreadyExists, Conflict, NotFound
from tailnet_operator.runtime.kinds import Resource
from tailnet_operator.runtime.leaderelection import LeaderElectionConfig, LeaderElectionUnhealthy, LeaderElector

JSON = dict[str, Any]


class Leases:
    """An in-memory Lease API with resourceVersion checks (a LeaseClient)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], JSON] = {}
        self.version = 0

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON:
        try:
            return copy.deepcopy(self.objects[(namespace or "", name)])
        except KeyError:
            raise NotFound(404, "NotFound", f"lease {name}") from None

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        key = (namespace or body["metadata"].get("namespace", ""), body["metadata"]["name"])
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        return self._store(key, body)

    async def replace(self, resource: Resource, body: JSON) -> JSON:
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        current = self.objects.get(key)
        if current is None:
            raise NotFound(404, "NotFound", "gone")
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "changed")
        return self._store(key, body)

    def _store(self, key: tuple[str, str], body: JSON) -> JSON:
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"] = {**stored["metadata"], "namespace": key[0], "resourceVersion": str(self.version)}
        self.objects[key] = stored
        return copy.deepcopy(stored)


def _elector(leases: Leases, clock: FakeClock, identity: str) -> LeaderElector:
    return LeaderElector(leases, name="tailnet-operator", namespace="tailnet-system",
                         config=LeaderElectionConfig(identity=identity), clock=clock)


async def test_a_standby_is_ready_and_a_leader_only_while_it_renews() -> None:
    leases, clock = Leases(), FakeClock()
    leader, standby = _elector(leases, clock, "a"), _elector(leases, clock, "b")
    leading = asyncio.create_task(leader.run())
    try:
        await asyncio.wait_for(leader.wait_leading(), timeout=5)
        leader.check_ready()
        campaign = asyncio.create_task(standby.run())
        try:
            for _ in range(100):  # let the standby read the Lease once (no clock time passes)
                if standby.leader:
                    break
                await asyncio.sleep(0)
            assert standby.leader == "a" and not standby.is_leader
            standby.check_ready()

            # The leader's renewals stall (its loop has not run) past the renew deadline.
            clock.advance(LeaderElectionConfig().renew_deadline + 1)
            with pytest.raises(LeaderElectionUnhealthy, match="not renewed"):
                leader.check_ready()
            standby.check_ready()
            leader.check_health()  # liveness tolerates more: the process is not restarted yet
        finally:
            campaign.cancel()
            await asyncio.gather(campaign, return_exceptions=True)
    finally:
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
