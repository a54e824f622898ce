"""The DNS reconciler on the fake client: aliases to their target Service's ClusterIP,
deterministic output, no write when nothing changed, and never emptied by a failed read."""

from __future__ import annotations

from tailnet_operator.controllers.dns import DnsReconciler, parse_hosts, render_hosts
from tailnet_operator.controllers.kinds import TAILNET_EGRESS, TAILNET_INGRESS
from tailnet_operator.resources import ingress as ingress_build
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World

DNS = {"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"}, "zones": ["example.internal"]}
TENANTS = [{"namespaces": ["tenant"], "tags": ["tag:ingress-*"], "dnsNames": ["*.example.internal"],
            "sharedAddresses": ["198.18.5.0/28"]}]


def make_world() -> tuple[World, DnsReconciler]:
    world = World()
    world.add_tailnet(dns=DNS, tenants=TENANTS)
    reconciler = DnsReconciler(world.kube, Applier(world.kube, world.kube, field_manager="tailnet-operator-dns"),
                               namespace=NAMESPACE)
    return world, reconciler


def add_egress(world: World, namespace: str = NAMESPACE, name: str = "db") -> None:
    world.kube.add(TAILNET_EGRESS, {"metadata": {"name": name, "namespace": namespace}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 443}],
                     "aliases": ["ledger.example.internal", "api.ledger.example.internal"]}]}})


def add_service(world: World, name: str, ip: str, egress: str = "db") -> None:
    world.kube.add(SERVICE, {"metadata": {"name": name, "namespace": NAMESPACE,
                                          "labels": {"tailnet.dev/egress": egress}}, "spec": {"clusterIP": ip}})


def hosts(world: World) -> str:
    cm = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert cm is not None
    text: str = cm["data"]["hosts"]
    return text


async def test_each_alias_points_at_its_target_services_cluster_ip() -> None:
    world, dns = make_world()
    add_egress(world)
    add_service(world, "ledger", "198.19.128.40")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {"ledger.example.internal": "198.19.128.40",
                                         "api.ledger.example.internal": "198.19.128.40"}
    cm: JSON | None = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert cm is not None and cm["metadata"]["ownerReferences"][0]["kind"] == "Tailnet"


async def test_the_file_is_deterministic_and_a_second_reconcile_writes_nothing() -> None:
    world, dns = make_world()
    add_egress(world)
    add_service(world, "ledger", "198.19.128.40")
    await dns.reconcile(Request("", "tn"))
    writes = list(world.kube.writes)

    await dns.reconcile(Request("", "tn"))

    assert world.kube.writes == writes
    assert render_hosts({"b": "1.1.1.1", "a": "2.2.2.2"}) == render_hosts({"a": "2.2.2.2", "b": "1.1.1.1"})


async def test_an_unreadable_service_keeps_the_alias_it_had() -> None:
    world, dns = make_world()
    add_egress(world)
    add_service(world, "ledger", "198.19.128.40")
    await dns.reconcile(Request("", "tn"))
    await world.kube.delete(SERVICE, "ledger", NAMESPACE)  # as a cache that has not caught up

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world))["ledger.example.internal"] == "198.19.128.40"


async def test_egresses_outside_the_operator_namespace_add_no_names() -> None:
    world, dns = make_world()
    add_egress(world, namespace="tenant")
    add_service(world, "ledger", "198.19.128.40")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {}


async def test_an_alias_outside_the_zones_is_left_out() -> None:
    world, dns = make_world()
    world.kube.add(TAILNET_EGRESS, {"metadata": {"name": "db", "namespace": NAMESPACE}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 443}],
                     "aliases": ["ledger.example.internal", "ledger.elsewhere.test", "notexample.internal"]}]}})
    add_service(world, "ledger", "198.19.128.40")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {"ledger.example.internal": "198.19.128.40"}


async def test_a_service_name_another_egress_holds_gives_its_alias_no_address() -> None:
    world, dns = make_world()
    add_egress(world)
    add_service(world, "ledger", "198.19.128.40", egress="older")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {}


def add_ingress(world: World, *, addresses: list[str] | None = None, name: str = "shop", namespace: str = "tenant",
                created: str = "2026-01-01T00:00:00Z", template: str = "{hostname}.example.internal",
                shared: str | None = None) -> None:
    """An ingress, and with ``addresses`` its record in the operator's namespace as the Ingress
    reconciler writes it (the node's addresses from Headscale)."""
    body: JSON = {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop", "hostname": f"{name}-gw", "dnsTemplate": template,
        "exposes": [{"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 80},
                     "hosts": [{"name": f"{name}.apps.example.internal", "alias": name,
                                "tls": {"secretName": "t"}}]}]}}
    if shared is not None:
        body["spec"] |= {"sharedAddress": shared, "replicas": 2}
    if world.kube.get(TAILNET_INGRESS, name, namespace) is None:
        world.kube.add(TAILNET_INGRESS, body)
    if addresses is None:
        return
    record_name = ingress_build.record_name(namespace, name)
    record: JSON = {"metadata": {"name": record_name, "namespace": NAMESPACE,
                                 "annotations": {ingress_build.NODE_ADDRESS_ANNOTATION: ",".join(addresses)}}}
    if (current := world.kube.get(SECRET, record_name, NAMESPACE)) is None:
        world.kube.add(SECRET, record)
    else:
        world.kube.update(SECRET, {**current, "metadata": {**current["metadata"], **record["metadata"]}})


async def test_each_ingress_name_and_alias_points_at_the_ingress_nodes_ipv4_address() -> None:
    world, dns = make_world()
    add_ingress(world, addresses=["fd7a:115c:a1e0::9", "100.64.0.9"])

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {"shop-gw.example.internal": "100.64.0.9",
                                         "shop.apps.example.internal": "100.64.0.9",
                                         "shop.example.internal": "100.64.0.9"}


async def test_an_ingress_without_an_address_keeps_what_answers_and_a_deleted_one_leaves() -> None:
    world, dns = make_world()
    add_ingress(world)
    await dns.reconcile(Request("", "tn"))
    assert parse_hosts(hosts(world)) == {}, "no address yet: no names"

    add_ingress(world, addresses=["100.64.0.9"])
    await dns.reconcile(Request("", "tn"))
    add_ingress(world, addresses=[])
    await dns.reconcile(Request("", "tn"))
    assert parse_hosts(hosts(world))["shop.apps.example.internal"] == "100.64.0.9", "a lost address keeps the name"

    await world.kube.delete(TAILNET_INGRESS, "shop", "tenant")
    await dns.reconcile(Request("", "tn"))
    assert parse_hosts(hosts(world)) == {}


async def test_an_egress_alias_wins_over_the_same_ingress_name() -> None:
    world, dns = make_world()
    add_egress(world)
    add_service(world, "ledger", "198.19.128.40")
    world.kube.add(TAILNET_INGRESS, {"metadata": {"name": "ledger", "namespace": "tenant"}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-l", "hostname": "ledger",
        "exposes": [{"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 80},
                     "hosts": [{"name": "ledger.example.internal", "tls": {"secretName": "t"}}]}]}})
    world.kube.add(SECRET, {"metadata": {"name": ingress_build.record_name("tenant", "ledger"), "namespace": NAMESPACE,
                                         "annotations": {ingress_build.NODE_ADDRESS_ANNOTATION: "100.64.0.5"}}})

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world))["ledger.example.internal"] == "198.19.128.40"


# -- the trust boundary ---------------------------------------------------------------------------


async def test_an_address_the_tenant_writes_into_the_ingress_status_is_never_used() -> None:
    world, dns = make_world()
    add_ingress(world, template="kubernetes.example.internal")
    current = world.kube.get(TAILNET_INGRESS, "shop", "tenant")
    assert current is not None
    world.kube.update(TAILNET_INGRESS, {**current, "status": {"node": {"id": "9", "addresses": ["10.96.0.1"]}}})

    await dns.reconcile(Request("", "tn"))

    assert "10.96.0.1" not in hosts(world)


async def test_names_outside_the_zones_or_the_tenants_names_are_never_written() -> None:
    world, dns = make_world()
    add_ingress(world, addresses=["100.64.0.9"], template="kubernetes.default.svc.cluster.local")
    add_ingress(world, addresses=["100.64.0.8"], name="other", namespace="not-a-tenant")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world)) == {}


async def test_a_name_two_ingresses_claim_goes_to_the_first_created() -> None:
    world, dns = make_world()
    add_ingress(world, addresses=["100.64.0.2"], name="late", created="2026-03-01T00:00:00Z",
                template="web.example.internal")
    add_ingress(world, addresses=["100.64.0.1"], name="early", created="2026-01-01T00:00:00Z",
                template="web.example.internal")

    await dns.reconcile(Request("", "tn"))

    assert parse_hosts(hosts(world))["web.example.internal"] == "100.64.0.1"


async def test_the_names_of_an_ingress_whose_replicas_share_an_address_point_at_it() -> None:
    """Whichever replica holds the route, the names answer; the address itself is no name, and a
    later ingress claiming the same address keeps its node's address (it is refused the shared one)."""
    world, dns = make_world()
    add_ingress(world, addresses=["100.64.0.9"], shared="198.18.5.10")
    add_ingress(world, addresses=["100.64.0.12"], name="late", created="2026-02-01T00:00:00Z", shared="198.18.5.10")

    await dns.reconcile(Request("", "tn"))

    entries = parse_hosts(hosts(world))
    assert {n: a for n, a in entries.items() if n.startswith("shop")} == {
        "shop-gw.example.internal": "198.18.5.10", "shop.apps.example.internal": "198.18.5.10",
        "shop.example.internal": "198.18.5.10"}
    assert entries["late-gw.example.internal"] == "100.64.0.12"
    assert "198.18.5.10" not in entries
