"""``status`` from fetched objects: a healthy egress, then each broken link named with its cause
and next step (tag not owned, route not approved, no grant, agent down, Headscale unreachable),
and the other kinds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tailnet_operator.cli.facts import Facts, HeadscaleView, event_key
from tailnet_operator.cli.status import egress_status, object_status

from .builders import NOW, ROUTER, egress, facts, iso, node, pod, tailnet, view


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
