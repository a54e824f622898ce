"""The Egress reconciler on the fake client and a fake Headscale: tag pre-check, pre-auth key
lifecycle (rotation order and reasons), owned objects, target changes without a pod restart, and
deletion."""

from __future__ import annotations

import base64
import contextlib
import copy
from datetime import timedelta
from typing import Any

import pytest

from tailnet_operator.controllers.egress import EgressSettings, egress_reconciler
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.headscale import Request as HsRequest
from tailnet_operator.headscale import Response as HsResponse
from tailnet_operator.headscale import installation_tag
from tailnet_operator.names import FINALIZER, auth_key_secret_name
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request, Result, TransportError
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY, POD_DISRUPTION_BUDGET
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World

IMAGE = "localhost/tailnet-operator:test"
OWNING = '{"tagOwners": {"tag:egress-db": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'


class FakeAgent:
    """The agent's /status as a test sets it (None: unreadable)."""

    def __init__(self) -> None:
        self.doc: JSON | None = None

    async def read(self, egress: Any) -> JSON | None:
        return self.doc


class EgressWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.egress = egress_reconciler(
            self.deps, Applier(self.kube, self.kube, field_manager="tailnet-operator-egress"),
            EgressSettings(agent_image=IMAGE), agent_status=self.agent)

    async def reconcile_egress(self, name: str = "db", namespace: str = NAMESPACE) -> Result:
        return await self.egress.reconcile(Request(namespace, name))

    def add_egress(self, name: str = "db", namespace: str = NAMESPACE, **spec: Any) -> JSON:
        body = {"tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
                "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]}], **spec}
        return self.kube.add(TAILNET_EGRESS, {"metadata": {"name": name, "namespace": namespace}, "spec": body})

    def egress_obj(self, name: str = "db") -> JSON:
        obj = self.kube.get(TAILNET_EGRESS, name, NAMESPACE)
        assert obj is not None
        return obj

    def cond(self, type_: str, name: str = "db") -> JSON:
        return next((c for c in self.egress_obj(name).get("status", {}).get("conditions") or []
                     if c["type"] == type_), {})

    def stored_key(self, name: str = "db") -> str:
        secret = self.kube.get(SECRET, auth_key_secret_name("TailnetEgress", name), NAMESPACE)
        assert secret is not None
        return base64.b64decode(secret["data"]["authKey"]).decode()

    def edit_spec(self, **spec: Any) -> None:
        obj = copy.deepcopy(self.egress_obj())
        obj["spec"].update(spec)
        obj["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
        self.kube.update(TAILNET_EGRESS, obj)


async def world_with_tailnet(policy: str = OWNING) -> EgressWorld:
    world = EgressWorld()
    world.bootstrap_secret()
    world.add_tailnet()
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    return world


async def test_a_tag_the_policy_does_not_own_creates_nothing_and_gives_a_snippet() -> None:
    world = await world_with_tailnet('{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    world.add_egress()

    await world.reconcile_egress()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TagNotOwned")
    assert '"tag:egress-db"' in ready["message"] and "tagOwners" in ready["message"]
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE) is None
    assert world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE) is None


async def test_an_owned_tag_gets_a_reusable_ephemeral_tag_only_key_and_the_agent_objects() -> None:
    world = await world_with_tailnet()
    world.add_egress()

    await world.reconcile_egress()

    [key] = world.headscale.preauth_keys.values()
    marker = installation_tag(world.tailnet_obj()["metadata"]["uid"])
    assert key["reusable"] and key["ephemeral"] and key["aclTags"] == ["tag:egress-db", marker]
    assert world.stored_key() == key["key"]
    obj = world.egress_obj()
    secret = world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE)
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    status = obj["status"]["preAuthKey"]
    assert status["id"] == key["id"] and key["key"] not in str(obj["status"])
    assert status["nextRotationAt"] == "2026-01-01T12:00:00Z"  # half of 24 h
    assert FINALIZER in obj["metadata"]["finalizers"]
    for resource, name in ((DEPLOYMENT, "db-egress-agent"), (SERVICE, "ledger"), (SERVICE, "db-egress-agent"),
                           (NETWORK_POLICY, "db-egress-agent"), (CONFIG_MAP, "db-egress-config")):
        assert world.kube.get(resource, name, NAMESPACE) is not None, (resource, name)
    assert world.cond("TagOwned")["status"] == "True"
    assert world.cond("Ready")["reason"] == "NotAdvertised", "no router advertises 198.18.1.10"
    assert world.events.reasons[-1] == "PreAuthKeyRotated"


def _record_order(world: EgressWorld) -> list[str]:
    """What happened, in order: the Secret's key at each pre-auth-key expiry."""
    order: list[str] = []
    handle = world.headscale.handle

    def spy(request: HsRequest) -> HsResponse:
        if request.url.endswith("/api/v1/preauthkey/expire"):
            order.append(f"expire while the Secret holds {world.stored_key()}")
        return handle(request)

    world.headscale.handle = spy  # type: ignore[method-assign]
    return order


async def test_rotation_at_half_life_stores_the_new_key_before_expiring_the_old() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    old = world.stored_key()
    order = _record_order(world)

    world.clock.advance(timedelta(hours=12).total_seconds())
    await world.reconcile_egress()

    new = world.stored_key()
    assert new != old and world.headscale.preauth_live(new) and not world.headscale.preauth_live(old)
    assert order == [f"expire while the Secret holds {new}"]
    secret = world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE)
    assert secret is not None and "tailnet.dev/previous-key-id" not in secret["metadata"]["annotations"]


async def test_a_changed_tag_or_login_url_rotates_the_key_with_the_reason() -> None:
    world = await world_with_tailnet('{"tagOwners": {"tag:egress-db": [], "tag:egress-new": []}}')
    world.add_egress()
    await world.reconcile_egress()
    first = world.stored_key()

    world.edit_spec(tag="tag:egress-new")
    await world.reconcile_egress()
    second = world.stored_key()
    assert second != first and not world.headscale.preauth_live(first)
    new_key = next(k for k in world.headscale.preauth_keys.values() if k["key"] == second)
    assert new_key["aclTags"] == ["tag:egress-new", installation_tag(world.tailnet_obj()["metadata"]["uid"])]

    tailnet = copy.deepcopy(world.tailnet_obj())
    tailnet["spec"]["loginURL"] = "https://other.test:443"
    world.kube.update(TAILNET, tailnet)
    await world.reconcile_egress()
    assert world.stored_key() != second
    secret = world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE)
    assert secret is not None and secret["metadata"]["annotations"]["tailnet.dev/login-url"] == \
        "https://other.test:443"
    assert world.events.reasons.count("PreAuthKeyRotated") == 3


async def test_a_crash_after_storing_is_finished_by_the_next_reconcile() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    old_id = next(iter(world.headscale.preauth_keys))
    world.headscale.refuse["POST /api/v1/preauthkey/expire"] = (503, 14, "unavailable")
    world.clock.advance(timedelta(hours=12).total_seconds())

    await world.reconcile_egress()

    secret = world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE)
    assert secret is not None and secret["metadata"]["annotations"]["tailnet.dev/previous-key-id"] == old_id
    assert world.headscale.preauth_live(world.stored_key()), "the new key is in place before the old one goes"
    del world.headscale.refuse["POST /api/v1/preauthkey/expire"]
    await world.reconcile_egress()
    assert world.headscale.preauth_keys[old_id].get("expired")


async def test_changing_targets_changes_the_config_map_but_not_the_pod_template() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    deployment = world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE)
    assert deployment is not None
    template = copy.deepcopy(deployment["spec"]["template"])

    world.edit_spec(targets=[{"name": "billing", "address": "198.18.1.11", "ports": [{"port": 5432}]}])
    await world.reconcile_egress()

    after = world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE)
    assert after is not None and after["spec"]["template"] == template
    assert world.kube.get(SERVICE, "ledger", NAMESPACE) is None, "the removed target's Service is gone"
    billing = world.kube.get(SERVICE, "billing", NAMESPACE)
    assert billing is not None and billing["spec"]["ports"][0]["port"] == 5432
    config = world.kube.get(CONFIG_MAP, "db-egress-config", NAMESPACE)
    assert config is not None and "billing" in config["data"]["targets.json"]


async def test_two_replicas_get_a_disruption_budget_and_spread_and_back_to_one_the_budget_goes() -> None:
    """Issue 24: with 2 replicas a drain evicts one agent at a time and the agents land on
    different nodes where they can; back to 1 the budget would only block drains, so it is pruned."""
    world = await world_with_tailnet()
    world.add_egress(replicas=2)
    await world.reconcile_egress()

    deployment = world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE)
    assert deployment is not None and deployment["spec"]["replicas"] == 2
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "ScheduleAnyway")
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    budget = world.kube.get(POD_DISRUPTION_BUDGET, "db-egress-agent", NAMESPACE)
    assert budget is not None and budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert budget["metadata"]["ownerReferences"][0]["uid"] == world.egress_obj()["metadata"]["uid"]

    world.edit_spec(replicas=1)
    await world.reconcile_egress()

    assert world.kube.get(POD_DISRUPTION_BUDGET, "db-egress-agent", NAMESPACE) is None, "pruned at 1 replica"
    deployment = world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE)
    assert deployment is not None and deployment["spec"]["replicas"] == 1
    assert "topologySpreadConstraints" not in deployment["spec"]["template"]["spec"]
    assert world.kube.get(SERVICE, "ledger", NAMESPACE) is not None, "nothing else pruned"


async def test_one_replica_by_default_has_no_disruption_budget() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    deployment = world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE)
    assert deployment is not None and deployment["spec"]["replicas"] == 1
    assert world.kube.get(POD_DISRUPTION_BUDGET, "db-egress-agent", NAMESPACE) is None


async def test_a_steady_egress_writes_nothing() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    await world.reconcile_egress()
    writes = list(world.kube.writes)

    world.clock.advance(30)
    await world.reconcile_egress()

    assert world.kube.writes == writes


async def test_an_egress_outside_the_operator_namespace_is_never_acted_on() -> None:
    world = await world_with_tailnet()
    world.add_egress(namespace="tenant")

    await world.egress.reconcile(Request("tenant", "db"))

    assert world.headscale.preauth_keys == {}
    obj = world.kube.get(TAILNET_EGRESS, "db", "tenant")
    assert obj is not None and not obj.get("status") and not obj["metadata"].get("finalizers")


async def test_deleting_the_egress_expires_its_key_and_releases_the_finalizer() -> None:
    world = await world_with_tailnet()
    world.add_egress()
    await world.reconcile_egress()
    key = world.stored_key()

    await world.kube.delete(TAILNET_EGRESS, "db", NAMESPACE)
    await world.reconcile_egress()

    assert not world.headscale.preauth_live(key)
    assert world.kube.get(TAILNET_EGRESS, "db", NAMESPACE) is None
    assert "PreAuthKeyExpired" in world.events.reasons


async def test_without_a_working_key_the_egress_waits() -> None:
    world = EgressWorld()
    world.add_tailnet()
    world.add_egress()

    result = await world.reconcile_egress()

    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("Unknown", "WaitingForAccess")
    assert result.requeue_after == 10.0


async def test_a_target_name_another_egress_holds_is_a_conflict_and_its_service_is_left_alone() -> None:
    world = await world_with_tailnet()
    world.add_egress("older")
    await world.reconcile_egress("older")
    world.add_egress("db")

    await world.reconcile_egress("db")

    service = world.kube.get(SERVICE, "ledger", NAMESPACE)
    assert service is not None
    assert service["metadata"]["ownerReferences"][0]["name"] == "older", "the first holder keeps it"
    [entry] = world.egress_obj("db")["status"]["targets"]
    assert entry["route"] == "Conflict" and "TailnetEgress older" in entry["message"]
    ready = world.cond("Ready", "db")
    assert (ready["status"], ready["reason"]) == ("False", "Conflict")
    assert world.kube.get(DEPLOYMENT, "db-egress-agent", NAMESPACE) is not None, "the rest is still applied"


async def test_aliases_outside_the_tailnets_zones_are_reported() -> None:
    world = EgressWorld()
    world.bootstrap_secret()
    world.add_tailnet(dns={"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"},
                           "zones": ["example.internal"]})
    await world.reconcile_tailnet()
    world.headscale.policy = OWNING
    world.add_egress(targets=[{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}],
                               "aliases": ["ledger.example.internal", "ledger.corp.test"]}])

    await world.reconcile_egress()

    served = world.cond("AliasesServed")
    assert (served["status"], served["reason"]) == ("False", "OutsideZones")
    assert "ledger.corp.test" in served["message"] and "ledger.example.internal" not in served["message"]


async def test_aliases_without_a_hosts_file_are_reported() -> None:
    world = await world_with_tailnet()
    world.add_egress(targets=[{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}],
                               "aliases": ["ledger.example.internal"]}])

    await world.reconcile_egress()

    assert world.cond("AliasesServed")["reason"] == "NoHostsFile"


@pytest.mark.parametrize(("failure", "expired"), [
    (TransportError("PATCH: connect failed", unsent=True), True),
    (TransportError("PATCH: timed out"), False),  # may have been written: the agent may already use it
])
async def test_a_key_whose_secret_was_certainly_not_written_is_expired(failure: Exception, expired: bool) -> None:
    world = await world_with_tailnet()
    world.add_egress()
    apply = world.kube.apply

    async def failing(resource: Any, body: Any, **kwargs: Any) -> Any:
        if resource == SECRET and body["metadata"]["name"] == auth_key_secret_name("TailnetEgress", "db"):
            raise failure
        return await apply(resource, body, **kwargs)

    world.kube.apply = failing  # type: ignore[method-assign]
    with contextlib.suppress(type(failure)):
        await world.reconcile_egress()

    [key] = world.headscale.preauth_keys.values()
    assert bool(key.get("expired")) is expired


@pytest.mark.parametrize("land", [False, True])
async def test_a_key_whose_store_may_have_landed_is_stored_again_not_created_again(land: bool) -> None:
    world = await world_with_tailnet()
    world.add_egress()
    apply = world.kube.apply
    failures: list[Exception] = [TransportError("PATCH: timed out"), TransportError("PATCH: timed out"),
                                 TransportError("PATCH: connect failed", unsent=True)]

    async def failing(resource: Any, body: Any, **kwargs: Any) -> Any:
        if resource == SECRET and body["metadata"]["name"] == auth_key_secret_name("TailnetEgress", "db") and failures:
            if land:  # etcd committed it; the answer was lost
                await apply(resource, body, **kwargs)
            raise failures.pop(0)
        return await apply(resource, body, **kwargs)

    world.kube.apply = failing  # type: ignore[method-assign]
    for _ in range(3):
        with contextlib.suppress(TransportError):
            await world.reconcile_egress()
    world.kube.apply = apply  # type: ignore[method-assign]
    await world.reconcile_egress()

    [key] = world.headscale.preauth_keys.values()
    assert not key.get("expired"), "a retry that certainly failed must not expire a key that may be stored"
    secret = world.kube.get(SECRET, auth_key_secret_name("TailnetEgress", "db"), NAMESPACE)
    assert secret is not None and secret["metadata"]["annotations"]["tailnet.dev/key-id"] == str(key["id"])


async def test_a_key_expired_while_its_store_was_uncertain_is_replaced() -> None:
    """The orphan sweep may expire a key whose Secret write is still unconfirmed (an outage longer
    than its grace): the retry must not store a dead key."""
    world = await world_with_tailnet()
    world.add_egress()
    apply = world.kube.apply
    name = auth_key_secret_name("TailnetEgress", "db")

    async def failing(resource: Any, body: Any, **kwargs: Any) -> Any:
        if resource == SECRET and body["metadata"]["name"] == name:
            raise TransportError("PATCH: timed out")
        return await apply(resource, body, **kwargs)

    world.kube.apply = failing  # type: ignore[method-assign]
    with contextlib.suppress(TransportError):
        await world.reconcile_egress()
    [first] = world.headscale.preauth_keys.values()
    first["expired"], first["expiration"] = True, "2026-01-01T00:00:00Z"
    world.kube.apply = apply  # type: ignore[method-assign]
    await world.reconcile_egress()

    secret = world.kube.get(SECRET, name, NAMESPACE)
    assert secret is not None and secret["metadata"]["annotations"]["tailnet.dev/key-id"] != str(first["id"])
    assert len(world.headscale.preauth_keys) == 2
