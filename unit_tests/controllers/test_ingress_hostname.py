"""HostnameAssigned: an ingress node that did not get ``spec.hostname`` says who holds it; and
what the status phase tidies so that it does get it (:func:`succession`)."""

from __future__ import annotations

from dataclasses import dataclass

from tailnet_operator.controllers.ingress_status import (
    hostname_condition,
    retired_name,
    rollout_done,
    shared_address_condition,
    succession,
)
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


@dataclass(frozen=True)
class Keys:
    id: str
    previous_id: str = ""
    node_ids: frozenset[str] = frozenset()


def generation(node_id: str, name: str, key_id: str, *, online: bool, minute: int) -> Node:
    return Node.from_json({"id": node_id, "name": "shop", "givenName": name, "online": online,
                           "preAuthKey": {"id": key_id}, "createdAt": f"2026-01-01T00:{minute:02d}:00Z"})


def test_the_newest_online_node_of_the_keys_supersedes_the_older_offline_ones() -> None:
    old = generation("4", "shop", "1", online=False, minute=0)
    older = generation("2", "shop-a1", "1", online=False, minute=1)
    new = generation("9", "shop-b2", "2", online=True, minute=5)
    plan = succession("shop", Keys("2", previous_id="1"), [old, older, new], rolled_out=False)
    assert plan is not None and plan.newest.id == "9" and plan.rename
    assert [n.id for n in plan.superseded] == ["4", "2"], "oldest first"


def test_nothing_to_do_before_the_newest_is_online_or_once_it_has_the_name() -> None:
    old = generation("4", "shop", "1", online=True, minute=0)
    newer_offline = generation("9", "shop-b2", "1", online=False, minute=5)
    assert succession("shop", Keys("1"), [old, newer_offline], rolled_out=True) is None
    assert succession("shop", Keys("1"), [generation("9", "shop", "1", online=True, minute=5)], rolled_out=True) is None
    assert succession("shop", Keys("1"), [], rolled_out=True) is None


def test_nodes_of_other_keys_are_neither_deleted_nor_robbed_of_the_name() -> None:
    for online in (False, True):
        stranger = generation("3", "shop", "7", online=online, minute=0)
        new = generation("9", "shop-b2", "1", online=True, minute=5)
        assert succession("shop", Keys("1"), [stranger, new], rolled_out=True) is None


def test_a_node_recorded_as_the_ingresss_counts_as_its_own_after_its_key_was_retired() -> None:
    old = generation("7", "shop", "1", online=False, minute=0)  # key 1 retired two rotations ago
    new = generation("9", "shop-1", "3", online=True, minute=5)

    assert succession("shop", Keys("3", previous_id="2"), [old, new], rolled_out=True) is None, \
        "by keys alone: a stranger's node"
    plan = succession("shop", Keys("3", previous_id="2", node_ids=frozenset({"7"})), [old, new], rolled_out=True)

    assert plan is not None and [n.id for n in plan.superseded] == ["7"] and plan.rename


def test_a_draining_holder_keeps_the_name_until_the_rollout_is_done_then_hands_it_over() -> None:
    """The old pod of a rollout is online and holds the name while the new pod starts: the name
    moves only once the new pod is ready, and the old node keeps serving under another name."""
    old = generation("4", "shop", "1", online=True, minute=0)
    new = generation("9", "shop-b2", "1", online=True, minute=5)

    assert succession("shop", Keys("1"), [old, new], rolled_out=False) is None

    plan = succession("shop", Keys("1"), [old, new], rolled_out=True)
    assert plan is not None and plan.newest.id == "9" and plan.rename
    assert [n.id for n in plan.retiring] == ["4"] and plan.superseded == ()


def test_a_name_no_online_node_holds_moves_as_soon_as_the_newest_is_online() -> None:
    crashed = generation("4", "shop", "1", online=False, minute=0)
    new = generation("9", "shop-b2", "1", online=True, minute=5)
    plan = succession("shop", Keys("1"), [crashed, new], rolled_out=False)
    assert plan is not None and plan.rename and [n.id for n in plan.superseded] == ["4"] and plan.retiring == ()


def test_a_crashed_newer_node_that_holds_the_name_is_deleted_for_the_online_one() -> None:
    online = generation("4", "shop-a1", "1", online=True, minute=0)
    crashed = generation("9", "shop", "1", online=False, minute=5)
    plan = succession("shop", Keys("1"), [online, crashed], rolled_out=True)
    assert plan is not None and plan.newest.id == "4" and plan.rename and [n.id for n in plan.superseded] == ["9"]


def test_the_retired_name_is_a_dns_label_unique_by_node() -> None:
    assert retired_name("shop", generation("4", "shop", "1", online=True, minute=0)) == "shop-old4"
    long = retired_name("a" * 63, generation("12345", "x", "1", online=True, minute=0))
    assert len(long) == 63 and long.endswith("-old12345")


def deployment(*, replicas: int = 1, status: dict[str, int], generation: int = 2) -> dict[str, object]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 2, **status}}


def test_a_rollout_is_done_when_only_ready_pods_of_the_current_template_are_counted() -> None:
    surging = {"replicas": 2, "updatedReplicas": 1, "readyReplicas": 1}
    new_not_ready = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
    done = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    assert not rollout_done(deployment(status=surging))
    assert not rollout_done(deployment(status=new_not_ready))
    assert rollout_done(deployment(status=done))
    assert not rollout_done(deployment(status=done, generation=3)), "a template the controller has not seen"
    assert not rollout_done(None) and not rollout_done(deployment(replicas=0, status={}))


def test_a_replica_offline_for_a_moment_is_never_superseded_only_an_older_node() -> None:
    """Two replicas behind a shared address: the older one's control connection is re-made (offline
    at this pass); it is one of the newest two nodes, so it is kept, and only the crashed pod's node
    before them is deleted. With one replica it would have been superseded."""
    crashed = generation("2", "shop-a1", "1", online=False, minute=0)
    replica = generation("4", "shop", "1", online=False, minute=1)
    newest = generation("9", "shop-b2", "1", online=True, minute=5)
    plan = succession("shop", Keys("1"), [crashed, replica, newest], rolled_out=True, replicas=2)
    assert plan is not None and [n.id for n in plan.superseded] == ["2"]
    single = succession("shop", Keys("1"), [crashed, replica, newest], rolled_out=True)
    assert single is not None and [n.id for n in single.superseded] == ["2", "4"]


def replica(node_id: str, *, advertised: bool = True, approved: bool = True, primary: bool = False,
            online: bool = True) -> Node:
    route = ["198.18.5.10/32"]
    return Node.from_json({"id": node_id, "name": "shop", "givenName": f"shop-{node_id}", "online": online,
                           "availableRoutes": route if advertised else [], "approvedRoutes": route if approved else [],
                           "subnetRoutes": route if primary else []})


def test_the_shared_address_condition_names_the_replica_serving_it_or_what_is_missing() -> None:
    cond = shared_address_condition("198.18.5.10", [replica("3", primary=True), replica("5")])
    assert (cond.status, cond.reason) == ("True", "Served")
    assert "served by node 3 (shop-3); 2 of the ingress's 2 online node(s) advertise it" in cond.message
    assert shared_address_condition("198.18.5.10", [replica("3", advertised=False)]).reason == "NotAdvertised"
    not_approved = shared_address_condition("198.18.5.10", [replica("3", approved=False)])
    assert not_approved.reason == "NotApproved" and "autoApprovers.routes" in not_approved.message
    assert shared_address_condition("198.18.5.10", [replica("3")]).reason == "NoPrimary"
