"""The finalizers' shared cleanup (skip annotation, bound, a hanging Headscale) and the orphan sweep,
on the fake client and the fake Headscale."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from prometheus_client import CollectorRegistry

from tailnet_operator.controllers.cleanup import SKIP_CLEANUP_ANNOTATION, Cleanup, skip_cleanup
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS, TAILNET_INGRESS
from tailnet_operator.controllers.sweep import OrphanSweeper, SweepMetrics, references, references_from
from tailnet_operator.headscale import installation_tag
from tailnet_operator.runtime import SECRET, Request
from tailnet_operator.runtime.testing import FakeClient
from tailnet_operator.types import JSON

from .harness import NAMESPACE
from .test_ingress import TENANT, IngressWorld, world_with_tailnet


def _annotate(world: IngressWorld, value: str = "true") -> None:
    obj = world.obj()
    obj["metadata"].setdefault("annotations", {})[SKIP_CLEANUP_ANNOTATION] = value
    world.kube.update(TAILNET_INGRESS, obj)


def test_only_true_skips() -> None:
    assert skip_cleanup({"metadata": {"annotations": {SKIP_CLEANUP_ANNOTATION: "True "}}})
    assert not skip_cleanup({"metadata": {"annotations": {SKIP_CLEANUP_ANNOTATION: "yes"}}})
    assert not skip_cleanup({"metadata": {}})


async def test_the_annotation_lets_an_ingress_go_at_once_without_touching_headscale() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    key = world.stored_key()
    _annotate(world)
    world.headscale.down = "connect"  # it would otherwise retry for five minutes
    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)
    calls = len(world.headscale.calls)

    await world.reconcile_ingress()

    assert world.kube.get(TAILNET_INGRESS, "shop", TENANT) is None
    assert len(world.headscale.calls) == calls, "no request was made"
    assert world.headscale.preauth_live(key)
    assert world.events.reasons[-1] == "CleanupSkipped"


async def test_the_annotation_lets_a_tailnet_go_and_keeps_its_working_key() -> None:
    world = await world_with_tailnet()
    working = world.working_key()
    obj = world.tailnet_obj()
    obj["metadata"]["annotations"] = {SKIP_CLEANUP_ANNOTATION: "true"}
    world.kube.update(TAILNET, obj)
    await world.kube.delete(TAILNET, "tn")

    await world.reconcile_tailnet()

    assert world.kube.get(TAILNET, "tn") is None
    assert world.headscale.live(working) and world.events.reasons[-1] == "CleanupSkipped"


async def test_a_cleanup_that_hangs_is_cut_off_and_given_up_after_the_bound() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)
    obj = world.obj()
    cleanup = Cleanup(world.deps.events, world.clock, attempt_timeout=0.05)

    async def hang() -> None:
        await asyncio.Event().wait()

    again = await cleanup.run(obj, hang, what="pre-auth key x", reason="PreAuthKeyNotExpired", hint="by hand")
    assert again is not None and again.requeue_after == 10.0

    world.clock.advance(timedelta(minutes=5, seconds=1).total_seconds())
    assert await cleanup.run(obj, hang, what="pre-auth key x", reason="PreAuthKeyNotExpired", hint="by hand") is None
    assert world.events.reasons[-1] == "PreAuthKeyNotExpired"


async def test_the_sweep_expires_the_key_and_deletes_the_node_of_a_gone_ingress_and_nothing_else() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    world.add_ingress("cart", tag="tag:ingress-cart", hostname="cart-gw")
    world.headscale.policy = ('{"tagOwners": {"tag:ingress-shop": [], "tag:ingress-cart": []}, '
                              '"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    await world.reconcile_ingress()
    await world.reconcile_ingress("cart")
    keys = {k["aclTags"][0]: k for k in world.headscale.preauth_keys.values()}
    marker = installation_tag(world.tailnet_obj()["metadata"]["uid"])
    assert keys["tag:ingress-shop"]["aclTags"] == ["tag:ingress-shop", marker]
    created = keys["tag:ingress-shop"]["createdAt"]
    # nodes as Headscale lists them: each registered with its CR's key; one nobody made
    for node_id, tag, key in (("1", "tag:ingress-shop", keys["tag:ingress-shop"]),
                              ("2", "tag:ingress-cart", keys["tag:ingress-cart"])):
        world.headscale.nodes.append({"id": node_id, "name": f"n{node_id}", "tags": [tag, marker],
                                      "createdAt": created, "preAuthKey": {"id": key["id"]}})
    world.headscale.preauth_keys["99"] = {"id": "99", "key": "hskey-auth-aaaaaaaaaaaa-x", "reusable": True,
                                          "ephemeral": True, "aclTags": ["tag:ingress-shop"],
                                          "expiration": "2099-01-01T00:00:00Z", "createdAt": created}
    world.headscale.nodes.append({"id": "3", "name": "theirs", "tags": ["tag:ingress-shop"], "createdAt": created,
                                  "preAuthKey": {"id": "99"}})

    _annotate(world)
    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)
    await world.reconcile_ingress()  # skipped: the key and the node stay behind
    assert world.kube.get(TAILNET_INGRESS, "shop", TENANT) is None

    registry = CollectorRegistry()
    sweeper = OrphanSweeper(world.deps, metrics=SweepMetrics(registry=registry))
    result = await sweeper.reconcile(Request("", "tn"))
    assert not sweeper.last, "younger than the grace period: nothing yet"
    assert result.requeue_after == 600.0

    world.clock.advance(timedelta(minutes=11).total_seconds())
    await sweeper.reconcile(Request("", "tn"))

    assert [k.id for k in sweeper.last.keys] == [keys["tag:ingress-shop"]["id"]]
    assert [n.id for n in sweeper.last.nodes] == ["1"]
    assert world.headscale.preauth_keys[keys["tag:ingress-shop"]["id"]].get("expired")
    assert not world.headscale.preauth_keys[keys["tag:ingress-cart"]["id"]].get("expired")
    assert not world.headscale.preauth_keys["99"].get("expired")
    assert [n["id"] for n in world.headscale.nodes] == ["2", "3"]
    assert world.events.reasons[-1] == "OrphansSwept"
    assert registry.get_sample_value("tailnet_operator_orphans_swept_total", {"kind": "preauthkey"}) == 1
    assert registry.get_sample_value("tailnet_operator_orphans_swept_total", {"kind": "node"}) == 1

    await sweeper.reconcile(Request("", "tn"))
    assert not sweeper.last, "an expired key is no orphan: a second sweep finds nothing"


async def test_the_sweep_deletes_an_ephemeral_node_offline_past_stale_after_even_with_a_live_tag() -> None:
    """Headscale forgets to age out an ephemeral node offline across its own restart; the sweep
    deletes such a node once offline for ``stale_after``, and never an online one or another's."""
    world = await world_with_tailnet()
    world.add_ingress()
    world.headscale.policy = ('{"tagOwners": {"tag:ingress-shop": []}, '
                              '"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    await world.reconcile_ingress()
    [key] = world.headscale.preauth_keys.values()
    marker = installation_tag(world.tailnet_obj()["metadata"]["uid"])
    seen = key["createdAt"]
    for node_id, online, tags in (("1", False, ["tag:ingress-shop", marker]), ("2", True, ["tag:ingress-shop", marker]),
                                  ("3", False, ["tag:ingress-shop"])):
        world.headscale.nodes.append({"id": node_id, "name": f"n{node_id}", "tags": tags, "online": online,
                                      "createdAt": seen, "lastSeen": seen, "preAuthKey": {"id": key["id"]}})
    sweeper = OrphanSweeper(world.deps, stale_after=timedelta(minutes=5))

    world.clock.advance(timedelta(minutes=4).total_seconds())
    await sweeper.reconcile(Request("", "tn"))
    assert not sweeper.last, "offline for less than stale_after: left to Headscale"

    world.clock.advance(timedelta(minutes=2).total_seconds())
    await sweeper.reconcile(Request("", "tn"))

    assert [n.id for n in sweeper.last.nodes] == ["1"] and not sweeper.last.keys
    assert [n["id"] for n in world.headscale.nodes] == ["2", "3"]


def test_references_keep_a_secret_without_owner_and_drop_one_whose_cr_is_gone() -> None:
    notes = {"tailnet.dev/key-id": "1", "tailnet.dev/previous-key-id": "2", "tailnet.dev/tag": "tag:a"}
    secrets: list[JSON] = [
        {"metadata": {"name": "a", "annotations": notes, "ownerReferences": [{"uid": "u1"}]}},
        {"metadata": {"name": "b", "annotations": {**notes, "tailnet.dev/key-id": "3",
                                                   "tailnet.dev/previous-key-id": ""},
                      "ownerReferences": [{"uid": "gone"}]}},
        {"metadata": {"name": "c", "annotations": {**notes, "tailnet.dev/key-id": "4"}}},
        {"metadata": {"name": "working", "annotations": {"tailnet.dev/key-id": "5"}}},
    ]
    crs = [{"metadata": {"uid": "u1"}, "spec": {"tag": "tag:a"}},
           {"metadata": {"uid": "gone", "deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"tag": "tag:b"}}]
    refs = references(secrets, crs)
    assert refs.key_ids == {"1", "2", "4"} and refs.tags == {"tag:a"}
    assert SECRET.kind == "Secret"


def test_the_sweep_counts_only_the_crs_and_key_secrets_of_its_own_tailnet() -> None:
    """Another Tailnet's CRs (another installation's, or this cluster's other Headscale) keep no key
    or tag alive here, nor does a TailnetEgress outside the operator's namespace (never acted on)."""
    kube = FakeClient()
    crs = {
        "mine": kube.add(TAILNET_INGRESS, _cr("mine", TENANT, "tn", "tag:ingress-mine")),
        "theirs": kube.add(TAILNET_INGRESS, _cr("theirs", TENANT, "other", "tag:ingress-theirs")),
        "egress": kube.add(TAILNET_EGRESS, _cr("egress", NAMESPACE, "tn", "tag:egress-mine")),
        "stray": kube.add(TAILNET_EGRESS, _cr("stray", TENANT, "tn", "tag:egress-stray")),
    }
    for name, cr in crs.items():
        kube.add(SECRET, {"metadata": {
            "name": f"{name}-auth-key", "namespace": cr["metadata"]["namespace"],
            "labels": {"app.kubernetes.io/managed-by": "tailnet-operator", "tailnet.dev/tailnet": "tn"},
            "annotations": {"tailnet.dev/key-id": f"id-{name}", "tailnet.dev/tag": cr["spec"]["tag"]},
            "ownerReferences": [{"uid": cr["metadata"]["uid"]}]}})
    for name, tailnet in (("gw-mine", "tn"), ("gw-theirs", "other")):  # key Secrets with no owner
        kube.add(SECRET, {"metadata": {
            "name": name, "namespace": "tailnet-gateway",
            "labels": {"app.kubernetes.io/managed-by": "tailnet-operator", "tailnet.dev/tailnet": tailnet},
            "annotations": {"tailnet.dev/key-id": f"id-{name}", "tailnet.dev/tag": "tag:gw"}}})

    refs = references_from(kube, "tn", NAMESPACE)

    assert refs.key_ids == {"id-mine", "id-egress", "id-gw-mine"}
    assert refs.tags == {"tag:ingress-mine", "tag:egress-mine"}


def _cr(name: str, namespace: str, tailnet: str, tag: str) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": tag}}
