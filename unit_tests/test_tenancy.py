"""The tenancy rules (tailnet_operator.tenancy): pure, on parsed objects."""

from __future__ import annotations

from typing import Any

import pytest

from hack.crds import load_samples
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.controllers.ingress import zones_of
from tailnet_operator.resources import ingress as build
from tailnet_operator.tenancy import (
    Claim,
    claim_order,
    claimed,
    first_holders,
    judge,
    name_allowed,
    policy_reserved_tags,
    shared_address_holders,
    shared_routes,
    shares_tag,
    tag_allowed,
    taken,
)

ZONE = "tailnet.example.internal"
SHOP = {"namespaces": ["shop"], "tags": ["tag:shop-*"], "dnsNames": [f"*.shop.{ZONE}"]}


def tailnet(*tenants: dict[str, Any], dns: bool = True) -> Tailnet:
    spec: dict[str, Any] = {"loginURL": "https://hs.example.internal",
                            "bootstrapKeySecretRef": {"namespace": "tailnet-system", "name": "b"}}
    if tenants:
        spec["tenants"] = list(tenants)
    if dns:
        spec["dns"] = {"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"}, "zones": [ZONE]}
    return Tailnet.model_validate({"metadata": {"name": "tn"}, "spec": spec})


def ingress(namespace: str = "shop", tag: str = "tag:shop-web", *, template: str | None = None,
            host: str | None = None, alias: str | None = None, name: str = "web",
            created: str = "2026-01-01T00:00:00Z", shared: str | None = None) -> TailnetIngress:
    expose: dict[str, Any] = {"name": "web", "port": 443, "backend": {"service": "web", "port": 80}}
    if host is not None:
        expose |= {"mode": "http", "hosts": [{"name": host, "tls": {"secretName": "web-tls"},
                                              **({"alias": alias} if alias else {})}]}
    spec: dict[str, Any] = {"tailnetRef": {"name": "tn"}, "tag": tag, "hostname": "web", "exposes": [expose]}
    if template:
        spec["dnsTemplate"] = template
    if shared:
        spec |= {"sharedAddress": shared, "replicas": 2}
    return TailnetIngress.model_validate({"metadata": {"name": name, "namespace": namespace,
                                                       "creationTimestamp": created}, "spec": spec})


def verdict(ing: TailnetIngress, net: Tailnet, reserved: set[str] | None = None) -> str | None:
    names = build.dns_names(ing, [ZONE]) if net.spec.dns else []
    refusal = judge(ing, net, reserved=reserved or set(), names=names)
    return None if refusal is None else refusal.reason


def test_a_namespace_no_entry_names_gets_nothing_even_without_tenants() -> None:
    assert verdict(ingress(namespace="other"), tailnet(SHOP)) == "NamespaceNotTenant"
    assert verdict(ingress(), tailnet()) == "NamespaceNotTenant"


def test_the_refusal_says_what_to_ask_the_admin_for() -> None:
    refusal = judge(ingress(namespace="other"), tailnet(SHOP), reserved=(), names=())
    assert refusal is not None
    assert "namespace other is not a tenant of the Tailnet tn" in refusal.message
    assert "spec.tenants" in refusal.message and "nothing was created on the tailnet" in refusal.message


def test_a_tag_under_the_prefix_is_allowed_and_one_outside_it_is_not() -> None:
    assert verdict(ingress(tag="tag:shop-web"), tailnet(SHOP)) is None
    assert verdict(ingress(tag="tag:payments"), tailnet(SHOP)) == "TagNotAllowed"


def test_a_reserved_tag_is_never_granted_by_a_prefix_only_by_its_exact_name() -> None:
    assert verdict(ingress(tag="tag:shop-egress"), tailnet(SHOP), {"tag:shop-egress"}) == "TagReserved"
    named = {**SHOP, "tags": ["tag:shop-*", "tag:shop-egress"]}
    assert verdict(ingress(tag="tag:shop-egress"), tailnet(named), {"tag:shop-egress"}) is None


def test_an_entry_for_another_namespace_grants_nothing_here() -> None:
    other = {"namespaces": ["payments"], "tags": ["tag:pay-*"], "dnsNames": [f"*.{ZONE}"]}
    assert verdict(ingress(tag="tag:pay-web"), tailnet(SHOP, other)) == "TagNotAllowed"


@pytest.mark.parametrize("template", ["kubernetes.default.svc.cluster.local", "headscale.tailnet-system.svc"])
def test_a_name_outside_the_zones_is_refused(template: str) -> None:
    assert verdict(ingress(template=template), tailnet(SHOP)) == "DNSNameOutsideZones"


def test_a_name_in_the_zone_but_outside_the_tenants_names_is_refused() -> None:
    assert verdict(ingress(host=f"grafana.ops.{ZONE}"), tailnet(SHOP)) == "DNSNameNotAllowed"
    assert verdict(ingress(host=f"web.shop.{ZONE}"), tailnet(SHOP)) is None


def test_an_alias_counts_as_a_name_under_every_zone() -> None:
    # web.shop.<zone> is allowed; the alias "web" becomes web.<zone>, which is not.
    assert verdict(ingress(host=f"web.shop.{ZONE}", alias="web"), tailnet(SHOP)) == "DNSNameNotAllowed"


def test_without_dns_names_a_tenant_gets_none() -> None:
    no_names = {"namespaces": ["shop"], "tags": ["tag:shop-*"]}
    assert verdict(ingress(template=f"web.shop.{ZONE}"), tailnet(no_names)) == "DNSNameNotAllowed"
    assert verdict(ingress(), tailnet(no_names)) is None  # no names asked for


def test_a_tailnet_without_a_hosts_file_checks_no_names() -> None:
    assert verdict(ingress(template="kubernetes.default.svc.cluster.local"), tailnet(SHOP, dns=False)) is None


def test_patterns() -> None:
    assert tag_allowed("tag:shop-*", "tag:shop-") and not tag_allowed("tag:shop-*", "tag:shopx")
    assert tag_allowed("tag:a", "tag:a") and not tag_allowed("tag:a", "tag:ab")
    assert name_allowed("*.shop.z", "a.b.shop.z") and not name_allowed("*.shop.z", "shop.z")
    assert not name_allowed("*.shop.z", "evilshop.z") and name_allowed("x.z", "X.Z.")


def stored(namespace: str, name: str, created: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name, "creationTimestamp": created}}


def test_the_first_created_holds_a_name_whatever_order_the_claims_arrive_in() -> None:
    early = Claim(claim_order(stored("b", "x", "2026-01-01T00:00:00Z")), ("web.z",))
    late = Claim(claim_order(stored("a", "y", "2026-02-01T00:00:00Z")), ("web.z", "other.z"))
    for order in ([early, late], [late, early]):
        holders = first_holders(order)
        assert holders["web.z"] == early and holders["other.z"] == late
    refusal = taken(["web.z", "other.z"], late.rank, first_holders([late, early]))
    assert refusal is not None and refusal.reason == "DNSNameTaken"
    assert "web.z is held by TailnetIngress b/x" in refusal.message and "other.z" not in refusal.message
    assert taken(["web.z"], early.rank, first_holders([late, early])) is None


def test_an_egress_alias_holds_a_name_before_any_ingress() -> None:
    egress = Claim(claim_order(stored("tailnet-system", "db", "2027-01-01T00:00:00Z"), egress=True), ("db.z",))
    ingress_claim = Claim(claim_order(stored("a", "y", "2026-01-01T00:00:00Z")), ("db.z",))
    assert first_holders([ingress_claim, egress])["db.z"] == egress


def test_the_policys_grant_sources_and_approvers_are_reserved() -> None:
    policy = {"grants": [{"src": ["tag:ci", "group:dev"], "dst": ["tag:db"]}],
              "acls": [{"action": "accept", "src": ["tag:ops"], "dst": ["*:*"]}],
              "autoApprovers": {"routes": {"10.0.0.0/8": ["tag:router"]}, "exitNode": ["tag:exit"]}}
    assert policy_reserved_tags(policy) == {"tag:ci", "tag:ops", "tag:router", "tag:exit"}


def test_the_shipped_samples_are_within_their_tenancy() -> None:
    """The sample TailnetIngress (make run applies it in namespace monitoring) asks only what the
    sample Tailnet's spec.tenants gives that namespace: its tag, its name and its alias under
    every zone."""
    samples = {s["kind"]: s for s in load_samples()}
    sample_tailnet = Tailnet.model_validate(samples["Tailnet"])
    raw = samples["TailnetIngress"]
    sample_ingress = TailnetIngress.model_validate({**raw, "metadata": {**raw["metadata"], "namespace": "monitoring"}})
    names = build.dns_names(sample_ingress, zones_of(sample_tailnet))
    assert judge(sample_ingress, sample_tailnet, reserved=set(), names=names) is None


SHARING = {**SHOP, "sharedAddresses": ["198.18.5.0/28"]}


def test_a_shared_address_needs_a_range_the_namespace_is_granted() -> None:
    assert verdict(ingress(shared="198.18.5.10"), tailnet(SHARING)) is None
    assert verdict(ingress(shared="198.18.5.20"), tailnet(SHARING)) == "SharedAddressNotAllowed"
    refusal = judge(ingress(shared="198.18.5.10"), tailnet(SHOP), reserved=set(), names=[])
    assert refusal is not None and refusal.reason == "SharedAddressNotAllowed"
    assert "may use no shared addresses" in refusal.message and "(sharedAddresses)" in refusal.message


def test_a_shared_address_in_the_tailnets_reserved_networks_is_refused() -> None:
    net = tailnet(SHARING)
    net.spec.reserved_networks = ["198.18.5.8/29"]
    assert verdict(ingress(shared="198.18.5.10"), net) == "SharedAddressReserved"
    assert verdict(ingress(shared="198.18.5.2"), net) is None


def test_a_shared_address_belongs_to_its_first_claimant() -> None:
    early = ingress(name="a", shared="198.18.5.10")
    late = ingress(name="b", shared="198.18.5.10", created="2026-02-01T00:00:00Z")
    claims = [Claim(claim_order(i.model_dump(by_alias=True, mode="json")), claimed(i, [])) for i in (late, early)]
    refusal = taken(claimed(late, []), claims[0].rank, first_holders(claims))
    assert refusal is not None and refusal.reason == "SharedAddressTaken"
    assert "198.18.5.10 is held by TailnetIngress shop/a" in refusal.message
    assert taken(claimed(early, []), claims[1].rank, first_holders(claims)) is None
    assert shared_address_holders([late, early]) == [early], "only the holder's tag is approved for it"


def test_a_granted_shared_route_reserves_nothing_and_an_ungranted_one_still_does() -> None:
    """The operator renders each shared address's route approved for its ingress's tag; that entry
    must not make the tag reserved (the ingress would refuse itself next pass). A claim the admin
    did not grant (outside the namespace's ranges) leaves the route's approvers reserved."""
    policy = {"autoApprovers": {"routes": {"198.18.5.10/32": ["tag:shop-web"],
                                           "198.18.9.10/32": ["tag:shop-db"]}}}
    granted, ungranted = ingress(shared="198.18.5.10"), ingress(tag="tag:shop-db", shared="198.18.9.10")
    routes = shared_routes([granted, ungranted], tailnet(SHARING))
    assert routes == {"198.18.5.10/32": {"tag:shop-web"}}
    assert policy_reserved_tags(policy, shared=routes) == {"tag:shop-db"}
    assert policy_reserved_tags(policy) == {"tag:shop-web", "tag:shop-db"}


def test_a_namespace_shares_a_gateways_tag_only_as_it_could_use_it_itself() -> None:
    """An HTTPRoute of another namespace puts that namespace's Services behind the Gateway's node."""
    net = tailnet({"namespaces": ["shop"], "tags": ["tag:shop-*", "tag:edge"]},
                  {"namespaces": ["web"], "tags": ["tag:shop-*"]},
                  {"namespaces": ["named"], "tags": ["tag:edge"]})
    assert shares_tag(net, "shop", "shop", "tag:anything")  # its own namespace: judged with the Gateway
    assert shares_tag(net, "shop", "web", "tag:shop-web")   # both by prefix: the Gateway proved it unreserved
    assert not shares_tag(net, "shop", "web", "tag:edge")   # the owner has it by name: so must the route's
    assert shares_tag(net, "shop", "named", "tag:edge")
    assert not shares_tag(net, "shop", "stranger", "tag:shop-web")
