"""The Policy reconciler on the fake client and a fake Headscale: every PolicyApplied reason, site
status, route approvals, and no write when nothing changed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tailnet_operator.controllers.kinds import TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_SITE
from tailnet_operator.controllers.policy import rendered_config_map_name
from tailnet_operator.policy import parse_hujson
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World

OPEN_BASE = """// everyone reaches everything
{
  "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]},],
}
"""


def site(world: World, name: str, routes: list[str], tag: str, *, tailnet: str = "tn") -> JSON:
    return world.kube.add(TAILNET_SITE, {"metadata": {"name": name},
                                         "spec": {"tailnetRef": {"name": tailnet}, "routes": routes,
                                                  "routerTag": tag}})


def router(node_id: str, tag: str, advertised: list[str], approved: list[str] | None = None) -> JSON:
    return {"id": node_id, "name": f"router-{node_id}", "tags": [tag], "availableRoutes": advertised,
            "approvedRoutes": approved or []}


async def ready_world(*, base: str | None = OPEN_BASE, mode: str = "Apply", **spec: Any) -> World:
    """A Tailnet the Tailnet reconciler has already given a working key."""
    world = World()
    world.bootstrap_secret()
    if base is not None:
        world.kube.add(CONFIG_MAP, {"metadata": {"name": "base", "namespace": NAMESPACE},
                                    "data": {"policy.hujson": base}})
    if mode:
        spec["policy"] = {"baseConfigMapRef": {"namespace": NAMESPACE, "name": "base", "key": "policy.hujson"},
                          "mode": mode}
    world.add_tailnet(**spec)
    await world.reconcile_tailnet()
    return world


async def test_without_a_working_key_it_waits_for_access() -> None:
    world = World()
    world.add_tailnet()
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "WaitingForAccess"
    assert world.condition("Ready", "branch", TAILNET_SITE)["reason"] == "HeadscaleUnavailable"
    assert world.headscale.calls == []


async def test_apply_mode_writes_the_render_once_and_then_nothing() -> None:
    world = await ready_world()
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "Applied"
    assert world.headscale.policy.startswith("// everyone reaches everything\n"), "the base's text is kept"
    assert "// tailnet-operator: derived from TailnetSite branch\n" in world.headscale.policy
    live = parse_hujson(world.headscale.policy)
    assert live["autoApprovers"]["routes"]["192.168.1.0/24"] == ["tag:branch"]
    rendered = world.kube.get(CONFIG_MAP, rendered_config_map_name("tn"), NAMESPACE)
    assert rendered is not None
    status = world.tailnet_obj()["status"]["policy"]
    assert status["appliedHash"] == status["renderedHash"] == rendered["metadata"]["annotations"][
        "tailnet.dev/policy-hash"]
    assert world.condition("Ready")["reason"] == "Connected", "the Tailnet reconciler's conditions are kept"
    assert world.headscale.policy_writes == 1
    transition = world.condition("PolicyApplied")["lastTransitionTime"]

    world.clock.advance(30)
    await world.reconcile_policy()  # the message now says the live policy equals the render
    writes, condition = list(world.kube.writes), world.condition("PolicyApplied")
    assert condition["lastTransitionTime"] == transition
    world.clock.advance(30)
    await world.reconcile_policy()

    assert world.headscale.policy_writes == 1
    assert world.kube.writes == writes
    assert world.condition("PolicyApplied") == condition


async def test_render_mode_publishes_but_does_not_write() -> None:
    world = await ready_world(mode="Render")

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "RenderOnly"
    assert world.kube.get(CONFIG_MAP, rendered_config_map_name("tn"), NAMESPACE) is not None
    assert world.headscale.policy_writes == 0


@pytest.mark.parametrize(("base", "reason"), [(None, "BasePolicyMissing"), ("{ not json", "BasePolicyInvalid")])
async def test_a_missing_or_broken_base_renders_nothing(base: str | None, reason: str) -> None:
    world = await ready_world(base=base)

    await world.reconcile_policy()

    assert (world.condition("PolicyApplied")["status"], world.condition("PolicyApplied")["reason"]) == ("False",
                                                                                                        reason)
    assert world.kube.get(CONFIG_MAP, rendered_config_map_name("tn"), NAMESPACE) is None
    assert world.headscale.policy_writes == 0


async def test_a_rejected_render_keeps_the_live_policy_and_says_why() -> None:
    world = await ready_world()
    world.headscale.policy = '{"grants": []}'
    world.headscale.reject_policy = "test failed: tag:web cannot reach tag:db:5432"

    await world.reconcile_policy()

    cond = world.condition("PolicyApplied")
    assert cond["reason"] == "PolicyRejected" and "tag:db:5432" in cond["message"]
    assert world.headscale.policy == '{"grants": []}'
    assert "appliedHash" not in world.tailnet_obj()["status"]["policy"]
    assert world.events.reasons[-1] == "PolicyRejected"


TESTED_BASE = """{
  "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}],
  "tests": [{"src": "tag:web", "accept": ["tag:db:5432"]}],
}
"""


@pytest.mark.parametrize(("base", "checked"), [(OPEN_BASE, False), (TESTED_BASE, True)])
async def test_only_a_render_with_tests_is_checked_before_it_is_written(base: str, checked: bool) -> None:
    """Headscale's write refuses what its check would (a bad policy, a failing test) and stores
    nothing; the check is a second full evaluation, so it runs only where the policy has tests."""
    world = await ready_world(base=base)

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "Applied"
    assert ("POST /api/v1/policy/check" in world.headscale.calls) is checked
    assert world.headscale.policy_writes == 1


async def test_without_spec_policy_it_reports_what_is_missing_and_then_nothing_missing() -> None:
    world = await ready_world(base=None, mode="")
    world.headscale.policy = json.dumps({"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]})
    site(world, "branch", ["192.168.70.0/24"], "tag:site-report")

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "PolicyIncomplete"
    status = world.tailnet_obj()["status"]["policy"]
    assert "tag:site-report" in status["missingTags"] and "192.168.70.0/24" in status["missing"]
    assert world.kube.get(CONFIG_MAP, rendered_config_map_name("tn"), NAMESPACE) is None

    await world.kube.delete(TAILNET_SITE, "branch")
    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "NothingMissing"
    assert "policy" not in world.tailnet_obj()["status"], "status.policy.missing is removed, not left stale"


async def test_an_unreadable_live_policy_is_reported() -> None:
    world = await ready_world(base=None, mode="")
    world.headscale.policy = "{ broken"

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "LivePolicyUnreadable"


async def test_headscale_unavailable_is_reported_on_the_tailnet_and_its_sites() -> None:
    world = await ready_world()
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")
    world.headscale.down = "connect"

    await world.reconcile_policy()

    assert world.condition("PolicyApplied")["reason"] == "HeadscaleUnavailable"
    assert world.condition("Ready", "branch", TAILNET_SITE)["reason"] == "HeadscaleUnavailable"
    assert world.condition("Blocked", "branch", TAILNET_SITE)["status"] == "False"


async def test_a_route_advertised_before_its_site_existed_is_approved_and_the_site_is_routed() -> None:
    world = await ready_world()
    world.headscale.nodes.append(router("7", "tag:branch", ["192.168.1.0/24"]))
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")

    await world.reconcile_policy()

    assert world.headscale.nodes[0]["approvedRoutes"] == ["192.168.1.0/24"]
    assert world.condition("Ready", "branch", TAILNET_SITE)["reason"] == "Routed"
    status = (world.kube.get(TAILNET_SITE, "branch") or {})["status"]
    assert status["routers"] == [{"node": "router-7", "advertised": ["192.168.1.0/24"],
                                  "approved": ["192.168.1.0/24"]}]
    assert "RoutesApproved" in world.events.reasons

    await world.reconcile_policy()
    writes = list(world.kube.writes)
    await world.reconcile_policy()
    assert world.kube.writes == writes


@pytest.mark.parametrize(("advertised", "reason"), [(None, "NoRouter"), ([], "NotAdvertised")])
async def test_a_site_without_a_working_router_says_what_is_missing(advertised: list[str] | None,
                                                                   reason: str) -> None:
    world = await ready_world()
    if advertised is not None:
        world.headscale.nodes.append(router("7", "tag:branch", advertised))
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")

    await world.reconcile_policy()

    assert world.condition("Advertised", "branch", TAILNET_SITE)["reason"] == reason
    assert world.condition("Ready", "branch", TAILNET_SITE)["reason"] == reason


async def test_the_younger_overlapping_site_is_blocked_until_the_older_is_deleted() -> None:
    world = await ready_world(reservedNetworks=["10.96.0.0/12"])
    site(world, "old", ["192.168.50.0/24"], "tag:site-old")
    world.clock.advance(5)
    site(world, "young", ["192.168.50.128/25"], "tag:site-young")
    site(world, "reserved", ["10.96.4.0/24"], "tag:site-reserved")

    await world.reconcile_policy()

    assert world.condition("Blocked", "young", TAILNET_SITE)["reason"] == "RoutesOverlap"
    assert (world.kube.get(TAILNET_SITE, "young") or {})["status"]["blockedBy"] == "TailnetSite old"
    assert "10.96.0.0/12" in world.condition("Blocked", "reserved", TAILNET_SITE)["message"]
    assert world.condition("Blocked", "old", TAILNET_SITE)["status"] == "False"
    assert "192.168.50.128/25" not in world.headscale.policy

    await world.kube.delete(TAILNET_SITE, "old")
    await world.reconcile_policy()

    assert world.condition("Blocked", "young", TAILNET_SITE)["status"] == "False"
    assert "blockedBy" not in (world.kube.get(TAILNET_SITE, "young") or {})["status"]


async def test_the_two_reconcilers_own_their_own_conditions() -> None:
    world = await ready_world()
    await world.reconcile_policy()
    await world.reconcile_policy()
    world.kube.writes.clear()

    world.kube.update(SECRET, {**(world.kube.get(SECRET, "bootstrap", NAMESPACE) or {})})
    await world.reconcile_tailnet()
    await world.reconcile_policy()

    types = [c["type"] for c in world.tailnet_obj()["status"]["conditions"]]
    assert sorted(types) == ["KeyValid", "PolicyApplied", "Reachable", "Ready"]
    assert world.kube.writes == []


def egress(world: World, name: str, namespace: str, tag: str, *, tailnet: str = "tn") -> JSON:
    return world.kube.add(TAILNET_EGRESS, {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"tailnetRef": {"name": tailnet}, "tag": tag, "consumerNamespaces": ["apps"],
                 "targets": [{"name": "db", "address": "192.168.1.10", "ports": [{"port": 5432}]}]}})


async def test_an_egress_outside_the_operator_namespace_never_reaches_the_policy() -> None:
    world = await ready_world()
    egress(world, "mine", NAMESPACE, "tag:egress-mine")
    egress(world, "theirs", "tenant", "tag:egress-theirs")

    await world.reconcile_policy()
    world.clock.advance(30)
    await world.reconcile_policy()

    live = world.headscale.policy
    assert "tag:egress-mine" in live
    assert "tag:egress-theirs" not in live
    assert world.events.reasons.count("EgressIgnored") == 1, "reported once per object, not per reconcile"


async def test_the_gateway_range_and_egress_host_routes_are_replayed_too() -> None:
    """Approvals for what the gateway advertised before its approvers existed: its load-balancer
    range and an egress target's host route. Its site LANs are approved through TailnetSites
    (none here), so they stay unapproved, as does anything no approver covers."""
    world = await ready_world()
    world.kube.add(TAILNET_GATEWAY, {
        "metadata": {"name": "gw"},
        "spec": {"tailnetRef": {"name": "tn"}, "tag": "tag:gw", "image": "tailscale/tailscale:v1.98.10",
                 "siteRoutes": ["10.20.0.0/16"], "advertiseLoadBalancerRange": "198.18.200.0/24"}})
    egress(world, "db", NAMESPACE, "tag:egress-db")
    advertised = ["10.20.0.0/16", "198.18.200.0/24", "192.168.1.10/32", "172.16.0.0/12"]
    world.headscale.nodes.append(router("9", "tag:gw", advertised))
    world.headscale.nodes.append(router("10", "tag:other", ["10.20.0.0/16"]))

    await world.reconcile_policy()

    gateway, other = world.headscale.nodes
    assert gateway["approvedRoutes"] == ["192.168.1.10/32", "198.18.200.0/24"]
    assert other["approvedRoutes"] == [], "a node without an approver tag is never approved"


ACL_BASE = """{
  "acls": [{"action": "accept", "src": ["tag:ops"], "dst": ["tag:ops:*"]}],
}
"""


async def test_before_029_derived_grants_are_written_as_acls_and_the_condition_says_so() -> None:
    world = await ready_world(base=ACL_BASE)
    world.headscale.version = "v0.28.0"
    egress(world, "mine", NAMESPACE, "tag:egress-mine")

    await world.reconcile_policy()

    live = parse_hujson(world.headscale.policy)
    assert "grants" not in live
    assert {"action": "accept", "src": ["tag:egress-mine"], "proto": "tcp",
            "dst": ["192.168.1.10:5432"]} in live["acls"]
    condition = world.condition("PolicyApplied")
    assert (condition["status"], condition["reason"]) == ("True", "AppliedWithoutGrants")
    assert "v0.28.0 has no grants" in condition["message"] and "upgrade Headscale to 0.29" in condition["message"]
    assert "POST /api/v1/policy/check" not in world.headscale.calls, "0.28 has no policy check"

    world.clock.advance(30)
    await world.reconcile_policy()
    assert world.headscale.policy_writes == 1
    assert world.condition("PolicyApplied")["reason"] == "AppliedWithoutGrants"


async def test_before_029_a_base_with_grants_is_not_written_and_the_condition_says_what_to_do() -> None:
    world = await ready_world()  # OPEN_BASE is a grants block
    world.headscale.version = "v0.27.1"

    await world.reconcile_policy()

    condition = world.condition("PolicyApplied")
    assert (condition["status"], condition["reason"]) == ("False", "GrantsUnsupported")
    assert "v0.27.1" in condition["message"] and "Rewrite the base's grants as acls" in condition["message"]
    assert world.headscale.policy_writes == 0
    assert world.kube.get(CONFIG_MAP, rendered_config_map_name("tn"), NAMESPACE) is not None, "still published"


async def test_a_write_headscale_accepts_but_stores_differently_is_reported_and_not_repeated() -> None:
    world = await ready_world()
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")
    handle = world.headscale.handle
    other = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["tcp:22"]}]}'

    def storing_other(request: Any) -> Any:
        answer = handle(request)
        if request.method == "PUT" and request.url.endswith("/api/v1/policy"):
            world.headscale.policy = other  # accepted, then stored as something else
        return answer

    world.headscale.handle = storing_other  # type: ignore[method-assign]
    await world.reconcile_policy()

    condition = world.condition("PolicyApplied")
    assert condition["status"] == "False" and condition["reason"] == "StoredDifferently"
    assert "PolicyStoredDifferently" in world.events.reasons
    assert "appliedHash" not in world.tailnet_obj()["status"]["policy"]
    assert world.headscale.policy_writes == 1

    world.clock.advance(30)
    await world.reconcile_policy()
    assert world.headscale.policy_writes == 1, "the same render is not written again over the same live policy"
    assert world.condition("PolicyApplied")["reason"] == "StoredDifferently"

    world.headscale.handle = handle  # type: ignore[method-assign]
    world.headscale.policy = '{"grants": []}'  # someone changed the live policy: the render is written again
    world.clock.advance(30)
    await world.reconcile_policy()
    assert world.headscale.policy_writes == 2 and world.condition("PolicyApplied")["reason"] == "Applied"


CONTESTED_BASE = """{
  "tagOwners": {"tag:lab-router": []},
  "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}],
  "autoApprovers": {"routes": {"10.77.0.0/24": ["tag:lab-router"]}},
}
"""


async def test_a_route_the_base_gives_to_another_approver_is_not_replayed_and_the_skip_is_reported() -> None:
    world = await ready_world(base=CONTESTED_BASE)
    world.headscale.nodes.append(router("7", "tag:branch", ["10.77.0.0/24", "10.78.0.0/24"]))
    site(world, "branch", ["10.77.0.0/24", "10.78.0.0/24"], "tag:branch")

    await world.reconcile_policy()

    assert world.headscale.nodes[0]["approvedRoutes"] == ["10.78.0.0/24"], "the base wins: 10.77.0.0/24 is not ours"
    condition = world.condition("PolicyApplied")
    assert condition["reason"] == "Applied" and "1 derived entry was left out" in condition["message"]
    [skipped] = world.tailnet_obj()["status"]["policy"]["skipped"]
    assert skipped["kind"] == "route" and skipped["entry"] == "10.77.0.0/24"
    assert skipped["sources"] == ["TailnetSite branch"]
    assert "tag:lab-router" in skipped["reason"] and "tag:branch" in skipped["reason"]
    assert world.events.reasons.count("DerivedEntriesSkipped") == 1
    assert world.condition("Approved", "branch", TAILNET_SITE)["status"] == "False"

    world.clock.advance(30)
    await world.reconcile_policy()
    assert world.events.reasons.count("DerivedEntriesSkipped") == 1, "reported again only when the skips change"

    base = world.kube.get(CONFIG_MAP, "base", NAMESPACE)
    assert base is not None
    world.kube.update(CONFIG_MAP, {**base, "data": {"policy.hujson": OPEN_BASE}})
    world.clock.advance(30)
    await world.reconcile_policy()
    assert sorted(world.headscale.nodes[0]["approvedRoutes"]) == ["10.77.0.0/24", "10.78.0.0/24"]
    assert "skipped" not in world.tailnet_obj()["status"]["policy"]


@pytest.mark.parametrize("mode", ["Render", ""])
async def test_the_read_only_branches_send_headscale_nothing_but_reads(mode: str) -> None:
    """Render mode and a Tailnet without spec.policy only read Headscale, even with a router whose
    advertised route a CR derives an approval for and a live policy that would approve it."""
    world = await ready_world(mode=mode)
    world.headscale.policy = json.dumps({"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}],
                                         "autoApprovers": {"routes": {"192.168.1.0/24": ["tag:branch"]}}})
    world.headscale.nodes.append(router("7", "tag:branch", ["192.168.1.0/24"]))
    site(world, "branch", ["192.168.1.0/24"], "tag:branch")
    world.headscale.calls.clear()

    for _ in range(2):
        await world.reconcile_policy()
        world.clock.advance(30)

    assert world.condition("PolicyApplied")["reason"] == ("RenderOnly" if mode else "PolicyIncomplete")
    assert world.headscale.calls, "the branch reads Headscale"
    writes = [call for call in world.headscale.calls if not call.startswith("GET ")]
    assert writes == [], f"a read-only branch wrote to Headscale: {writes}"
    assert world.headscale.nodes[0]["approvedRoutes"] == []


async def test_a_service_of_the_tailnets_class_owns_its_tag_in_the_policy_as_an_ingress_would() -> None:
    world = await ready_world(tenants=[{"namespaces": ["shop"], "tags": ["tag:shop-*"]}])
    for name, namespace, tag in (("web", "shop", "tag:shop-web"), ("db", "elsewhere", "tag:shop-db")):
        world.kube.add(SERVICE, {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                                              "annotations": {"tailnet.dev/tag": tag}},
                                 "spec": {"type": "LoadBalancer", "loadBalancerClass": "tailnet.dev/tn",
                                          "ports": [{"port": 80, "protocol": "TCP"}]}})
    world.kube.add(SERVICE, {"metadata": {"name": "plain", "namespace": "shop", "uid": "uid-plain",
                                          "annotations": {"tailnet.dev/tag": "tag:shop-plain"}},
                             "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]}})

    await world.reconcile_policy()

    owners = parse_hujson(world.headscale.policy)["tagOwners"]
    assert "tag:shop-web" in owners
    assert "tag:shop-db" not in owners, "a namespace that is not a tenant adds no tag"
    assert "tag:shop-plain" not in owners, "a Service without the class is not the Tailnet's"
