"""The Gateway reconciler against a real kube-apiserver and Headscale, the operator from source.

This tier has no kubelet, scheduler or StatefulSet controller, so no router pod runs. Two
stand-ins take their place, each doing what the missing component would do and nothing more:

* a tailscaled started by the fixtures registers with the pre-auth key the gateway minted (read
  from its Secret, as the pod's ``TS_AUTHKEY`` reads it) and advertises the routes of the
  StatefulSet's template (``TS_ROUTES``), so the receipts come from a real registered node;
* a Pod object made from the StatefulSet's template, as the StatefulSet controller would make it,
  so RestartPending compares a real pod's template hash.

The kernel-mode pod itself (registration from the state Secret, a deleted pod coming back as the
same node, traffic to the site LAN) is e2e/test_gateway_incluster.py, on the real node.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.gateway import GatewaySettings
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_GATEWAY
from tailnet_operator.headscale import installation_tag
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import (
    CONFIG_MAP,
    NAMESPACE,
    POD,
    ROLE,
    ROLE_BINDING,
    SECRET,
    SERVICE,
    SERVICE_ACCOUNT,
    STATEFUL_SET,
    Resource,
)

from .conftest import TailscaleFactory
from .operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

TAG = "tag:gateway"
IMAGE = "tailscale/tailscale:v1.98.10"
"""The operator's router image (its configuration: --gateway-router-image)."""
POLICY = {"tagOwners": {TAG: []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}


@pytest.fixture
async def gateway_namespace(admin: Client) -> AsyncIterator[str]:
    name = unique("gw")
    await admin.create(NAMESPACE, {"metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "privileged"}}})
    yield name
    for obj in (await admin.list(TAILNET_GATEWAY)).items:
        if obj["spec"]["tailnetRef"]["name"].startswith(f"{name}-"):
            await admin.merge_patch(TAILNET_GATEWAY, obj["metadata"]["name"], {"metadata": {"finalizers": None}})
            with contextlib.suppress(NotFound):
                await admin.delete(TAILNET_GATEWAY, obj["metadata"]["name"])
    await admin.delete(NAMESPACE, name)


def gateway_object(name: str, tailnet: str, **spec: Any) -> JSON:
    body = {"tailnetRef": {"name": tailnet}, "tag": TAG, "siteRoutes": ["192.168.77.0/24"],
            "dns": {"zone": "corp.example", "image": "registry.k8s.io/coredns/coredns:v1.12.1"}, **spec}
    body = {k: v for k, v in body.items() if v is not None}
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetGateway", "metadata": {"name": name},
            "spec": body}


async def labelled(admin: Client, resource: Resource, namespace: str, gateway: str) -> list[str]:
    items = (await admin.list(resource, namespace, label_selector=f"tailnet.dev/gateway={gateway}")).items
    return sorted(o["metadata"]["name"] for o in items)


async def maybe(admin: Client, resource: Resource, name: str, namespace: str | None = None) -> JSON | None:
    try:
        return await admin.get(resource, name, namespace)
    except NotFound:
        return None


def env_of(sts: JSON) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}


async def setup_tailnet(admin: Client, headscale: Headscale, namespace: str) -> str:
    headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(POLICY)})
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    tailnet = f"{namespace}-tn"
    await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, dns={
        "hostsConfigMap": {"namespace": namespace, "name": "tailnet-hosts"}, "zones": ["corp.example"]}))
    return tailnet


async def test_suspended_then_created_once_with_receipts_from_the_registered_node_then_deleted(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
    gateway_namespace: str, tailscale_nodes: TailscaleFactory,
) -> None:
    ns, gw_ns = operator_namespace, gateway_namespace
    tailnet = await setup_tailnet(admin, headscale, ns)
    gw = unique("edge")
    settings = GatewaySettings(namespace=gw_ns, router_image=IMAGE)
    async with running_operator(control_plane.kubeconfig, ns, gateway=settings) as op:
        await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60, what="Tailnet Ready")
        await admin.create(TAILNET_GATEWAY, gateway_object(gw, tailnet))
        await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "Ready", "False", "Suspended"),
                         what="Suspended")
        for resource in (SECRET, CONFIG_MAP, SERVICE, STATEFUL_SET, SERVICE_ACCOUNT, ROLE, ROLE_BINDING):
            assert await labelled(admin, resource, gw_ns, gw) == [], resource
        assert not [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if TAG in k["aclTags"]]

        await admin.merge_patch(TAILNET_GATEWAY, gw, {"spec": {"suspend": False}})
        sts = await eventually(lambda: maybe(admin, STATEFUL_SET, f"{gw}-gateway", gw_ns), timeout=30,
                               what="the router StatefulSet")
        assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
        pod_spec = sts["spec"]["template"]["spec"]
        assert pod_spec["containers"][0]["image"] == IMAGE and "initContainers" not in pod_spec
        assert pod_spec["serviceAccountName"] == f"{gw}-gateway"
        # the router's own identity reaches its own state Secret, and nothing else
        router_user = f"system:serviceaccount:{gw_ns}:{gw}-gateway"
        for verb in ("get", "update", "patch"):
            assert await _may(admin, router_user, gw_ns, verb, f"{gw}-gateway-state")
            assert not await _may(admin, router_user, gw_ns, verb, "another-gateway-state")
        assert not await _may(admin, router_user, gw_ns, "create", "")
        assert not await _may(admin, router_user, gw_ns, "list", "")
        dns = await admin.get(SERVICE, f"{gw}-gateway-dns", gw_ns)
        routes = env_of(sts)["TS_ROUTES"].split(",")
        assert set(routes) == {f"{dns['spec']['clusterIP']}/32", "192.168.77.0/24"}
        state = await admin.get(SECRET, f"{gw}-gateway-state", gw_ns)
        assert "ownerReferences" not in state["metadata"] and not state.get("data")
        zone = await admin.get(CONFIG_MAP, f"{gw}-gateway", gw_ns)
        assert "corp.example:1053" in zone["data"]["Corefile"] and "IN SOA ns.corp.example." in zone["data"]["zone.db"]

        auth = await admin.get(SECRET, f"{gw}-gateway-auth-key", gw_ns)
        key = base64.b64decode(auth["data"]["authKey"]).decode()
        router = tailscale_nodes(f"{gw}-gateway", headscale, authkey=key, advertise_routes=routes)
        receipts = await eventually(lambda: _receipts(admin, gw), timeout=60, what="receipts")
        node = headscale.node_by_name(f"{gw}-gateway")
        marker = installation_tag((await admin.get(TAILNET, tailnet))["metadata"]["uid"])
        assert node is not None and set(node["tags"]) == {TAG, marker}
        assert receipts["nodeId"] == node["id"] and receipts["nodeKey"] == node["nodeKey"]
        assert receipts["stateSecret"] == f"{gw}-gateway-state"
        await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "Registered", "True"), what="Registered")
        assert await maybe(admin, SECRET, f"{gw}-gateway-auth-key", gw_ns) is None
        [minted] = [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if TAG in k["aclTags"]]
        assert not minted["reusable"] and not minted["ephemeral"]
        await eventually(lambda: _dns_route_approved(headscale, gw, f"{dns['spec']['clusterIP']}/32"), timeout=30,
                         what="the CoreDNS host route approved on the router")
        split = await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "SplitDNS", "Unknown",
                                               "HeadscaleConfigRequired"), what="SplitDNS")
        assert f"- {dns['spec']['clusterIP']}" in split["message"]
        status = (await admin.get(TAILNET_GATEWAY, gw))["status"]
        assert status["dns"] == {"zone": "corp.example", "serverAddress": dns["spec"]["clusterIP"]}

        # the receipts are written once: the API server refuses another identity
        with pytest.raises(Exception, match=r"written once"):
            await admin.apply_status(TAILNET_GATEWAY, {"metadata": {"name": gw}, "status": {"receipts": {
                **receipts, "nodeId": "999"}}}, field_manager="tailnet-operator-gateway-receipts")

        # the pod the StatefulSet controller would make; an image change then leaves it alone
        pod = await _pod_from_template(admin, sts)
        await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "RestartPending", "False", "UpToDate"),
                         what="UpToDate")
        # the image a TailnetGateway names is ignored (and it says so); a route change waits for a restart
        await admin.merge_patch(TAILNET_GATEWAY, gw, {"spec": {"image": "attacker.example/shell:latest"}})
        ignored = await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "ImageIgnored", "True", "Deprecated"),
                                   what="ImageIgnored")
        assert IMAGE in ignored["message"]
        unchanged = await admin.get(STATEFUL_SET, f"{gw}-gateway", gw_ns)
        assert unchanged["spec"]["template"] == sts["spec"]["template"]
        await admin.merge_patch(TAILNET_GATEWAY, gw, {"spec": {"siteRoutes": ["192.168.77.0/24", "192.168.78.0/24"]}})
        pending = await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "RestartPending", "True",
                                                 "TemplateChanged"), what="RestartPending")
        assert f"{gw}-gateway-0" in pending["message"]
        sts = await admin.get(STATEFUL_SET, f"{gw}-gateway", gw_ns)
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
        same = await admin.get(POD, pod["metadata"]["name"], gw_ns)
        assert same["metadata"]["uid"] == pod["metadata"]["uid"] and "deletionTimestamp" not in same["metadata"]
        before = {r.kind: [o["metadata"]["uid"] for o in (await admin.list(r, gw_ns)).items]
                  for r in (SECRET, STATEFUL_SET)}

    # an operator restart creates nothing new
    async with running_operator(control_plane.kubeconfig, ns, gateway=settings) as op:
        op.poke(gw)
        await eventually(has_condition(admin, TAILNET_GATEWAY, gw, "RestartPending", "True"), what="reconciled")
        after = {r.kind: [o["metadata"]["uid"] for o in (await admin.list(r, gw_ns)).items]
                 for r in (SECRET, STATEFUL_SET)}
        assert after == before
        assert [n["id"] for n in headscale.nodes() if TAG in n.get("tags", [])] == [receipts["nodeId"]]
        assert (await _receipts(admin, gw)) == receipts

        await admin.merge_patch(TAILNET_GATEWAY, gw, {"spec": {"deletionPolicy": "Delete"}})
        await admin.delete(TAILNET_GATEWAY, gw)
        await eventually(lambda: _gone(admin, gw), timeout=60, what="the TailnetGateway gone")
        for resource in (SECRET, CONFIG_MAP, SERVICE, STATEFUL_SET, SERVICE_ACCOUNT, ROLE, ROLE_BINDING):
            assert await labelled(admin, resource, gw_ns, gw) == [], resource
        assert await maybe(admin, POD, f"{gw}-gateway-0", gw_ns) is None
        assert headscale.node_by_name(f"{gw}-gateway") is None
        router.stop()


async def test_retain_leaves_everything_and_a_foreign_state_secret_is_not_adopted(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
    gateway_namespace: str, tailscale_nodes: TailscaleFactory,
) -> None:
    ns, gw_ns = operator_namespace, gateway_namespace
    tailnet = await setup_tailnet(admin, headscale, ns)
    kept, foreign = unique("kept"), unique("foreign")
    await admin.create(SECRET, {"metadata": {"name": f"{foreign}-gateway-state", "namespace": gw_ns},
                                "data": {"leftover": base64.b64encode(b"state").decode()}})
    async with running_operator(control_plane.kubeconfig, ns, gateway=GatewaySettings(namespace=gw_ns,
                                                                                      router_image=IMAGE)):
        await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60, what="Tailnet Ready")
        await admin.create(TAILNET_GATEWAY, gateway_object(foreign, tailnet, suspend=False, dns=None))
        cond = await eventually(has_condition(admin, TAILNET_GATEWAY, foreign, "Ready", "False", "StateSecretExists"),
                                timeout=30, what="StateSecretExists")
        assert "not adopted" in cond["message"]
        assert await maybe(admin, STATEFUL_SET, f"{foreign}-gateway", gw_ns) is None
        assert not [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if TAG in k["aclTags"]]

        await admin.create(TAILNET_GATEWAY, gateway_object(kept, tailnet, suspend=False, dns=None))
        sts = await eventually(lambda: maybe(admin, STATEFUL_SET, f"{kept}-gateway", gw_ns), timeout=30,
                               what="the router StatefulSet")
        auth = await admin.get(SECRET, f"{kept}-gateway-auth-key", gw_ns)
        tailscale_nodes(f"{kept}-gateway", headscale, authkey=base64.b64decode(auth["data"]["authKey"]).decode(),
                        advertise_routes=env_of(sts)["TS_ROUTES"].split(","))
        receipts = await eventually(lambda: _receipts(admin, kept), timeout=60, what="receipts")

        await admin.delete(TAILNET_GATEWAY, kept)  # deletionPolicy defaults to Retain
        await eventually(lambda: _gone(admin, kept), timeout=60, what="the TailnetGateway gone")
        assert await labelled(admin, STATEFUL_SET, gw_ns, kept) == [f"{kept}-gateway"]
        assert await maybe(admin, SECRET, f"{kept}-gateway-state", gw_ns) is not None
        assert [n["id"] for n in headscale.nodes() if n.get("name") == f"{kept}-gateway"] == [receipts["nodeId"]]
        events = (await admin.list(Resource("events.k8s.io", "v1", "events", "Event"), "default")).items
        assert any(e.get("reason") == "Retained" and (e.get("regarding") or {}).get("name") == kept for e in events)


async def _may(admin: Client, user: str, namespace: str, verb: str, name: str) -> bool:
    """A SubjectAccessReview: may ``user`` (a ServiceAccount) ``verb`` the Secret ``name``?"""
    sa_namespace = user.split(":")[2]
    review = await admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}",
                                          "system:authenticated"],
                 "resourceAttributes": {k: v for k, v in {"namespace": namespace, "resource": "secrets",
                                                          "verb": verb, "name": name}.items() if v}}})
    return bool(review["status"].get("allowed"))


async def _receipts(admin: Client, name: str) -> JSON | None:
    obj = await maybe(admin, TAILNET_GATEWAY, name)
    return ((obj or {}).get("status") or {}).get("receipts")


async def _gone(admin: Client, name: str) -> bool:
    return await maybe(admin, TAILNET_GATEWAY, name) is None


def _dns_route_approved(headscale: Headscale, gateway: str, route: str) -> bool:
    node = headscale.node_by_name(f"{gateway}-gateway")
    return bool(node and route in node.get("approvedRoutes", []))


async def _pod_from_template(admin: Client, sts: JSON) -> JSON:
    template = copy.deepcopy(sts["spec"]["template"])
    meta = {**template["metadata"], "name": f"{sts['metadata']['name']}-0", "namespace": sts["metadata"]["namespace"]}
    return await admin.create(POD, {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
