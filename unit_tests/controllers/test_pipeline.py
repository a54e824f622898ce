"""The tagged-node pipeline, through the worked example of docs/runtime.md (:mod:`.example_node`):
the phases' order and stops, the applier's pruning, and the one way a spec is reported invalid."""

from __future__ import annotations

import copy
from typing import Any

from tailnet_operator.controllers.kinds import TAILNET_EGRESS
from tailnet_operator.names import FINALIZER
from tailnet_operator.runtime import CONFIG_MAP, SECRET, Applier, Request, Result
from tailnet_operator.types import JSON

from .example_node import note_reconciler
from .harness import NAMESPACE, World

OWNING = '{"tagOwners": {"tag:egress-db": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
TARGETS = [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]},
           {"name": "audit", "address": "198.18.1.11", "ports": [{"port": 5432}]}]


class NoteWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.notes = note_reconciler(self.deps, Applier(self.kube, self.kube, field_manager="example-notes"))

    async def reconcile_notes(self) -> Result:
        return await self.notes.reconcile(Request(NAMESPACE, "db"))

    def add_cr(self, **spec: Any) -> JSON:
        body = {"tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
                "targets": TARGETS, **spec}
        return self.kube.add(TAILNET_EGRESS, {"metadata": {"name": "db", "namespace": NAMESPACE}, "spec": body})

    def cr(self) -> JSON:
        obj = self.kube.get(TAILNET_EGRESS, "db", NAMESPACE)
        assert obj is not None
        return obj

    def ready(self) -> JSON:
        return next(c for c in self.cr()["status"]["conditions"] if c["type"] == "Ready")


async def world(policy: str = OWNING) -> NoteWorld:
    w = NoteWorld()
    w.bootstrap_secret()
    w.add_tailnet()
    await w.reconcile_tailnet()
    w.headscale.policy = policy
    return w


async def test_the_example_gets_a_key_its_objects_and_its_status() -> None:
    w = await world()
    w.add_cr()

    await w.reconcile_notes()

    assert (w.ready()["reason"], w.ready()["message"]) == ("Noted", "2 note(s)")
    assert {c["type"] for c in w.cr()["status"]["conditions"]} == {"Ready", "TagOwned", "PreAuthKeyValid"}
    assert w.kube.get(CONFIG_MAP, "db-ledger", NAMESPACE) is not None
    assert w.kube.get(SECRET, "db-note-key", NAMESPACE) is not None
    assert FINALIZER in w.cr()["metadata"]["finalizers"]
    assert len(w.headscale.preauth_keys) == 1


async def test_a_target_removed_from_the_spec_loses_its_object_and_nothing_else_is_pruned() -> None:
    w = await world()
    w.add_cr()
    w.kube.add(CONFIG_MAP, {"metadata": {"name": "db-unowned", "namespace": NAMESPACE}, "data": {}})
    await w.reconcile_notes()
    obj = copy.deepcopy(w.cr())
    obj["spec"]["targets"] = TARGETS[:1]
    w.kube.update(TAILNET_EGRESS, obj)

    await w.reconcile_notes()

    assert w.kube.get(CONFIG_MAP, "db-audit", NAMESPACE) is None
    assert w.kube.get(CONFIG_MAP, "db-ledger", NAMESPACE) is not None
    assert w.kube.get(CONFIG_MAP, "db-unowned", NAMESPACE) is not None, "only what the CR owns is pruned"


async def test_a_tag_the_policy_does_not_own_stops_before_the_key() -> None:
    w = await world('{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    w.add_cr()

    result = await w.reconcile_notes()

    assert (w.ready()["status"], w.ready()["reason"]) == ("False", "TagNotOwned")
    assert result.requeue_after is not None
    assert w.headscale.preauth_keys == {} and w.kube.get(CONFIG_MAP, "db-ledger", NAMESPACE) is None


async def test_an_invalid_spec_names_every_field_at_fault_and_is_not_retried() -> None:
    w = await world()
    w.add_cr(tag="not-a-tag", targets=[{"name": "Bad_Name", "address": "198.18.1.10", "ports": []}])

    result = await w.reconcile_notes()

    ready = w.ready()
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.tag" in ready["message"] and "spec.targets" in ready["message"], ready["message"]
    assert not result.requeue_after and w.headscale.preauth_keys == {}


async def test_a_missing_tailnet_and_no_working_key_are_reported_and_retried() -> None:
    w = NoteWorld()
    w.add_cr()
    await w.reconcile_notes()
    assert w.ready()["reason"] == "TailnetNotFound"

    w.add_tailnet()  # no bootstrap Secret: the Tailnet never gets a working key
    result = await w.reconcile_notes()

    assert (w.ready()["status"], w.ready()["reason"]) == ("Unknown", "WaitingForAccess")
    assert result.requeue_after == 10.0


async def test_deleting_expires_the_key_and_lets_go() -> None:
    w = await world()
    w.add_cr()
    await w.reconcile_notes()
    [key] = w.headscale.preauth_keys.values()

    await w.kube.delete(TAILNET_EGRESS, "db", NAMESPACE)
    await w.reconcile_notes()

    assert not w.headscale.preauth_live(key["key"])
    assert w.kube.get(TAILNET_EGRESS, "db", NAMESPACE) is None
    assert "PreAuthKeyExpired" in w.events.reasons
