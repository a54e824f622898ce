"""The Gateway API's reconcilers on the fake client and a fake Headscale: a Gateway of a tailnet
GatewayClass with an HTTPRoute gets the ingress's agent objects (owned by the Gateway), the Gateway
API's statuses on the Gateway and the route, and the class its Accepted; a Gateway of another
class is not written to; a Gateway with no route has no node; removing the class releases it all;
the policy owns its tag and the sweep counts its key."""

from __future__ import annotations

import copy
import json
from typing import Any

from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.controllers.gatewayapi import (
    CLASS_FIELD_MANAGER,
    FIELD_MANAGER,
    GatewayClassReconciler,
    Gateways,
    gatewayapi_reconciler,
    gateways_of_grant,
    gateways_selecting_namespaces,
    gateways_using_secret,
)
from tailnet_operator.controllers.gatewayapi_plans import Plans
from tailnet_operator.controllers.ingress import IngressSettings
from tailnet_operator.controllers.kinds import (
    API_GATEWAY,
    GATEWAY_CLASS,
    HTTP_ROUTE,
    REFERENCE_GRANT,
    TAILNET,
    TCP_ROUTE,
)
from tailnet_operator.controllers.sweep import references_from
from tailnet_operator.names import FINALIZER
from tailnet_operator.resources import gatewayapi as gw
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.resources.ingress import EXPOSES_FILE
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request, Result
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World
from .test_gatewayapi_translation import tls_data
from .test_ingress import FakeAgent

TENANT = "shop"
TAG = "tag:shop-edge"
OWNING = '{"tagOwners": {"tag:shop-edge": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
TENANCY = [{"namespaces": [TENANT], "tags": ["tag:shop-*"]}]
AGENT = "edge-gw-ingress-agent"
OWNED = ((DEPLOYMENT, AGENT), (SERVICE, AGENT), (NETWORK_POLICY, AGENT), (CONFIG_MAP, "edge-gw-ingress-config"),
         (SECRET, "edge-gw-ingress-auth-key"))
RECORD = "gatewayapi.shop.edge"


class GatewayWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.writer = Applier(self.kube, self.kube, field_manager=FIELD_MANAGER)
        self.gw = gatewayapi_reconciler(
            self.deps, self.writer,
            IngressSettings(agent_image="img", operator_namespace=NAMESPACE, operator_labels={"app": "op"}),
            agent_status=self.agent)
        self.classes = GatewayClassReconciler(
            self.kube, Applier(self.kube, self.kube, field_manager=CLASS_FIELD_MANAGER), self.clock)

    def add_class(self, name: str = "tailnet", tailnet: str = "tn", controller: str = gw.CONTROLLER) -> JSON:
        return self.kube.add(GATEWAY_CLASS, {"metadata": {"name": name}, "spec": {
            "controllerName": controller, "parametersRef": {"group": "tailnet.dev", "kind": "Tailnet",
                                                            "name": tailnet}}})

    def add_gateway(self, name: str = "edge", *, cls: str = "tailnet", listeners: list[JSON] | None = None) -> JSON:
        """A Gateway of ``cls``; its ``listeners`` (default: one HTTP listener for shop.example.test)."""
        return self.kube.add(API_GATEWAY, {
            "metadata": {"name": name, "namespace": TENANT,
                         "annotations": {lb.TAG_ANNOTATION: TAG, lb.HOSTNAME_ANNOTATION: "shop-edge"}},
            "spec": {"gatewayClassName": cls, "listeners": listeners or [
                {"name": "web", "port": 80, "protocol": "HTTP", "hostname": "shop.example.test"}]}})

    def add_route(self, name: str = "shop", *, gateway: str = "edge", **rule: Any) -> JSON:
        return self.kube.add(HTTP_ROUTE, {
            "metadata": {"name": name, "namespace": TENANT, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"parentRefs": [{"name": gateway}], "rules": [rule or {
                "matches": [{"path": {"type": "PathPrefix", "value": "/api"}}],
                "backendRefs": [{"name": "api", "port": 8080}]}]}})

    def get(self, resource: Any, name: str) -> JSON:
        found: JSON | None = self.kube.get(resource, name, TENANT if resource.namespaced else None)
        assert found is not None, (resource, name)
        return found

    async def reconcile(self, name: str = "edge") -> Result:
        return await self.gw.reconcile(Request(TENANT, name))


def _conditions(obj: JSON) -> dict[str, tuple[str, str]]:
    """An object's (or a route parent entry's) conditions by type: (status, reason)."""
    found = obj["conditions"] if "conditions" in obj else (obj.get("status") or {}).get("conditions")
    return {c["type"]: (c["status"], c["reason"]) for c in found or []}


async def world_with_tailnet(policy: str = OWNING) -> GatewayWorld:
    world = GatewayWorld()
    world.bootstrap_secret()
    world.add_tailnet(tenants=TENANCY)
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    world.add_class()
    world.kube.add(SERVICE, {"metadata": {"name": "api", "namespace": TENANT},
                             "spec": {"ports": [{"name": "http", "port": 8080}]}})
    return world


async def test_a_gateway_with_a_route_gets_a_key_the_agent_objects_and_the_gateway_apis_statuses() -> None:
    world = await world_with_tailnet()
    world.add_gateway()
    world.add_route()

    await world.reconcile()

    [key] = world.headscale.preauth_keys.values()
    assert key["aclTags"][0] == TAG
    gateway = world.get(API_GATEWAY, "edge")
    assert FINALIZER in gateway["metadata"]["finalizers"]
    for resource, name in OWNED:
        [owner] = world.get(resource, name)["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("Gateway", "edge")
    [expose] = parse_exposes(world.get(CONFIG_MAP, "edge-gw-ingress-config")["data"][EXPOSES_FILE])
    assert (expose.port, expose.plaintext, [h.name for h in expose.hosts]) == (80, True, ["shop.example.test"])
    [host] = expose.hosts
    assert [(r.path, r.backend and (r.backend.host, r.backend.port)) for r in host.routes] == [
        ("/api", ("api.shop.svc", 8080))]
    assert world.kube.get(SECRET, RECORD, NAMESPACE) is not None
    # No node yet: Accepted, not Programmed, and the reason why in the message.
    assert _conditions(gateway) == {"Accepted": ("True", "Accepted"), "Programmed": ("False", "Pending")}
    programmed = next(c for c in gateway["status"]["conditions"] if c["type"] == "Programmed")
    assert "NotListening" in programmed["message"] or "AgentStatusUnknown" in programmed["message"], programmed
    [listener] = gateway["status"]["listeners"]
    assert (listener["name"], listener["attachedRoutes"]) == ("web", 1)
    [parent] = world.get(HTTP_ROUTE, "shop")["status"]["parents"]
    assert parent["controllerName"] == gw.CONTROLLER and parent["parentRef"]["name"] == "edge"
    assert _conditions(parent) == {"Accepted": ("True", "Accepted"), "ResolvedRefs": ("True", "ResolvedRefs")}
    assert "Ready" not in _conditions(gateway) and "preAuthKey" not in gateway["status"]


async def test_once_the_node_serves_the_gateway_is_programmed_with_the_nodes_addresses() -> None:
    world = await world_with_tailnet()
    world.add_gateway()
    world.add_route()
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys
    world.headscale.nodes = [{"id": "9", "name": "shop-edge", "givenName": "shop-edge", "online": True,
                              "tags": [TAG], "ipAddresses": ["100.64.0.9"], "preAuthKey": {"id": key_id}}]
    world.agent.doc = {"node": {"id": "9", "name": "shop-edge.tailnet.test.", "addresses": ["100.64.0.9"]},
                       "exposes": [{"name": "http-80-0", "port": 80, "mode": "http", "listening": True,
                                    "reachable": True, "hosts": []}]}

    await world.reconcile()

    gateway = world.get(API_GATEWAY, "edge")
    assert _conditions(gateway)["Programmed"] == ("True", "Programmed"), gateway["status"]
    assert gateway["status"]["addresses"] == [{"type": "IPAddress", "value": "100.64.0.9"},
                                              {"type": "Hostname", "value": "shop-edge.tailnet.test"}]
    writes = len(world.kube.writes)
    await world.reconcile()
    assert [w for w in world.kube.writes[writes:] if w[1] in ("Gateway", "HTTPRoute")] == [], \
        "an unchanged Gateway is not written again"


async def test_a_gateway_with_no_route_is_programmed_and_answers_404_until_routed() -> None:
    world = await world_with_tailnet()
    world.add_gateway()
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys
    [expose] = parse_exposes(world.get(CONFIG_MAP, "edge-gw-ingress-config")["data"][EXPOSES_FILE])
    assert [(h.name, h.routes, h.fallback) for h in expose.hosts] == [("shop.example.test", (), False)]
    world.headscale.nodes = [{"id": "9", "name": "shop-edge", "givenName": "shop-edge", "online": True,
                              "tags": [TAG], "ipAddresses": ["100.64.0.9"], "preAuthKey": {"id": key_id}}]
    # The probed backend of a port no route serves is no Service: no request reaches it.
    world.agent.doc = {"node": {"id": "9", "name": "shop-edge.tailnet.test.", "addresses": ["100.64.0.9"]},
                       "exposes": [{"name": "http-80-0", "port": 80, "mode": "http", "listening": True,
                                    "reachable": False, "hosts": []}]}

    await world.reconcile()

    gateway = world.get(API_GATEWAY, "edge")
    assert _conditions(gateway) == {"Accepted": ("True", "Accepted"), "Programmed": ("True", "Programmed")}
    assert gateway["status"]["addresses"][0] == {"type": "IPAddress", "value": "100.64.0.9"}
    assert gateway["status"]["listeners"][0]["attachedRoutes"] == 0


async def test_a_gateway_none_of_whose_listeners_can_be_served_has_no_node() -> None:
    world = await world_with_tailnet()
    world.add_gateway(listeners=[{"name": "raw", "port": 5432, "protocol": "UDP"}])

    await world.reconcile()

    assert world.headscale.preauth_keys == {}
    assert world.kube.get(DEPLOYMENT, AGENT, TENANT) is None
    found = world.get(API_GATEWAY, "edge")
    assert _conditions(found) == {"Accepted": ("False", "ListenersNotValid"), "Programmed": ("False", "Pending")}
    [listener] = found["status"]["listeners"]
    assert ("Accepted", "False", "UnsupportedProtocol") in [(c["type"], c["status"], c["reason"])
                                                           for c in listener["conditions"]]


async def test_a_gateway_waiting_for_its_certificate_is_served_once_the_secret_appears() -> None:
    """The Gateway API's conformance suite creates a listener's certificate after its Gateway. The
    Secret of a tenant namespace is fetched, not watched: the Gateway is looked at again."""
    world = await world_with_tailnet()
    world.add_gateway(listeners=[{"name": "web", "port": 443, "protocol": "HTTPS", "hostname": "shop.example.test",
                                 "tls": {"certificateRefs": [{"name": "shop-cert"}]}}])

    result = await world.reconcile()

    found = world.get(API_GATEWAY, "edge")
    assert _conditions(found)["Accepted"] == ("False", "ListenersNotValid")
    assert result.requeue_after is not None, "a missing Secret is looked for again"
    secret = world.kube.add(SECRET, {"metadata": {"name": "shop-cert", "namespace": TENANT},
                                     "type": "kubernetes.io/tls", "data": tls_data()})
    assert gateways_using_secret(world.kube)(secret) == [Request(TENANT, "edge")]
    assert gateways_using_secret(world.kube)({"metadata": {"name": "other", "namespace": TENANT}}) == []

    await world.reconcile()

    assert _conditions(world.get(API_GATEWAY, "edge"))["Accepted"] == ("True", "Accepted")
    assert world.kube.get(DEPLOYMENT, AGENT, TENANT) is not None


async def test_a_certificate_of_another_namespace_granted_to_the_gateway_is_copied_beside_it() -> None:
    world = await world_with_tailnet()
    world.add_gateway(listeners=[{"name": "web", "port": 443, "protocol": "HTTPS", "hostname": "shop.example.test",
                                 "tls": {"certificateRefs": [{"name": "wild", "namespace": "certs"}]}}])
    data = tls_data()
    world.kube.add(SECRET, {"metadata": {"name": "wild", "namespace": "certs"}, "type": "kubernetes.io/tls",
                            "data": {**data, "extra": "bm90IGNvcGllZA=="}})
    await world.reconcile()
    assert _conditions(world.get(API_GATEWAY, "edge"))["Accepted"] == ("False", "ListenersNotValid")

    world.kube.add(REFERENCE_GRANT, {"metadata": {"name": "to-shop", "namespace": "certs"}, "spec": {
        "from": [{"group": gw.GROUP, "kind": "Gateway", "namespace": TENANT}],
        "to": [{"group": "", "kind": "Secret", "name": "wild"}]}})
    await world.reconcile()

    name = gw.certificate_copy_name("edge", "certs", "wild")
    copied = world.get(SECRET, name)
    assert copied["data"] == data, "tls.crt and tls.key only"
    [owner] = copied["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("Gateway", "edge")
    assert _conditions(world.get(API_GATEWAY, "edge"))["Accepted"] == ("True", "Accepted")
    assert (SECRET, name) in Gateways(world.kube, Plans(world.kube)).named_objects(world.get(API_GATEWAY, "edge"))


async def test_a_gateway_of_another_class_is_never_written_to() -> None:
    world = await world_with_tailnet()
    world.add_class("other", controller="example.com/gateway")
    world.add_gateway(cls="other")
    world.add_route()
    writes = len(world.kube.writes)

    await world.reconcile()
    await world.classes.reconcile(Request("", "other"))

    assert world.kube.writes[writes:] == []


async def test_removing_the_class_releases_the_gateway_and_its_route_entries() -> None:
    world = await world_with_tailnet()
    world.add_gateway()
    world.add_route()
    await world.reconcile()
    [key] = world.headscale.preauth_keys.values()
    obj = copy.deepcopy(world.get(API_GATEWAY, "edge"))
    obj["spec"]["gatewayClassName"] = "elsewhere"
    world.kube.update(API_GATEWAY, obj)

    await world.reconcile()

    for resource, name in OWNED:
        assert world.kube.get(resource, name, TENANT) is None, (resource, name)
    assert key["expired"]
    released = world.get(API_GATEWAY, "edge")
    assert FINALIZER not in (released["metadata"].get("finalizers") or [])
    assert not (released.get("status") or {}).get("conditions")
    assert not (world.get(HTTP_ROUTE, "shop").get("status") or {}).get("parents")
    assert world.events.reasons[-1] == "GatewayReleased"


async def test_the_class_is_accepted_with_its_features_while_its_tailnet_exists() -> None:
    world = await world_with_tailnet()
    world.add_class("dangling", tailnet="nowhere")

    await world.classes.reconcile(Request("", "tailnet"))
    await world.classes.reconcile(Request("", "dangling"))

    good = world.get(GATEWAY_CLASS, "tailnet")
    assert _conditions(good) == {"Accepted": ("True", "Accepted")}
    assert [f["name"] for f in good["status"]["supportedFeatures"]] == sorted(gw.SUPPORTED_FEATURES)
    assert _conditions(world.get(GATEWAY_CLASS, "dangling")) == {"Accepted": ("False", "InvalidParameters")}


async def test_the_policy_owns_its_tag_and_the_sweep_counts_its_key() -> None:
    world = await world_with_tailnet(policy='{"grants": []}')
    world.kube.add(CONFIG_MAP, {"metadata": {"name": "base", "namespace": NAMESPACE},
                                "data": {"policy.hujson": '{"grants": []}'}})
    tailnet = copy.deepcopy(world.tailnet_obj())
    tailnet["spec"]["policy"] = {"baseConfigMapRef": {"namespace": NAMESPACE, "name": "base", "key": "policy.hujson"},
                                 "mode": "Apply"}
    world.kube.update(TAILNET, tailnet)
    world.add_gateway()
    world.add_route()

    await world.reconcile_policy()
    assert TAG in (world.headscale.policy or "")
    await world.reconcile()
    [key_id] = world.headscale.preauth_keys

    refs = references_from(world.kube, "tn", NAMESPACE)
    assert key_id in refs.key_ids and TAG in refs.tags


async def test_a_grant_or_a_relabelled_namespace_wakes_only_the_gateways_it_may_concern() -> None:
    """Not every Gateway: a grant or a relabel must not queue them all behind a few workers."""
    world = await world_with_tailnet()
    world.add_gateway("edge")
    world.add_gateway("other")
    picky = copy.deepcopy(world.add_gateway("picky"))
    picky["spec"]["listeners"][0]["allowedRoutes"] = {"namespaces": {"from": "Selector", "selector": {}}}
    world.kube.update(API_GATEWAY, picky)
    world.kube.add(HTTP_ROUTE, {"metadata": {"name": "r", "namespace": "web"},
                                "spec": {"parentRefs": [{"name": "edge", "namespace": TENANT}]}})

    def grant(kind: str, namespace: str) -> JSON:
        return {"metadata": {"name": "g", "namespace": "data"},
                "spec": {"from": [{"group": gw.GROUP, "kind": kind, "namespace": namespace}], "to": []}}

    assert gateways_of_grant(world.kube)(grant("HTTPRoute", "web")) == [Request(TENANT, "edge")]
    assert sorted(r.name for r in gateways_of_grant(world.kube)(grant("Gateway", TENANT))) == [
        "edge", "other", "picky"]
    assert gateways_of_grant(world.kube)(grant("Gateway", "nobody")) == []
    assert gateways_selecting_namespaces(world.kube)({"metadata": {"name": "web"}}) == [Request(TENANT, "picky")]


async def test_a_tcp_listener_opens_its_port_with_its_first_tcproute_and_closes_it_with_the_last() -> None:
    """Before its first route a Gateway of TCP listeners is a node with no port open (its key and
    agent exist, so it gets its addresses); the route's port opens, and closes when the route goes."""
    world = await world_with_tailnet()
    world.add_gateway(listeners=[{"name": "db", "port": 5432, "protocol": "TCP"}])

    await world.reconcile()

    assert len(world.headscale.preauth_keys) == 1 and world.kube.get(DEPLOYMENT, AGENT, TENANT) is not None
    assert parse_exposes(world.get(CONFIG_MAP, "edge-gw-ingress-config")["data"][EXPOSES_FILE]) == ()
    found = world.get(API_GATEWAY, "edge")
    assert _conditions(found)["Accepted"] == ("True", "Accepted")
    assert "NoRoutes" not in json.dumps(found["status"])
    assert found["status"]["listeners"][0]["supportedKinds"] == [{"group": gw.GROUP, "kind": "TCPRoute"}]

    world.kube.add(TCP_ROUTE, {
        "metadata": {"name": "db", "namespace": TENANT, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"parentRefs": [{"name": "edge"}], "rules": [{"backendRefs": [{"name": "api", "port": 8080}]}]}})
    await world.reconcile()

    [expose] = parse_exposes(world.get(CONFIG_MAP, "edge-gw-ingress-config")["data"][EXPOSES_FILE])
    assert (expose.mode, expose.port, expose.backend.host, expose.backend.port) == ("tcp", 5432, "api.shop.svc", 8080)
    [parent] = world.get(TCP_ROUTE, "db")["status"]["parents"]
    assert _conditions(parent) == {"Accepted": ("True", "Accepted"), "ResolvedRefs": ("True", "ResolvedRefs")}

    await world.kube.delete(TCP_ROUTE, "db", TENANT)
    await world.reconcile()

    exposes = parse_exposes(world.get(CONFIG_MAP, "edge-gw-ingress-config")["data"][EXPOSES_FILE])
    assert exposes == (), "nothing goes on forwarding to the route's Service"
    assert world.kube.get(DEPLOYMENT, AGENT, TENANT) is not None
