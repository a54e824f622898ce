"""The LoadBalancer class against kube-apiserver (with its garbage collector), Headscale and
tailscaled, the operator running from source; no node (no agent pod runs).

A tailscaled joins with the pre-auth key the operator minted and the Service's hostname, standing
in for the agent pod; its own ``tailscale status`` stands in for the agent's ``/status`` (the node
id, MagicDNS name and addresses it reports), which the operator could not reach without a node.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hack.localenv import ControlPlane, Headscale
from hack.localenv.tailscale import TailscaleNode
from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.headscale import installation_tag
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import (
    CONFIG_MAP,
    DEPLOYMENT,
    EVENT,
    NAMESPACE,
    NETWORK_POLICY,
    SECRET,
    SERVICE,
)
from tailnet_operator.runtime.kinds import Resource as KubeResource

from .conftest import TailscaleFactory
from .operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

TAG = "tag:lb-web"
BASE = '{"tagOwners": {"tag:lb-web": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}\n'
"""Everyone reaches everything; the Service's tag is owned (the policy render derives no tag from a Service)."""
AGENT = "web-lb-ingress-agent"
OWNED = ((DEPLOYMENT, AGENT), (SERVICE, AGENT), (NETWORK_POLICY, AGENT), (CONFIG_MAP, "web-lb-ingress-config"),
         (SECRET, "web-lb-ingress-auth-key"))


class StandInAgent:
    """The agent's ``/status`` as the tailscaled standing in for it knows it: its node (None until
    it has joined)."""

    def __init__(self) -> None:
        self.node: TailscaleNode | None = None

    async def read(self, owner: Any) -> JSON | None:
        if self.node is None:
            return None
        me = (await asyncio.to_thread(self.node.status))["Self"]
        return {"node": {"id": str(me["ID"]), "name": str(me["DNSName"]), "addresses": list(me["TailscaleIPs"])}}


@dataclass
class Scene:
    admin: Client
    kubeconfig: Path
    headscale: Headscale
    namespace: str
    """The operator's namespace: the bootstrap Secret, the base policy, the key records."""
    tenant: str
    stranger: str
    """A namespace the Tailnet's tenancy does not name."""
    tailnet: str


@pytest.fixture
async def scene(admin: Client, crds: ControlPlane, headscale: Headscale, operator_namespace: str
                ) -> AsyncIterator[Scene]:
    tenant, stranger = unique("lb-tenant"), unique("lb-stranger")
    for name in (tenant, stranger):
        await admin.create(NAMESPACE, {"metadata": {"name": name}})
    try:
        yield Scene(admin, crds.kubeconfig, headscale, operator_namespace, tenant, stranger,
                    f"{operator_namespace}-tn")
    finally:
        for name in (tenant, stranger):
            for obj in (await admin.list(SERVICE, name)).items:
                if obj["metadata"].get("finalizers"):
                    await admin.merge_patch(SERVICE, obj["metadata"]["name"], {"metadata": {"finalizers": None}},
                                            name)
            await admin.delete(NAMESPACE, name)


async def _tailnet(scene: Scene) -> str:
    """A Tailnet whose tenant may use ``tag:lb-*``, with the base policy in Apply mode."""
    admin, namespace = scene.admin, scene.namespace
    await create_bootstrap_secret(admin, namespace, "bootstrap", scene.headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                   "data": {"policy.hujson": BASE}})
    await admin.create(TAILNET, tailnet_object(
        scene.tailnet, scene.headscale, namespace,
        tenants=[{"namespaces": [scene.tenant], "tags": ["tag:lb-*"]}],
        policy={"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"},
                "mode": "Apply"}))
    return scene.tailnet


def service(name: str, namespace: str, *, cls: str | None, hostname: str, ports: list[JSON] | None = None) -> JSON:
    spec: JSON = {"type": "LoadBalancer", "ports": ports or [{"name": "http", "port": 80, "protocol": "TCP"}]}
    if cls is not None:
        spec["loadBalancerClass"] = cls
    return {"metadata": {"name": name, "namespace": namespace,
                         "annotations": {lb.TAG_ANNOTATION: TAG, lb.HOSTNAME_ANNOTATION: hostname}},
            "spec": spec}


async def _get(admin: Client, resource: KubeResource, name: str, namespace: str | None = None) -> JSON | None:
    try:
        return await admin.get(resource, name, namespace)
    except NotFound:
        return None


def _getter(admin: Client, resource: KubeResource, name: str, namespace: str) -> Callable[[], Awaitable[JSON | None]]:
    return lambda: _get(admin, resource, name, namespace)


async def _reasons(admin: Client, namespace: str, name: str, wanted: set[str]) -> set[str] | None:
    reasons = {e["reason"] for e in (await admin.list(EVENT, namespace)).items
               if e.get("regarding", {}).get("kind") == "Service" and e["regarding"].get("name") == name}
    return reasons if wanted <= reasons else None


def _is_expired(key: JSON) -> bool:
    return datetime.fromisoformat(str(key["expiration"]).replace("Z", "+00:00")) <= datetime.now(UTC)


def _headscale_key(headscale: Headscale, key_id: str) -> JSON:
    keys: list[JSON] = headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]
    [key] = [k for k in keys if k["id"] == key_id]
    return key


async def _served_at(admin: Client, namespace: str, node: TailscaleNode) -> JSON | None:
    """``status.loadBalancer`` once it carries the node's MagicDNS name and every address."""
    me = (await asyncio.to_thread(node.status))["Self"]
    svc = await admin.get(SERVICE, "web", namespace)
    entries = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    wanted = [{"hostname": str(me["DNSName"]).rstrip(".")},
              *({"ip": ip, "ipMode": "Proxy"} for ip in me["TailscaleIPs"])]
    ok = entries and entries[0] == wanted[0] and sorted(map(str, entries[1:])) == sorted(map(str, wanted[1:]))
    return svc if ok else None


async def _untouched(admin: Client, name: str, namespace: str) -> bool:
    """No finalizer, no status and no field of the operator's on the Service, and no agent for it."""
    svc = await admin.get(SERVICE, name, namespace)
    managers = {m.get("manager") for m in svc["metadata"].get("managedFields") or []}
    return (not svc["metadata"].get("finalizers") and not (svc.get("status") or {}).get("conditions")
            and not [m for m in managers if str(m).startswith("tailnet-operator")]
            and await _get(admin, DEPLOYMENT, f"{name}-lb-ingress-agent", namespace) is None)


async def _released(admin: Client, namespace: str) -> bool:
    for resource, name in OWNED:
        if await _get(admin, resource, name, namespace) is not None:
            return False
    svc = await admin.get(SERVICE, "web", namespace)
    return not svc["metadata"].get("finalizers") and not (svc.get("status") or {}).get("conditions")


async def test_a_classed_service_is_served_on_the_tailnet_and_released_when_the_class_goes(
    scene: Scene, tailscale_nodes: TailscaleFactory,
) -> None:
    admin, tenant = scene.admin, scene.tenant
    hostname = unique("lb-web")
    agent = StandInAgent()
    async with running_operator(scene.kubeconfig, scene.namespace, agent_status=agent):
        tailnet = await _tailnet(scene)
        await admin.create(SERVICE, service("plain", tenant, cls=None, hostname=unique("lb-plain")))
        await admin.create(SERVICE, service("other", tenant, cls="example.com/other", hostname=unique("lb-other")))
        await admin.create(SERVICE, service("web", tenant, cls=lb.load_balancer_class(tailnet), hostname=hostname,
                                            ports=[{"name": "http", "port": 80, "protocol": "TCP"},
                                                   {"name": "dns", "port": 53, "protocol": "UDP"}]))

        deployment = await eventually(lambda: _get(admin, DEPLOYMENT, AGENT, tenant), timeout=60,
                                      what="the agent Deployment")
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["AGENT_MODE"] == "ingress" and env["TAILNET_HOSTNAME"] == hostname
        svc = await admin.get(SERVICE, "web", tenant)
        for resource, name in OWNED:
            owned = await eventually(_getter(admin, resource, name, tenant), timeout=30,
                                     what=f"the agent's {resource.kind} {name}")
            [owner] = owned["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"]) == ("Service", "web", svc["metadata"]["uid"])
        [expose] = parse_exposes((await admin.get(CONFIG_MAP, "web-lb-ingress-config", tenant))["data"]
                                 ["exposes.json"])
        assert (expose.port, expose.backend.host, expose.backend.port) == (80, f"web.{tenant}.svc", 80)
        assert "tailnet.dev/finalizer" in svc["metadata"]["finalizers"]
        await eventually(lambda: _reasons(admin, tenant, "web", {"PortsSkipped"}), timeout=30,
                         what="the Event saying the UDP port is skipped")
        await eventually(has_condition(admin, SERVICE, "web", "PortsSupported", "False", "PortsSkipped",
                                       namespace=tenant), timeout=30, what="the PortsSupported condition")

        key_secret = await admin.get(SECRET, "web-lb-ingress-auth-key", tenant)
        key = base64.b64decode(key_secret["data"]["authKey"]).decode()
        record = await admin.get(SECRET, lb.record_name(tenant, "web"), scene.namespace)
        key_id = record["metadata"]["annotations"]["tailnet.dev/key-id"]
        marker = installation_tag((await admin.get(TAILNET, tailnet))["metadata"]["uid"])
        hs_key = _headscale_key(scene.headscale, key_id)
        assert hs_key["aclTags"] == [TAG, marker] and hs_key["reusable"] and hs_key["ephemeral"]

        node = tailscale_nodes(hostname, scene.headscale, authkey=key)  # as the agent pod would join
        agent.node = node
        served = await eventually(lambda: _served_at(admin, tenant, node), timeout=90,
                                  what="status.loadBalancer.ingress with the node's name and addresses")
        conditions = {c["type"]: c for c in served["status"]["conditions"]}
        assert conditions["TagOwned"]["status"] == conditions["PreAuthKeyValid"]["status"] == "True"
        assert conditions["HostnameAssigned"]["status"] == "True"
        for name in ("plain", "other"):
            assert await _untouched(admin, name, tenant), f"the Service {name} was touched"

        await admin.merge_patch(SERVICE, "web", {"spec": {"type": "ClusterIP", "loadBalancerClass": None}}, tenant)
        await eventually(lambda: _released(admin, tenant), timeout=60,
                         what="the agent's objects, the status and the finalizer gone with the class")
        assert _is_expired(_headscale_key(scene.headscale, key_id))
        assert await _get(admin, SECRET, lb.record_name(tenant, "web"), scene.namespace) is None
        assert not ((await admin.get(SERVICE, "web", tenant)).get("status") or {}).get("loadBalancer")
        await eventually(lambda: _reasons(admin, tenant, "web", {"LoadBalancerReleased"}), timeout=30,
                         what="the Event saying the Service was released")


async def test_a_service_in_a_namespace_that_is_not_a_tenant_is_refused_with_an_event(scene: Scene) -> None:
    admin, stranger = scene.admin, scene.stranger
    before = len(scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"])
    async with running_operator(scene.kubeconfig, scene.namespace):
        tailnet = await _tailnet(scene)
        await admin.create(SERVICE, service("web", stranger, cls=lb.load_balancer_class(tailnet),
                                            hostname=unique("lb-stranger")))

        cond = await eventually(has_condition(admin, SERVICE, "web", "Ready", "False", "NamespaceNotTenant",
                                              namespace=stranger), timeout=60, what="the refusal in the status")
        assert f"namespace {stranger} is not a tenant" in cond["message"]
        await eventually(lambda: _reasons(admin, stranger, "web", {"NamespaceNotTenant"}), timeout=30,
                         what="the Warning Event of the refusal")
        assert await _get(admin, DEPLOYMENT, AGENT, stranger) is None
        assert await _get(admin, SECRET, lb.record_name(stranger, "web"), scene.namespace) is None
        assert len(scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]) == before

        await admin.delete(SERVICE, "web", stranger)  # the finalizer comes off without a key to expire
        await eventually(lambda: _gone(admin, "web", stranger), timeout=60, what="the refused Service to go")


async def _gone(admin: Client, name: str, namespace: str) -> bool:
    return await _get(admin, SERVICE, name, namespace) is None
