"""The LoadBalancer class's reconciler on the fake client and a fake Headscale: a classed Service
gets the ingress's agent objects (owned by the Service) and a status a Service can hold; tenancy
refuses with an Event; UDP ports are skipped with an Event; removing the class releases it all."""

from __future__ import annotations

import copy
from typing import Any

from tailnet_operator.controllers.ingress import IngressSettings
from tailnet_operator.controllers.loadbalancer import FIELD_MANAGER, loadbalancer_reconciler
from tailnet_operator.controllers.sweep import references_from
from tailnet_operator.names import FINALIZER
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request, Resource, Result
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World
from .test_ingress import FakeAgent

TENANT = "shop"
TAG = "tag:shop-web"
OWNING = '{"tagOwners": {"tag:shop-web": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
TENANCY = [{"namespaces": [TENANT], "tags": ["tag:shop-*"]}]
AGENT = "web-lb-ingress-agent"
OWNED = ((DEPLOYMENT, AGENT), (SERVICE, AGENT), (NETWORK_POLICY, AGENT), (CONFIG_MAP, "web-lb-ingress-config"),
         (SECRET, "web-lb-ingress-auth-key"))


class Writes(Applier):
    """The Applier, refusing writes to the Service itself (not its status) as kube-apiserver does
    in a namespace that has not bound the tenant role."""

    refuse_services: bool = False

    async def apply(self, resource: Resource, body: JSON, **kwargs: Any) -> JSON:
        if self.refuse_services and resource == SERVICE and kwargs.get("subresource") != "status":
            raise Forbidden(403, "Forbidden", 'services "web" is forbidden: cannot patch in "shop"')
        return await super().apply(resource, body, **kwargs)


class LoadBalancerWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.writer = Writes(self.kube, self.kube, field_manager=FIELD_MANAGER)
        self.lb = loadbalancer_reconciler(
            self.deps, self.writer,
            IngressSettings(agent_image="img", operator_namespace=NAMESPACE, operator_labels={"app": "op"}),
            agent_status=self.agent)

    def add_service(self, name: str = "web", *, namespace: str = TENANT, ports: list[JSON] | None = None,
                    **spec: Any) -> JSON:
        body = {"type": "LoadBalancer", "loadBalancerClass": "tailnet.dev/tn",
                "ports": ports or [{"name": "http", "port": 80, "protocol": "TCP"}], **spec}
        return self.kube.add(SERVICE, {"metadata": {"name": name, "namespace": namespace,
                                                    "annotations": {lb.TAG_ANNOTATION: TAG,
                                                                    lb.HOSTNAME_ANNOTATION: "shop-gw"}},
                                       "spec": body})

    def svc(self, name: str = "web", namespace: str = TENANT) -> JSON:
        found = self.kube.get(SERVICE, name, namespace)
        assert found is not None
        return found

    def cond(self, type_: str, name: str = "web", namespace: str = TENANT) -> JSON:
        return next((c for c in (self.svc(name, namespace).get("status") or {}).get("conditions") or []
                     if c["type"] == type_), {})

    async def reconcile(self, name: str = "web", namespace: str = TENANT) -> Result:
        return await self.lb.reconcile(Request(namespace, name))


async def world_with_tailnet(policy: str = OWNING) -> LoadBalancerWorld:
    world = LoadBalancerWorld()
    world.bootstrap_secret()
    world.add_tailnet(tenants=TENANCY)
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    return world


def node(node_id: str, key_id: str) -> JSON:
    return {"id": node_id, "name": "shop-gw", "givenName": "shop-gw", "online": True, "tags": [TAG],
            "ipAddresses": [f"100.64.0.{node_id}", f"fd7a:115c:a1e0::{node_id}"], "preAuthKey": {"id": key_id}}


async def test_a_classed_service_gets_a_key_and_the_ingress_agent_objects_owned_by_it() -> None:
    world = await world_with_tailnet()
    world.add_service()

    await world.reconcile()

    [key] = world.headscale.preauth_keys.values()
    assert key["aclTags"][0] == TAG and key["reusable"] and key["ephemeral"]
    svc = world.svc()
    assert FINALIZER in svc["metadata"]["finalizers"]
    for resource, name in OWNED:
        found = world.kube.get(resource, name, TENANT)
        assert found is not None, (resource, name)
        [owner] = found["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Service", "web", svc["metadata"]["uid"])
    deployment = world.kube.get(DEPLOYMENT, AGENT, TENANT)
    assert deployment is not None
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["AGENT_MODE"], env["TAILNET_HOSTNAME"]) == ("ingress", "shop-gw")
    assert world.kube.get(SECRET, "loadbalancer.shop.web", NAMESPACE) is not None  # the key's record
    assert set(svc["status"]) == {"conditions", "loadBalancer"}  # a Service has no preAuthKey, observedGeneration
    assert svc["status"]["loadBalancer"] == {}  # no node yet
    assert world.cond("TagOwned")["status"] == world.cond("PreAuthKeyValid")["status"] == "True"
    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("Unknown", "AgentStatusUnknown")
    assert world.cond("PortsSupported")["status"] == "True"


async def test_once_the_node_registers_the_status_carries_its_addresses_and_magic_dns_name() -> None:
    world = await world_with_tailnet()
    world.add_service()
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys
    world.headscale.nodes = [node("9", key_id)]
    world.agent.doc = {"node": {"id": "9", "name": "shop-gw.tailnet.test.",
                                "addresses": ["100.64.0.9", "fd7a:115c:a1e0::9"]},
                       "exposes": [{"name": "http", "port": 80, "mode": "tcp", "listening": True,
                                    "reachable": True, "hosts": []}]}

    await world.reconcile()

    assert world.svc()["status"]["loadBalancer"] == {"ingress": [
        {"hostname": "shop-gw.tailnet.test"}, {"ip": "100.64.0.9", "ipMode": "Proxy"},
        {"ip": "fd7a:115c:a1e0::9", "ipMode": "Proxy"}]}
    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    assert "shop-gw.tailnet.test" in ready["message"]
    assert world.cond("HostnameAssigned")["status"] == "True"
    writes = len(world.kube.writes)
    await world.reconcile()
    assert world.kube.writes[writes:] == []  # nothing changed: nothing written


async def test_a_namespace_that_is_not_a_tenant_is_refused_with_an_event_and_gets_nothing() -> None:
    world = await world_with_tailnet()
    world.add_service(namespace="elsewhere")

    await world.reconcile(namespace="elsewhere")

    ready = world.cond("Ready", namespace="elsewhere")
    assert (ready["status"], ready["reason"]) == ("False", "NamespaceNotTenant")
    assert "NamespaceNotTenant" in world.events.reasons
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(DEPLOYMENT, AGENT, "elsewhere") is None


async def test_a_namespace_that_has_not_granted_the_operator_gets_the_command_in_its_status_and_nothing_else() -> None:
    world = await world_with_tailnet()
    world.writer.refuse_services = True
    world.add_service()

    await world.reconcile()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NamespaceNotGranted")
    assert f"kubectl -n {TENANT} create rolebinding" in ready["message"]
    assert FINALIZER not in (world.svc()["metadata"].get("finalizers") or [])
    assert world.headscale.preauth_keys == {}
    world.writer.refuse_services = False  # the namespace binds the tenant role

    await world.reconcile()

    assert FINALIZER in world.svc()["metadata"]["finalizers"] and world.headscale.preauth_keys


async def test_a_tag_outside_the_tenancy_is_refused() -> None:
    world = await world_with_tailnet()
    obj = world.add_service()
    obj = copy.deepcopy(obj)
    obj["metadata"]["annotations"][lb.TAG_ANNOTATION] = "tag:platform"
    world.kube.update(SERVICE, obj)

    await world.reconcile()

    assert world.cond("Ready")["reason"] == "TagNotAllowed"
    assert world.headscale.preauth_keys == {}


async def test_udp_ports_are_skipped_with_one_event() -> None:
    world = await world_with_tailnet()
    world.add_service(ports=[{"name": "http", "port": 80, "protocol": "TCP"},
                             {"name": "dns", "port": 53, "protocol": "UDP"}])

    await world.reconcile()
    await world.reconcile()

    cond = world.cond("PortsSupported")
    assert (cond["status"], cond["reason"]) == ("False", "PortsSkipped")
    assert "UDP port dns 53" in cond["message"]
    assert world.events.reasons.count("PortsSkipped") == 1


async def test_a_service_without_the_class_is_not_written_to() -> None:
    world = await world_with_tailnet()
    world.add_service(type="ClusterIP", loadBalancerClass=None)
    writes = len(world.kube.writes)

    await world.reconcile()

    assert world.kube.writes[writes:] == []


async def test_removing_the_class_deletes_the_objects_expires_the_key_and_lets_go() -> None:
    world = await world_with_tailnet()
    world.add_service()
    await world.reconcile()
    [key] = world.headscale.preauth_keys.values()
    obj = copy.deepcopy(world.svc())
    obj["spec"]["type"] = "ClusterIP"
    obj["spec"].pop("loadBalancerClass")
    world.kube.update(SERVICE, obj)

    await world.reconcile()

    for resource, name in OWNED:
        assert world.kube.get(resource, name, TENANT) is None, (resource, name)
    assert key["expired"]
    assert world.kube.get(SECRET, "loadbalancer.shop.web", NAMESPACE) is None
    svc = world.svc()
    assert FINALIZER not in (svc["metadata"].get("finalizers") or [])
    assert not (svc.get("status") or {}).get("conditions")
    assert world.events.reasons[-1] == "LoadBalancerReleased"


async def test_removing_the_class_clears_a_status_written_before_anything_was_served() -> None:
    world = await world_with_tailnet()
    world.add_service(loadBalancerClass="tailnet.dev/missing")
    await world.reconcile()
    assert world.cond("Ready")["reason"] == "TailnetNotFound"
    assert FINALIZER not in (world.svc()["metadata"].get("finalizers") or [])
    obj = copy.deepcopy(world.svc())
    obj["spec"] = {"type": "ClusterIP", "ports": obj["spec"]["ports"]}
    world.kube.update(SERVICE, obj)

    await world.reconcile()

    assert not (world.svc().get("status") or {}).get("conditions")
    assert "LoadBalancerReleased" not in world.events.reasons  # nothing was served


async def test_a_deleted_service_has_its_key_expired_before_the_finalizer_goes() -> None:
    world = await world_with_tailnet()
    world.add_service()
    await world.reconcile()
    [key] = world.headscale.preauth_keys.values()

    await world.kube.delete(SERVICE, "web", TENANT)
    await world.reconcile()

    assert key["expired"]
    assert world.kube.get(SERVICE, "web", TENANT) is None
    assert world.kube.get(SECRET, "loadbalancer.shop.web", NAMESPACE) is None
    assert "PreAuthKeyExpired" in world.events.reasons


async def test_the_orphan_sweep_counts_a_served_services_key_and_tag() -> None:
    world = await world_with_tailnet()
    world.add_service()
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys

    refs = references_from(world.kube, "tn", NAMESPACE)

    assert key_id in refs.key_ids and TAG in refs.tags  # so neither its key nor its node is swept
    assert TAG not in references_from(world.kube, "other", NAMESPACE).tags
