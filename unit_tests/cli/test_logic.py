"""The CLI's answers from fetched objects: a healthy egress, then each broken link named with its
cause and next step (tag not owned, route not approved, no grant, agent down, Headscale
unreachable), diagnose's own causes, and check."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tailnet_operator.cli.logic import (
    CheckFacts,
    Facts,
    HeadscaleView,
    check,
    diagnose,
    egress_status,
    event_key,
    object_status,
)
from tailnet_operator.headscale import Node

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TAG = "tag:egress-db"
GOOD_POLICY = ('{"tagOwners": {"tag:egress-db": [], "tag:router": []}, '
               '"grants": [{"src": ["tag:egress-db"], "dst": ["198.18.1.0/24"], "ip": ["5432"]}]}')


def iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def egress(**status: Any) -> dict[str, Any]:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": "db", "namespace": "tailnet-system"},
            "spec": {"tailnetRef": {"name": "home"}, "tag": TAG, "consumerNamespaces": ["apps"],
                     "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "ok"}],
                       "node": {"id": "9", "name": "db-tailnet-system"},
                       "preAuthKey": {"prefix": "abcd****", "expiresAt": iso(NOW + timedelta(hours=20)),
                                      "nextRotationAt": iso(NOW + timedelta(hours=8))},
                       **status}}


def tailnet(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "tailnet.dev/v1alpha1", "kind": "Tailnet", "metadata": {"name": "home"},
        "spec": {"apiURL": "https://headscale.example:8443", "loginURL": "https://headscale.example:8443"},
        "status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "Connected", "message": "v0.29.2"},
            {"type": "Reachable", "status": "True", "reason": "Connected", "message": ""},
            {"type": "KeyValid", "status": "True", "reason": "KeyValid", "message": ""}],
            "serverVersion": "v0.29.2",
            "apiKey": {"prefix": "wk12", "expiresAt": iso(NOW + timedelta(days=20))}}}
    obj["status"].update(changes)
    return obj


def pod(ready: bool = True, waiting: str = "") -> dict[str, Any]:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"kind": "Pod", "metadata": {"name": "db-egress-agent-5c2a", "namespace": "tailnet-system"},
            "status": {"phase": "Running" if ready else "Pending", "podIP": "198.19.64.9",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "agent", "state": state, "restartCount": 0 if ready else 4}]}}


def node(node_id: str = "9", *, tags: tuple[str, ...] = (TAG,), online: bool = True,
         advertised: tuple[str, ...] = (), approved: tuple[str, ...] = (), name: str = "db-tailnet-system") -> Node:
    return Node.from_json({"id": node_id, "name": name, "givenName": name, "tags": list(tags), "online": online,
                           "ipAddresses": [f"100.64.0.{node_id}"], "availableRoutes": list(advertised),
                           "approvedRoutes": list(approved), "lastSeen": iso(NOW - timedelta(seconds=30))})


ROUTER = node("3", tags=("tag:router",), advertised=("198.18.1.0/24",), approved=("198.18.1.0/24",),
              name="branch-router")


def view(*nodes: Node, policy: str = GOOD_POLICY) -> HeadscaleView:
    return HeadscaleView(nodes=nodes or (node(), ROUTER), policy=policy, version="v0.29.2")


def facts(**changes: Any) -> Facts:
    base: dict[str, Any] = {"now": NOW, "obj": egress(), "tailnet": tailnet(), "pods": (pod(),), "headscale": view()}
    base.update(changes)
    return Facts(**base)


def test_a_healthy_egress_walks_the_whole_chain_and_suggests_a_connection_test() -> None:
    report = egress_status(facts(events={event_key("TailnetEgress", "tailnet-system", "db"): [
        {"type": "Normal", "reason": "PreAuthKeyRotated", "message": "new pre-auth key abcd",
         "eventTime": iso(NOW - timedelta(minutes=3))}]}))
    assert report.ok, report.render()
    text = report.render()
    for link in ("TailnetEgress tailnet-system/db", "agent pod db-egress-agent-5c2a",
                 "Headscale node db-tailnet-system (id 9)", "policy entries for tag:egress-db",
                 "grants[0]: tag:egress-db -> 198.18.1.0/24", "target ledger", "route Routed", "Tailnet home",
                 "working key wk12 expires in 20d0h", "pre-auth key", "PreAuthKeyRotated (3m0s ago)"):
        assert link in text, (link, text)
    assert "nc -vz ledger.tailnet-system.svc 5432" in report.check_next()


@pytest.mark.parametrize(("changes", "cause", "hint"), [
    ({"headscale": view(policy='{"tagOwners": {"tag:router": []}, "grants": [{"src": ["tag:egress-db"], '
                               '"dst": ["198.18.1.0/24"], "ip": ["5432"]}]}')},
     "TagNotOwned", '"tag:egress-db": [] to tagOwners'),
    ({"headscale": view(node(), node("3", tags=("tag:router",), advertised=("198.18.1.0/24",),
                                     name="branch-router"))},
     "NotApproved", "approve the route on branch-router"),
    ({"headscale": view(node(), ROUTER)},  # the router is fine, but nothing advertises another range
     None, None),
    ({"headscale": view(policy='{"tagOwners": {"tag:egress-db": []}, "grants": []}')},
     "NoGrant", "add a grant from tag:egress-db to 198.18.1.10 ports 5432"),
    ({"pods": (pod(ready=False, waiting="CrashLoopBackOff"),), "headscale": view(node(online=False), ROUTER)},
     "AgentDown", "kubectl -n tailnet-system logs db-egress-agent-5c2a"),
    ({"pods": ()}, "AgentDown", "describe deployment db-egress-agent"),
    ({"headscale": HeadscaleView(error="https://headscale.example:8443: cannot connect: connection refused")},
     "HeadscaleUnreachable", "kubectl tailnet check"),
    ({"tailnet": None}, "TailnetNotFound", "kubectl get tailnets"),
])
def test_each_broken_link_is_named_with_its_next_step(changes: dict[str, Any], cause: str | None,
                                                      hint: str | None) -> None:
    report = egress_status(facts(**changes))
    if cause is None:
        assert report.ok, report.render()
        return
    assert report.causes()[0] == cause, report.render()
    assert hint is not None and hint in report.check_next(), report.render()
    assert f"{cause}:" in report.render()


def test_an_unreachable_headscale_leaves_node_and_policy_unjudged() -> None:
    report = egress_status(facts(headscale=HeadscaleView(error="timed out")))
    titles = [s.title for s in report.steps]
    assert "Headscale" in titles
    assert not any(t.startswith(("policy entries", "target ")) for t in titles)
    assert report.causes() == ["HeadscaleUnreachable"]


def test_the_operators_unreachable_condition_is_reported_even_when_the_cli_got_through() -> None:
    down = tailnet(conditions=[{"type": "Ready", "status": "False", "reason": "Unreachable", "message": "refused"},
                               {"type": "Reachable", "status": "False", "reason": "Unreachable",
                                "message": "connection refused"}])
    report = egress_status(facts(tailnet=down))
    assert "HeadscaleUnreachable" in report.causes()
    assert "connection refused" in report.render()


def test_expired_keys_are_causes() -> None:
    old = tailnet(apiKey={"prefix": "wk12", "expiresAt": iso(NOW - timedelta(hours=1))})
    report = egress_status(facts(tailnet=old, obj=egress(preAuthKey={"prefix": "p", "expiresAt": iso(NOW)})))
    assert {"KeyExpired", "PreAuthKeyExpired"} <= set(report.causes())
    assert report.causes()[0] == "KeyExpired"


def test_a_dns_target_falls_back_to_the_operators_route_state() -> None:
    obj = egress(targets=[{"name": "ledger", "service": "ledger.tailnet-system.svc", "route": "NotApproved",
                           "message": "branch-router advertises a route to 198.18.1.10 but it is not approved"}])
    obj["spec"]["targets"][0]["address"] = "ledger.branch.example"
    report = egress_status(facts(obj=obj))
    assert report.causes() == ["NotApproved"]


def test_a_site_whose_routes_are_not_approved() -> None:
    site = {"kind": "TailnetSite", "metadata": {"name": "office", "namespace": "tailnet-system"},
            "spec": {"tailnetRef": {"name": "home"}, "routerTag": "tag:router", "routes": ["198.18.1.0/24"]},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NotApproved",
                                       "message": "198.18.1.0/24 is approved on no router"}],
                       "routers": [{"node": "branch-router", "advertised": ["198.18.1.0/24"], "approved": []}]}}
    report = object_status(Facts(now=NOW, obj=site, tailnet=tailnet()))
    assert report.causes() == ["NotApproved"]
    assert "router branch-router" in report.render()
    assert "advertised 198.18.1.0/24; approved -" in report.render()


def test_an_ingress_in_a_namespace_that_has_not_let_the_operator_in() -> None:
    ingress = {"kind": "TailnetIngress", "metadata": {"name": "shop", "namespace": "tenant"},
               "spec": {"tailnetRef": {"name": "home"}, "tag": "tag:shop"},
               "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NamespaceNotGranted",
                                          "message": "kubectl -n tenant create rolebinding tailnet-operator ..."}]}}
    report = object_status(Facts(now=NOW, obj=ingress, tailnet=tailnet()))
    assert report.causes() == ["NamespaceNotGranted"]
    assert "namespace tenant" in report.check_next() and "rbac.md" in report.check_next()


def test_a_tailnet_whose_policy_was_rejected() -> None:
    rejected = tailnet()
    rejected["status"]["conditions"].append({"type": "PolicyApplied", "status": "False", "reason": "PolicyRejected",
                                             "message": "tag:x is not defined"})
    report = object_status(Facts(now=NOW, obj=rejected))
    assert report.causes() == ["PolicyRejected"]
    assert "home-policy" in report.check_next()


CLIENT = {"kind": "Pod", "metadata": {"name": "web-1", "namespace": "apps"}, "status": {"phase": "Running"}}


@pytest.mark.parametrize("target", ["ledger", "ledger.tailnet-system.svc", "ledger.tailnet-system.svc:5432",
                                    "db/ledger", "198.18.1.10", "198.18.1.10:5432"])
def test_diagnose_finds_the_target_in_every_spelling(target: str) -> None:
    report = diagnose(CLIENT, "apps/web-1", target, [egress()], {"db": facts()})
    assert report.ok, report.render()
    assert "kubectl exec -n apps web-1 -- nc -vz ledger.tailnet-system.svc 5432" in report.check_next()


def test_diagnose_names_a_namespace_outside_the_consumers() -> None:
    other = {**CLIENT, "metadata": {"name": "web-1", "namespace": "shop"}}
    report = diagnose(other, "shop/web-1", "ledger", [egress()], {"db": facts()})
    assert report.causes() == ["NamespaceNotAllowed"]
    assert "add shop to consumerNamespaces" in report.check_next()


def test_diagnose_carries_the_chain_of_the_targets_egress() -> None:
    broken = facts(headscale=view(policy='{"tagOwners": {"tag:egress-db": []}, "grants": []}'))
    report = diagnose(CLIENT, "apps/web-1", "ledger.tailnet-system.svc", [egress()], {"db": broken})
    assert report.causes() == ["NoGrant"]


def test_diagnose_an_unknown_target_lists_the_known_ones() -> None:
    report = diagnose(CLIENT, "apps/web-1", "payroll", [egress()], {"db": facts()})
    assert report.causes() == ["NoSuchTarget"]
    assert "ledger.tailnet-system.svc" in report.check_next()


def test_diagnose_a_missing_pod() -> None:
    assert diagnose(None, "apps/web-9", "ledger", [egress()], {}).causes() == ["PodNotFound"]


def crd(kind: str, plural: str, established: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": f"{plural}.tailnet.dev"},
            "spec": {"group": "tailnet.dev", "names": {"kind": kind, "plural": plural},
                     "versions": [{"name": "v1alpha1", "served": True}]},
            "status": {"conditions": [{"type": "Established", "status": "True" if established else "False"}]}}


CRDS = (crd("Tailnet", "tailnets"), crd("TailnetEgress", "tailnetegresses"),
        crd("TailnetIngress", "tailnetingresses"), crd("TailnetSite", "tailnetsites"),
        crd("TailnetGateway", "tailnetgateways"))
DEPLOYMENT = {"metadata": {"name": "tailnet-operator", "labels": {"app.kubernetes.io/version": "0.1.0"}},
              "spec": {"replicas": 2,
                       "template": {"spec": {"containers": [{"image": "localhost/tailnet-operator:x"}]}}},
              "status": {"availableReplicas": 2}}
LEASE = {"spec": {"holderIdentity": "tailnet-operator-abc_1", "renewTime": iso(NOW - timedelta(seconds=2)),
                  "leaseDurationSeconds": 15}}


def check_facts(**changes: Any) -> CheckFacts:
    base: dict[str, Any] = {"now": NOW, "cli_version": "0.1.0", "kubernetes_version": "v1.36.3", "crds": CRDS,
                            "deployment": DEPLOYMENT, "lease": LEASE, "tailnets": (tailnet(),),
                            "headscale": {"home": view()}}
    base.update(changes)
    return CheckFacts(**base)


def test_check_passes_on_a_working_installation() -> None:
    report = check(check_facts())
    assert report.ok, report.render()


@pytest.mark.parametrize(("changes", "cause"), [
    ({"crds": CRDS[:4]}, "CRDMissing"),
    ({"crds": (*CRDS[:4], crd("TailnetGateway", "tailnetgateways", established=False))}, "CRDNotServed"),
    ({"deployment": None}, "OperatorMissing"),
    ({"deployment": {**DEPLOYMENT, "status": {"availableReplicas": 0}}}, "OperatorNotReady"),
    ({"lease": None}, "NoLeader"),
    ({"lease": {"spec": {**LEASE["spec"], "renewTime": iso(NOW - timedelta(minutes=5))}}}, "NoLeader"),
    ({"headscale": {"home": HeadscaleView(error="connection refused")}}, "HeadscaleUnreachable"),
    ({"headscale": {"home": HeadscaleView(nodes=(), policy="", version="v0.23.0")}}, "HeadscaleVersionUnsupported"),
    ({"tailnets": (tailnet(apiKey={}),)}, "NoWorkingKey"),
    ({"tailnets": (tailnet(apiKey={"prefix": "x", "expiresAt": iso(NOW - timedelta(days=1))}),)}, "KeyExpired"),
    ({"kubernetes_version": "v1.28.4"}, "KubernetesTooOld"),
    ({"cli_version": "0.2.0"}, "VersionSkew"),
])
def test_check_names_what_is_broken(changes: dict[str, Any], cause: str) -> None:
    report = check(check_facts(**changes))
    assert cause in report.causes(), report.render()
    assert report.check_next()


def test_check_with_no_tailnet_yet_passes() -> None:
    assert check(check_facts(tailnets=(), headscale={})).ok


def test_check_vouches_only_for_tailnets_whose_key_it_holds() -> None:
    elsewhere = HeadscaleView(error="no working key", no_key=True)
    assert check(check_facts(headscale={"home": elsewhere})).ok
    down = tailnet(conditions=[{"type": "Reachable", "status": "False", "reason": "Unreachable",
                                "message": "connection refused"}])
    report = check(check_facts(tailnets=(down,), headscale={"home": elsewhere}))
    assert report.causes() == ["HeadscaleUnreachable"]
    assert "connection refused" in report.render()
