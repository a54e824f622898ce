"""Deriving the policy entries the CRs need."""

from __future__ import annotations

import pytest

from hack.crds import load_samples
from tailnet_operator.api import TailnetEgress, TailnetGateway, TailnetIngress, TailnetSite
from tailnet_operator.policy import (
    Derived,
    EgressInput,
    EgressTarget,
    GatewayInput,
    Grant,
    IngressInput,
    RouteApproval,
    SiteInput,
    TagOwner,
    derive,
)
from tailnet_operator.policy.adapters import derive_from_objects, gateway_input, ingress_input, site_input


def test_nothing_in_nothing_out() -> None:
    assert derive() == Derived()


def test_every_cr_tag_gets_an_owner_entry() -> None:
    derived = derive(
        egresses=[EgressInput("tag:egress", (EgressTarget("10.0.0.1", (22,)),))],
        ingresses=[IngressInput("tag:ingress", (443,))],
        sites=[SiteInput("branch", "tag:router", ("10.1.0.0/24",))],
        gateways=[GatewayInput("tag:gateway")],
    )
    assert derived.tag_owners == tuple(
        TagOwner(tag, ()) for tag in ("tag:egress", "tag:gateway", "tag:ingress", "tag:router")
    )


def test_owners_are_configurable_and_owner_tags_are_defined_too() -> None:
    derived = derive(ingresses=[IngressInput("tag:web")], owners=["tag:tailnet-operator", "group:platform"])
    assert derived.tag_owners == (
        TagOwner("tag:tailnet-operator", ()),
        TagOwner("tag:web", ("tag:tailnet-operator", "group:platform")),
    )


def test_a_tag_does_not_own_itself() -> None:
    derived = derive(ingresses=[IngressInput("tag:op")], owners=["tag:op", "alice@"])
    assert derived.tag_owners == (TagOwner("tag:op", ("alice@",)),)


@pytest.mark.parametrize("owner", ["alice", "autogroup:member", "Tag:x", "tag:"])
def test_owners_must_be_users_groups_or_tags(owner: str) -> None:
    with pytest.raises(ValueError, match="tag"):
        derive(owners=[owner])


def test_ingress_gets_no_grant() -> None:
    derived = derive(ingresses=[IngressInput("tag:web", (443, 80))])
    assert derived.grants == ()
    assert derived.routes == ()


def test_site_routes_are_approved_for_the_router_tag() -> None:
    derived = derive(
        sites=[
            SiteInput("b", "tag:router-b", ("192.168.60.5/32", "10.20.0.0/28")),
            SiteInput("a", "tag:router-a", ("192.168.50.0/24", "fd00:1::/64")),
        ]
    )
    assert derived.routes == (
        RouteApproval("10.20.0.0/28", ("tag:router-b",)),
        RouteApproval("192.168.50.0/24", ("tag:router-a",)),
        RouteApproval("192.168.60.5/32", ("tag:router-b",)),
        RouteApproval("fd00:1::/64", ("tag:router-a",)),
    )


def test_egress_grants_one_per_target_with_tcp_ports() -> None:
    derived = derive(
        egresses=[
            EgressInput(
                "tag:egress",
                (EgressTarget("10.0.0.9", (5432, 443)), EgressTarget("db.example.com", (443,))),
            ),
            EgressInput("tag:other", (EgressTarget("fd00::0:1", (22,)),)),
        ]
    )
    assert derived.grants == (
        Grant(("tag:egress",), ("10.0.0.9",), ("tcp:443", "tcp:5432")),
        Grant(("tag:egress",), ("db.example.com",), ("tcp:443",)),
        Grant(("tag:other",), ("fd00::1",), ("tcp:22",)),
    )


def test_egress_host_routes_are_approved_for_every_gateway() -> None:
    derived = derive(
        egresses=[EgressInput("tag:egress", (EgressTarget("10.0.0.9", (1,)), EgressTarget("fd00::1", (1,))))],
        gateways=[GatewayInput("tag:gw-b", ("10.250.0.0/24",)), GatewayInput("tag:gw-a")],
    )
    assert derived.routes == (
        RouteApproval("10.0.0.9/32", ("tag:gw-a", "tag:gw-b")),
        RouteApproval("10.250.0.0/24", ("tag:gw-b",)),
        RouteApproval("fd00::1/128", ("tag:gw-a", "tag:gw-b")),
    )


def test_without_a_gateway_or_for_dns_names_no_host_route() -> None:
    assert derive(egresses=[EgressInput("tag:e", (EgressTarget("10.0.0.9", (1,)),))]).routes == ()
    derived = derive(
        egresses=[EgressInput("tag:e", (EgressTarget("db.example.com", (1,)),))], gateways=[GatewayInput("tag:gw")]
    )
    assert derived.routes == ()


def test_same_route_from_two_sources_merges_approvers() -> None:
    derived = derive(
        sites=[SiteInput("a", "tag:r1", ("10.0.0.0/24",)), SiteInput("b", "tag:r2", ("10.0.0.0/24",))]
    )
    assert derived.routes == (RouteApproval("10.0.0.0/24", ("tag:r1", "tag:r2")),)


def test_blocked_sites_contribute_nothing_because_the_caller_omits_them() -> None:
    sites = [SiteInput("older", "tag:r1", ("10.0.0.0/16",)), SiteInput("overlapping", "tag:r2", ("10.0.5.0/24",))]
    blocked = {"overlapping"}  # the site reconciler's Blocked condition
    derived = derive(sites=[s for s in sites if s.name not in blocked])
    assert derived.routes == (RouteApproval("10.0.0.0/16", ("tag:r1",)),)
    assert derived.tags == ("tag:r1",)


@pytest.mark.parametrize(
    "bad",
    [
        {"sites": [SiteInput("a", "tag:r", ("10.0.0.1/24",))]},
        {"sites": [SiteInput("a", "router", ("10.0.0.0/24",))]},
        {"gateways": [GatewayInput("tag:gw", ("nonsense",))]},
        {"egresses": [EgressInput("tag:e", (EgressTarget("10.0.0.1", (0,)),))]},
        {"ingresses": [IngressInput("tag:Web")]},
    ],
)
def test_inputs_no_valid_cr_can_produce_are_refused(bad: dict[str, list[object]]) -> None:
    with pytest.raises(ValueError):
        derive(**bad)  # type: ignore[arg-type]


def test_input_order_does_not_matter() -> None:
    egresses = [
        EgressInput("tag:b", (EgressTarget("10.0.0.2", (2, 1)),)),
        EgressInput("tag:a", (EgressTarget("10.0.0.1", (1,)),)),
    ]
    sites = [SiteInput("x", "tag:r2", ("10.9.0.0/24",)), SiteInput("y", "tag:r1", ("10.8.0.0/24",))]
    gateways = [GatewayInput("tag:g2"), GatewayInput("tag:g1")]
    assert derive(egresses=egresses, sites=sites, gateways=gateways) == derive(
        egresses=egresses[::-1], sites=sites[::-1], gateways=gateways[::-1]
    )


# --- adapters from the CRD models ------------------------------------------------------------

SAMPLES = {s["kind"]: s for s in load_samples()}


def test_adapters_read_the_samples() -> None:
    egress = TailnetEgress.model_validate(SAMPLES["TailnetEgress"])
    ingress = TailnetIngress.model_validate(SAMPLES["TailnetIngress"])
    site = TailnetSite.model_validate(SAMPLES["TailnetSite"])
    gateway = TailnetGateway.model_validate(SAMPLES["TailnetGateway"])

    assert ingress_input(ingress) == IngressInput("tag:ingress-observability", (443, 9095))
    assert site_input(site) == SiteInput(
        "branch1", "tag:site-branch1", ("198.18.50.0/24", "198.18.20.0/28", "198.18.60.5/32")
    )
    # siteRoutes are approved through TailnetSites; the gateway itself gets its LoadBalancer range.
    assert gateway_input(gateway) == GatewayInput("tag:gateway-cluster1", ("10.250.0.0/24",))

    derived = derive_from_objects(egresses=[egress], ingresses=[ingress], sites=[site], gateways=[gateway])
    assert derived.tags == (
        "tag:egress-branch1",
        "tag:gateway-cluster1",
        "tag:ingress-observability",
        "tag:site-branch1",
    )
    assert derived.routes == (
        RouteApproval("10.250.0.0/24", ("tag:gateway-cluster1",)),
        RouteApproval("198.18.20.0/28", ("tag:site-branch1",)),
        RouteApproval("198.18.50.0/24", ("tag:site-branch1",)),
        RouteApproval("198.18.50.10/32", ("tag:gateway-cluster1",)),
        RouteApproval("198.18.60.5/32", ("tag:site-branch1",)),
    )
    assert derived.grants == (
        Grant(("tag:egress-branch1",), ("198.18.50.10",), ("tcp:5432",)),
        Grant(("tag:egress-branch1",), ("ledger.tailnet.example.internal",), ("tcp:443",)),
    )


def test_a_shared_address_is_approved_for_its_holders_tag_and_granted_to_nobody() -> None:
    derived = derive(ingresses=[IngressInput("tag:web", (443,), shared_address="198.18.5.10"),
                                IngressInput("tag:v6", (443,), shared_address="2001:db8::10")])
    assert derived.routes == (RouteApproval("198.18.5.10/32", ("tag:web",)),
                              RouteApproval("2001:db8::10/128", ("tag:v6",)))
    assert derived.grants == ()


def test_only_the_holder_of_a_shared_address_gets_its_approval() -> None:
    def shared(name: str, tag: str, created: str) -> TailnetIngress:
        return TailnetIngress.model_validate({
            "metadata": {"name": name, "namespace": "shop", "creationTimestamp": created},
            "spec": {"tailnetRef": {"name": "tn"}, "tag": tag, "hostname": name, "replicas": 2,
                     "sharedAddress": "198.18.5.10",
                     "exposes": [{"name": "web", "port": 443, "backend": {"service": "web", "port": 80}}]}})

    first, later = shared("a", "tag:a", "2026-01-01T00:00:00Z"), shared("b", "tag:b", "2026-02-01T00:00:00Z")
    derived = derive_from_objects(ingresses=[later, first], shared_address_holders=[first])
    assert derived.routes == (RouteApproval("198.18.5.10/32", ("tag:a",)),)
    assert ingress_input(later, holds_address=False).shared_address is None
