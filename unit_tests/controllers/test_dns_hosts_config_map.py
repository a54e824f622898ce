"""The hosts ConfigMap: CoreDNS's configuration and another Tailnet's hosts file are never written;
a ConfigMap the operator did not create is written but never owned (so never garbage-collected
with the Tailnet); a write kube-apiserver refuses is reported, not retried in a loop."""

from __future__ import annotations

from typing import Any

from tailnet_operator.controllers.dns import DnsReconciler
from tailnet_operator.runtime import CONFIG_MAP, Applier, EventRecorder, Request, Resource
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World

COREFILE = {"Corefile": ".:53 {\n    kubernetes cluster.local\n}\n"}


def world_naming(name: str) -> tuple[World, JSON]:
    world = World()
    tailnet = world.add_tailnet(dns={"hostsConfigMap": {"namespace": "kube-system", "name": name},
                                     "zones": ["example.internal"]})
    return world, tailnet


def reconciler(world: World, writer: Any = None) -> DnsReconciler:
    recorder = EventRecorder(world.events, reporting_instance="test", clock=world.clock)
    return DnsReconciler(world.kube, writer or Applier(world.kube, world.kube, field_manager="tailnet-operator-dns"),
                         namespace=NAMESPACE, events=recorder)


def config_map(name: str, data: dict[str, str], **meta: Any) -> JSON:
    return {"metadata": {"name": name, "namespace": "kube-system", **meta}, "data": data}


async def test_corednss_own_configuration_is_never_written_and_the_tailnet_says_why() -> None:
    world, _ = world_naming("coredns")
    world.kube.add(CONFIG_MAP, config_map("coredns", COREFILE, labels={"k8s-app": "kube-dns"}))
    before = world.kube.get(CONFIG_MAP, "coredns", "kube-system")

    await reconciler(world).reconcile(Request("", "tn"))

    after = world.kube.get(CONFIG_MAP, "coredns", "kube-system")
    assert after == before, "not taken over: no ownerReference, no hosts key"
    assert world.events.reasons == ["HostsConfigMapRefused"]


async def test_corednss_name_is_refused_before_the_configmap_exists() -> None:
    world, _ = world_naming("coredns")
    await reconciler(world).reconcile(Request("", "tn"))
    assert world.kube.get(CONFIG_MAP, "coredns", "kube-system") is None
    assert world.events.reasons == ["HostsConfigMapRefused"]


async def test_a_configmap_the_operator_did_not_create_is_written_but_never_owned() -> None:
    world, _ = world_naming("site-hosts")
    world.kube.add(CONFIG_MAP, config_map("site-hosts", {"hosts": "# placeholder\n", "README": "for CoreDNS"},
                                          labels={"app": "coredns-extras"}))

    await reconciler(world).reconcile(Request("", "tn"))

    written = world.kube.get(CONFIG_MAP, "site-hosts", "kube-system")
    assert written is not None and written["data"]["hosts"].startswith("# Managed by tailnet-operator")
    assert written["data"]["README"] == "for CoreDNS", "only the hosts key is the operator's"
    meta = written["metadata"]
    assert not meta.get("ownerReferences"), "the Tailnet's deletion must not garbage-collect it"
    assert meta["labels"] == {"app": "coredns-extras", "tailnet.dev/tailnet": "tn"}
    assert world.events.reasons == []


async def test_a_configmap_another_live_tailnet_writes_is_refused() -> None:
    world, _ = world_naming("site-hosts")
    world.add_tailnet("other", dns={"hostsConfigMap": {"namespace": "kube-system", "name": "site-hosts"},
                                    "zones": ["example.internal"]})
    world.kube.add(CONFIG_MAP, config_map("site-hosts", {"hosts": "# placeholder\n"}))
    await reconciler(world).reconcile(Request("", "other"))
    held = world.kube.get(CONFIG_MAP, "site-hosts", "kube-system")

    await reconciler(world).reconcile(Request("", "tn"))

    assert world.kube.get(CONFIG_MAP, "site-hosts", "kube-system") == held
    assert world.events.reasons == ["HostsConfigMapRefused"]


async def test_another_tailnets_hosts_file_is_not_taken_over() -> None:
    world, _ = world_naming("tailnet-hosts")
    other = world.add_tailnet("other", dns={"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"},
                                            "zones": ["example.internal"]})
    await reconciler(world).reconcile(Request("", "other"))
    held = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert held is not None and held["metadata"]["ownerReferences"][0]["uid"] == other["metadata"]["uid"]

    await reconciler(world).reconcile(Request("", "tn"))

    assert world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system") == held
    assert world.events.reasons == ["HostsConfigMapRefused"]


async def test_the_operators_own_hosts_file_is_created_then_kept_up_to_date() -> None:
    world, tailnet = world_naming("tailnet-hosts")
    dns = reconciler(world)
    await dns.reconcile(Request("", "tn"))
    created = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert created is not None and created["metadata"]["ownerReferences"][0]["uid"] == tailnet["metadata"]["uid"]
    assert created["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tailnet-operator"

    world.kube.update(CONFIG_MAP, {**created, "data": {"hosts": "# edited by hand\n"}})
    await dns.reconcile(Request("", "tn"))

    again = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert again is not None and again["data"]["hosts"] != "# edited by hand\n"
    assert world.events.reasons == []


class Refusing(Applier):
    """kube-apiserver refusing every write (the install's RBAC names other hosts ConfigMaps)."""

    async def apply(self, resource: Resource, body: JSON, **kwargs: Any) -> JSON:
        raise Forbidden(403, "Forbidden", f'configmaps "{body["metadata"]["name"]}" is forbidden')


async def test_a_write_the_rbac_refuses_is_reported_and_looked_at_again_later() -> None:
    world, _ = world_naming("other-hosts")
    result = await reconciler(world, Refusing(world.kube, world.kube, field_manager="x")).reconcile(
        Request("", "tn"))
    assert world.events.reasons == ["HostsConfigMapRefused"]
    assert result.requeue_after is not None and result.requeue_after >= 60


async def test_the_hosts_file_of_a_tailnet_that_is_gone_is_taken_over_by_the_one_naming_it_now() -> None:
    world, tailnet = world_naming("tailnet-hosts")
    world.kube.add(CONFIG_MAP, config_map("tailnet-hosts", {"hosts": ""}, labels={
        "app.kubernetes.io/managed-by": "tailnet-operator"}, ownerReferences=[{
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "Tailnet", "name": "tn", "uid": "uid-of-a-deleted-one",
            "controller": True, "blockOwnerDeletion": True}]))

    await reconciler(world).reconcile(Request("", "tn"))

    taken = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert taken is not None
    # (kube-apiserver also drops the old reference: the DNS reconciler's apply owned it; the fake
    # client does not track owners of list items)
    assert tailnet["metadata"]["uid"] in [o["uid"] for o in taken["metadata"]["ownerReferences"]]
    assert world.events.reasons == []
