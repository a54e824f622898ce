"""The IngressClass's reconciler on the fake client and a fake Headscale: an Ingress of a tailnet
class gets the ingress's agent objects (owned by the Ingress) and ``status.loadBalancer``; what
would be conditions goes to Events; an Ingress of another class is not written to; removing the
class releases it all; the policy owns its tag."""

from __future__ import annotations

import copy
from typing import Any

from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.controllers.ingress import IngressSettings
from tailnet_operator.controllers.ingressclass import FIELD_MANAGER, ingressclass_reconciler
from tailnet_operator.controllers.kinds import INGRESS, INGRESS_CLASS, TAILNET
from tailnet_operator.controllers.sweep import references_from
from tailnet_operator.names import FINALIZER
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.resources.ingress import EXPOSES_FILE
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request, Result
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World
from .test_ingress import FakeAgent

TENANT = "shop"
TAG = "tag:shop-web"
OWNING = '{"tagOwners": {"tag:shop-web": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
TENANCY = [{"namespaces": [TENANT], "tags": ["tag:shop-*"]}]
AGENT = "web-ing-ingress-agent"
OWNED = ((DEPLOYMENT, AGENT), (SERVICE, AGENT), (NETWORK_POLICY, AGENT), (CONFIG_MAP, "web-ing-ingress-config"),
         (SECRET, "web-ing-ingress-auth-key"))
RECORD = "ingressclass.shop.web"


class IngressClassWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.writer = Applier(self.kube, self.kube, field_manager=FIELD_MANAGER)
        self.ic = ingressclass_reconciler(
            self.deps, self.writer,
            IngressSettings(agent_image="img", operator_namespace=NAMESPACE, operator_labels={"app": "op"}),
            agent_status=self.agent)

    def add_class(self, name: str = "tailnet", tailnet: str = "tn", **extra: Any) -> JSON:
        return self.kube.add(INGRESS_CLASS, {"metadata": {"name": name}, "spec": {
            "controller": ic.CONTROLLER, "parameters": {"apiGroup": "tailnet.dev", "kind": "Tailnet", "name": tailnet},
            **extra}})

    def add_ingress(self, name: str = "web", *, namespace: str = TENANT, cls: str | None = "tailnet",
                    **spec: Any) -> JSON:
        body: JSON = {"tls": [{"hosts": ["shop.example.test"], "secretName": "shop-tls"}],
                      "rules": [{"host": "shop.example.test", "http": {"paths": [
                          {"path": "/api", "pathType": "Prefix",
                           "backend": {"service": {"name": "api", "port": {"name": "http"}}}},
                          {"path": "/", "pathType": "Prefix",
                           "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}], **spec}
        if cls is not None:
            body["ingressClassName"] = cls
        return self.kube.add(INGRESS, {"metadata": {"name": name, "namespace": namespace,
                                                    "annotations": {lb.TAG_ANNOTATION: TAG,
                                                                    lb.HOSTNAME_ANNOTATION: "shop-gw"}},
                                       "spec": body})

    def ing(self, name: str = "web", namespace: str = TENANT) -> JSON:
        found = self.kube.get(INGRESS, name, namespace)
        assert found is not None
        return found

    async def reconcile(self, name: str = "web", namespace: str = TENANT) -> Result:
        return await self.ic.reconcile(Request(namespace, name))


async def world_with_tailnet(policy: str = OWNING) -> IngressClassWorld:
    world = IngressClassWorld()
    world.bootstrap_secret()
    world.add_tailnet(tenants=TENANCY)
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    world.add_class()
    world.kube.add(SERVICE, {"metadata": {"name": "api", "namespace": TENANT},
                             "spec": {"ports": [{"name": "http", "port": 8080}]}})
    return world


async def test_an_ingress_of_the_class_gets_a_key_and_the_agent_objects_routing_its_paths() -> None:
    world = await world_with_tailnet()
    world.add_ingress()

    await world.reconcile()

    [key] = world.headscale.preauth_keys.values()
    assert key["aclTags"][0] == TAG
    obj = world.ing()
    assert FINALIZER in obj["metadata"]["finalizers"]
    for resource, name in OWNED:
        found = world.kube.get(resource, name, TENANT)
        assert found is not None, (resource, name)
        [owner] = found["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Ingress", "web", obj["metadata"]["uid"])
    config = world.kube.get(CONFIG_MAP, "web-ing-ingress-config", TENANT)
    assert config is not None
    [expose] = parse_exposes(config["data"][EXPOSES_FILE])
    [host] = expose.hosts
    assert [(r.path, r.backend and (r.backend.host, r.backend.port)) for r in host.routes] == [
        ("/api", ("api.shop.svc", 8080)), ("/", ("web.shop.svc", 80))]
    assert world.kube.get(SECRET, RECORD, NAMESPACE) is not None
    assert obj.get("status", {}) in ({}, {"loadBalancer": {}})  # an Ingress's status holds no conditions
    assert world.events.reasons[-1] == "SecretMissing"  # Ready, told as an Event
    assert "shop-tls" in world.events.notes[-1]


async def test_once_the_node_registers_the_status_carries_its_addresses_and_one_serving_event() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    world.kube.add(SECRET, {"metadata": {"name": "shop-tls", "namespace": TENANT}, "type": "kubernetes.io/tls",
                            "data": {"tls.crt": "Yw==", "tls.key": "aw=="}})
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys
    world.headscale.nodes = [{"id": "9", "name": "shop-gw", "givenName": "shop-gw", "online": True, "tags": [TAG],
                              "ipAddresses": ["100.64.0.9"], "preAuthKey": {"id": key_id}}]
    world.agent.doc = {"node": {"id": "9", "name": "shop-gw.tailnet.test.", "addresses": ["100.64.0.9"]},
                       "exposes": [{"name": "https-0", "port": 443, "mode": "http", "listening": True,
                                    "reachable": True, "hosts": []}]}

    await world.reconcile()
    await world.reconcile()

    assert world.ing()["status"] == {"loadBalancer": {"ingress": [{"hostname": "shop-gw.tailnet.test"},
                                                                  {"ip": "100.64.0.9"}]}}
    assert world.events.reasons.count("Serving") == 1


async def test_what_cannot_be_served_is_a_warning_event_and_nothing_is_made() -> None:
    world = await world_with_tailnet()
    world.add_ingress(rules=[{"host": "plain.example.test", "http": {"paths": [
        {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}])

    await world.reconcile()

    assert world.events.reasons[-1] == "HostWithoutTLS"
    assert "plain.example.test is in no spec.tls entry" in world.events.notes[-1]
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(DEPLOYMENT, AGENT, TENANT) is None


async def test_an_ingress_of_another_class_or_none_is_not_written_to() -> None:
    world = await world_with_tailnet()
    world.add_ingress("other", cls="nginx")
    world.add_ingress("classless", cls=None)
    writes = len(world.kube.writes)

    await world.reconcile("other")
    await world.reconcile("classless")

    assert world.kube.writes[writes:] == []


async def test_the_default_class_serves_an_ingress_without_a_class() -> None:
    world = await world_with_tailnet()
    cls = copy.deepcopy(world.kube.get(INGRESS_CLASS, "tailnet"))
    assert cls is not None
    cls["metadata"]["annotations"] = {ic.DEFAULT_CLASS_ANNOTATION: "true"}
    world.kube.update(INGRESS_CLASS, cls)
    world.add_ingress(cls=None)

    await world.reconcile()

    assert world.headscale.preauth_keys and world.kube.get(DEPLOYMENT, AGENT, TENANT) is not None


async def test_removing_the_class_deletes_the_objects_expires_the_key_and_lets_go() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile()
    [key] = world.headscale.preauth_keys.values()
    obj = copy.deepcopy(world.ing())
    obj["spec"]["ingressClassName"] = "nginx"
    world.kube.update(INGRESS, obj)

    await world.reconcile()

    for resource, name in OWNED:
        assert world.kube.get(resource, name, TENANT) is None, (resource, name)
    assert key["expired"]
    assert world.kube.get(SECRET, RECORD, NAMESPACE) is None
    assert FINALIZER not in (world.ing()["metadata"].get("finalizers") or [])
    assert world.events.reasons[-1] == "IngressReleased"


async def test_a_released_ingress_is_neither_read_for_its_agent_nor_written_again() -> None:
    """The release leaves the controller's status entry owning nothing (the empty status it
    applied); a later reconcile, as after every operator start, must see nothing to undo: in a
    namespace without the tenant role its reads of the agent's objects would be refused."""
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile()
    obj = copy.deepcopy(world.ing())
    obj["spec"]["ingressClassName"] = "nginx"
    world.kube.update(INGRESS, obj)
    await world.reconcile()
    world.kube.writes.clear()
    events = len(world.events.reasons)

    await world.reconcile()

    assert world.kube.writes == []
    assert len(world.events.reasons) == events


async def test_the_policy_owns_its_tag_and_the_sweep_counts_its_key() -> None:
    world = await world_with_tailnet(policy='{"grants": []}')
    world.kube.add(CONFIG_MAP, {"metadata": {"name": "base", "namespace": NAMESPACE},
                                "data": {"policy.hujson": '{"grants": []}'}})
    tailnet = copy.deepcopy(world.tailnet_obj())
    tailnet["spec"]["policy"] = {"baseConfigMapRef": {"namespace": NAMESPACE, "name": "base", "key": "policy.hujson"},
                                 "mode": "Apply"}
    world.kube.update(TAILNET, tailnet)
    world.add_ingress()

    await world.reconcile_policy()
    assert TAG in (world.headscale.policy or "")
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys

    refs = references_from(world.kube, "tn", NAMESPACE)
    assert key_id in refs.key_ids and TAG in refs.tags
