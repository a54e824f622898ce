"""Issue 24, the ingress's stable name: once a restarted agent's node is online, the reconciler
deletes the ingress's older offline nodes and renames the new one to ``spec.hostname`` (the
fake Headscale refuses a name another node holds, as Headscale does)."""

from __future__ import annotations

from tailnet_operator.runtime import Resource
from tailnet_operator.runtime.kinds import DEPLOYMENT
from tailnet_operator.types import JSON

from .test_ingress import TENANT, IngressWorld, registered, world_with_tailnet


def _generation(node_id: str, key_id: str, *, name: str, online: bool, created: str) -> JSON:
    return {**registered(node_id, key_id, name=name), "online": online, "createdAt": created}


async def _restarted(world: IngressWorld, *, old_online: bool) -> str:
    """An ingress whose agent restarted: its old node (7) still holds the hostname, the new one (9)
    registered with the same key after it and got a suffixed name."""
    world.add_ingress()
    await world.reconcile_ingress()
    key_id = next(iter(world.headscale.preauth_keys))
    world.headscale.nodes = [
        _generation("7", key_id, name="shop-gw", online=old_online, created="2026-01-01T00:00:00Z"),
        _generation("9", key_id, name="shop-gw-x1y2z3", online=True, created="2026-01-01T00:05:00Z")]
    return key_id


async def test_a_restarted_agents_node_gets_the_hostname_once_its_old_node_is_offline() -> None:
    """Issue 24: the superseded node is deleted first (Headscale refuses a name another node
    holds), then the new one is renamed to spec.hostname, each with a Normal Event."""
    world = await world_with_tailnet()
    await _restarted(world, old_online=False)

    await world.reconcile_ingress()

    assert [n["id"] for n in world.headscale.nodes] == ["9"]
    assert world.headscale.nodes[0]["givenName"] == "shop-gw"
    calls = [c for c in world.headscale.calls if "/api/v1/node/" in c]
    assert calls == ["DELETE /api/v1/node/7", "POST /api/v1/node/9/rename/shop-gw"]
    assert world.events.reasons[-2:] == ["SupersededNodeDeleted", "NodeRenamed"]
    assert "node 7 (shop-gw, offline)" in world.events.notes[-2]
    assert "from shop-gw-x1y2z3 to shop-gw" in world.events.notes[-1]
    assert world.obj()["status"]["node"]["name"] == "shop-gw"
    assert (world.cond("HostnameAssigned")["status"], world.cond("HostnameAssigned")["reason"]) == \
        ("True", "Assigned")

    calls_before = list(world.headscale.calls)
    await world.reconcile_ingress()
    assert not [c for c in world.headscale.calls[len(calls_before):] if c.startswith(("DELETE", "POST /api/v1/node"))]


async def test_while_the_old_node_is_online_neither_is_touched() -> None:
    """A rollout's old pod is still draining: its node is the ingress until it goes."""
    world = await world_with_tailnet()
    await _restarted(world, old_online=True)

    await world.reconcile_ingress()

    assert [n["givenName"] for n in world.headscale.nodes] == ["shop-gw", "shop-gw-x1y2z3"]
    assert not [c for c in world.headscale.calls if c.startswith(("DELETE /api/v1/node", "POST /api/v1/node"))]
    assert world.cond("HostnameAssigned")["reason"] == "HostnameTaken"
    assert "SupersededNodeDeleted" not in world.events.reasons and "NodeRenamed" not in world.events.reasons


async def test_a_hostname_held_by_a_node_of_no_key_of_the_ingress_is_not_taken() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    key_id = next(iter(world.headscale.preauth_keys))
    world.headscale.nodes = [
        {"id": "3", "name": "shop-gw", "givenName": "shop-gw", "ipAddresses": ["100.64.0.3"], "online": False},
        _generation("9", key_id, name="shop-gw-x1y2z3", online=True, created="2026-01-01T00:05:00Z")]

    await world.reconcile_ingress()

    assert [n["givenName"] for n in world.headscale.nodes] == ["shop-gw", "shop-gw-x1y2z3"]
    assert not [c for c in world.headscale.calls if c.startswith(("DELETE /api/v1/node", "POST /api/v1/node"))]
    cond = world.cond("HostnameAssigned")
    assert cond["reason"] == "HostnameTaken" and "shop-gw (node 3, offline)" in cond["message"]


async def test_a_refused_rename_is_retried_by_the_next_reconcile_and_reported_meanwhile() -> None:
    world = await world_with_tailnet()
    await _restarted(world, old_online=False)
    world.headscale.refuse["POST /api/v1/node/9/rename/shop-gw"] = (500, 2, "database is locked")

    await world.reconcile_ingress()

    assert [n["id"] for n in world.headscale.nodes] == ["9"], "the superseded node went all the same"
    assert world.cond("HostnameAssigned")["reason"] == "HostnameTaken"
    assert "NodeRenamed" not in world.events.reasons

    del world.headscale.refuse["POST /api/v1/node/9/rename/shop-gw"]
    await world.reconcile_ingress()

    assert world.headscale.nodes[0]["givenName"] == "shop-gw"
    assert world.cond("HostnameAssigned")["reason"] == "Assigned"
    assert world.events.reasons[-1] == "NodeRenamed"



async def test_a_hand_over_sends_both_renames_back_to_back_and_writes_its_events_after() -> None:
    """Issue 24: between the two renames of a hand-over no node carries the name, and a peer whose
    map update falls in that moment cannot resolve it; nothing else (an Event's write to the API
    server) may lengthen it."""
    world = await world_with_tailnet()
    await _restarted(world, old_online=True)
    deployment = world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT)
    assert deployment is not None
    generation = deployment["metadata"].get("generation", 1)
    world.kube.update(DEPLOYMENT, {**deployment, "status": {  # the new pod ready, the old one terminating
        "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}})
    seen_at_event: list[list[str]] = []
    create = world.events.create

    async def recording(resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        seen_at_event.append([c for c in world.headscale.calls if c.startswith("POST /api/v1/node/")])
        return await create(resource, body, namespace)

    world.events.create = recording  # type: ignore[method-assign]

    await world.reconcile_ingress()

    renames = ["POST /api/v1/node/9/rename/shop-gw-x1y2z3",  # answered after a batch: the hand-over follows it
               "POST /api/v1/node/7/rename/shop-gw-old7", "POST /api/v1/node/9/rename/shop-gw"]
    assert [c for c in world.headscale.calls if c.startswith("POST /api/v1/node/")] == renames
    assert [n["givenName"] for n in world.headscale.nodes] == ["shop-gw-old7", "shop-gw"]
    assert world.events.reasons[-2:] == ["NodeRenamed", "NodeRenamed"]
    assert seen_at_event[-2:] == [renames, renames], "an Event was written between the two renames"
