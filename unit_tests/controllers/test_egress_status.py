"""Route state of egress targets: the agent's /status refined with Headscale's routers and the
live policy into Ready / NotAdvertised / NotApproved / NoGrant / Unresolved / Unknown."""

from __future__ import annotations

from typing import Any

import pytest

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers.egress_status import classify
from tailnet_operator.headscale import Node

OPEN = ('{"tagOwners": {"tag:egress-db": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}, '
        '{"src": ["tag:egress-db"], "dst": ["198.18.0.0/15"], "ip": ["*"]}]}')
"""``*`` in ``dst`` covers only tailnet addresses; the site range is granted on its own."""
CLOSED = '{"tagOwners": {"tag:egress-db": []}, "grants": []}'


def egress(address: str = "198.18.1.10") -> TailnetEgress:
    return TailnetEgress.model_validate({"metadata": {"name": "db", "namespace": "tailnet-system"}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "ledger", "address": address, "ports": [{"port": 5432}]}]}})


def router(advertised: list[str], approved: list[str]) -> Node:
    return Node.from_json({"id": "7", "name": "branch-router", "availableRoutes": advertised,
                           "approvedRoutes": approved})


def agent(state: str = "Ready", **entry: Any) -> dict[str, Any]:
    return {"node": {"id": "9", "name": "db-tailnet-system", "addresses": ["100.64.0.9"]},
            "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [5432], "state": state,
                         "router": "branch-router", "message": "", **entry}]}


@pytest.mark.parametrize(("nodes", "policy", "doc", "route"), [
    ([], OPEN, agent(), "NotAdvertised"),
    ([router(["198.18.1.0/24"], [])], OPEN, agent(), "NotApproved"),
    ([router(["198.18.1.0/24"], ["198.18.1.0/24"])], CLOSED, agent(), "NoGrant"),
    ([router(["198.18.1.0/24"], ["198.18.1.0/24"])], OPEN, agent("NoRoute"), "NoGrant"),
    ([router(["198.18.1.0/24"], ["198.18.1.0/24"])], OPEN, agent(), "Ready"),
    ([router(["198.18.1.0/24"], ["198.18.1.0/24"])], OPEN, None, "Unknown"),
])
def test_each_state_is_named(nodes: list[Node], policy: str, doc: dict[str, Any] | None, route: str) -> None:
    e = egress()
    state = classify(e, e.spec.targets[0], agent=doc, nodes=nodes, live_policy=policy)
    assert state.route == route, state.message
    assert state.message
    assert state.status()["service"] == "ledger.tailnet-system.svc"


def test_a_ready_target_carries_the_router_and_the_probe() -> None:
    e = egress()
    doc = agent(reachable=True, latencyMs=1.5, checkedAt="2026-01-01T00:00:00Z")
    state = classify(e, e.spec.targets[0], agent=doc, nodes=[router(["198.18.1.0/24"], ["198.18.1.0/24"])],
                     live_policy=OPEN)
    assert state.status() == {"name": "ledger", "service": "ledger.tailnet-system.svc", "route": "Ready",
                              "message": "routed", "router": "branch-router", "reachable": True,
                              "latencyMs": 1.5, "checkedAt": "2026-01-01T00:00:00Z"}


def test_a_dns_name_is_checked_against_routes_through_the_address_the_agent_resolved() -> None:
    e = egress("ledger.tailnet.example.internal")
    state = classify(e, e.spec.targets[0], agent=agent(), nodes=[], live_policy=OPEN)
    assert state.route == "NotAdvertised" and "198.18.1.10" in state.message


def test_a_tailnet_address_needs_no_router() -> None:
    e = egress("100.64.0.7")
    state = classify(e, e.spec.targets[0], agent=agent(address="100.64.0.7"), nodes=[], live_policy=OPEN)
    assert state.route == "Ready"


def test_the_router_is_named_as_headscale_names_it_not_by_its_magicdns_name() -> None:
    e = egress()
    doc = agent(router="branch-router.tailnet.test", routerId="7")
    nodes = [router(["198.18.1.0/24"], ["198.18.1.0/24"])]
    state = classify(e, e.spec.targets[0], agent=doc, nodes=nodes, live_policy=OPEN)
    assert (state.route, state.router) == ("Ready", "branch-router")
    unknown_id = {"targets": [{**doc["targets"][0], "routerId": "99"}]}
    state = classify(e, e.spec.targets[0], agent=unknown_id, nodes=nodes, live_policy=OPEN)
    assert state.router == "branch-router"


def test_a_name_that_does_not_resolve_says_so_with_the_agents_error() -> None:
    e = egress("ledger.corp.example")
    doc = agent("Unresolved", message="no such name (NXDOMAIN)")
    del doc["targets"][0]["address"]
    state = classify(e, e.spec.targets[0], agent=doc, nodes=[router(["198.18.1.0/24"], ["198.18.1.0/24"])],
                     live_policy=OPEN)
    assert state.route == "Unresolved"
    assert state.message.startswith("no such name (NXDOMAIN): ") and "spelling" in state.message
