"""HostnameAssigned: an ingress node that did not get ``spec.hostname`` says who holds it."""

from __future__ import annotations

from tailnet_operator.controllers.ingress_status import hostname_condition
from tailnet_operator.headscale import Node


def node(node_id: str, name: str, *, online: bool = True, tags: list[str] | None = None) -> Node:
    return Node.from_json({"id": node_id, "name": name, "givenName": name, "online": online,
                           "tags": tags or []})


def test_the_node_with_its_hostname_is_assigned() -> None:
    cond = hostname_condition("shop", {"id": "5", "name": "shop.tailnet.test"}, [node("5", "shop")])
    assert (cond.status, cond.reason) == ("True", "Assigned")


def test_a_suffixed_name_names_the_node_that_holds_the_hostname() -> None:
    holder = node("3", "shop", online=False, tags=["tag:ingress-shop"])
    cond = hostname_condition("shop", {"id": "5", "name": "shop-x1y2z3.tailnet.test"},
                              [holder, node("5", "shop-x1y2z3")])
    assert (cond.type, cond.status, cond.reason) == ("HostnameAssigned", "False", "HostnameTaken")
    assert "shop (node 3, offline, tags tag:ingress-shop)" in cond.message
    assert "named this node shop-x1y2z3" in cond.message


def test_a_holder_gone_since_registration_is_still_explained() -> None:
    cond = hostname_condition("shop", {"id": "5", "name": "shop-x1y2z3"}, [node("5", "shop-x1y2z3")])
    assert cond.reason == "HostnameTaken" and "held it at registration" in cond.message
