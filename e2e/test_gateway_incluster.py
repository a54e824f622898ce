"""TailnetGateway end to end on a real node: the operator installed with ``kubectl apply -k``
creates one kernel-mode router pod in the gateway namespace (admitted under ``privileged``), which
registers once with the minted key and keeps its identity in the state Secret; a deleted pod comes
back as the same node; a tailscaled laptop reaches the "site LAN" behind the router; and
``deletionPolicy: Delete`` leaves no pod, Secret or node.

The site LAN here is an HTTP server pod of the cluster: the router advertises its address as a
/32 (spec.siteRoutes), a TailnetSite with the gateway's tag approves it through the policy's
autoApprovers, and the laptop (userspace tailscaled on the host, --accept-routes) fetches from it
through its HTTP proxy: laptop -> tailnet -> router pod (kernel TUN, IP forwarding, SNAT) ->
pod network -> server pod.

The router image is ``hack.image.router_image()``: the project's Debian base plus the pinned
tailscaled and tailscale, because the local node pulls nothing from registries (the
tailscale/tailscale image a user runs has the same two programs and a shell).

Split DNS through Headscale is not exercised: it is Headscale's configuration file, fixed when
the session's Headscale starts (docs/gateway.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.cluster import (
    GATEWAYS,
    HTTP_SERVER,
    OPEN_BASE,
    SITES,
    TAILNETS,
    ClusterUnderTest,
    apply,
    condition,
    get_json,
    kubectl,
    namespace,
    operator_logs,
    python_pod,
    wait_pod_running,
)
from e2e.conftest import TailscaleFactory
from e2e.operator import tailnet_object
from hack.localenv import Headscale, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

GATEWAY_NAMESPACE = "tailnet-gateway"
ZONE = "gw.e2e.internal"


@dataclass
class GatewayWorld:
    namespace: str
    tailnet: str
    gateway: str
    tag: str
    site: str
    server_ns: str
    server_ip: str
    router_image: str
    dns_image: str

    def gateway_object(self, **spec: Any) -> dict[str, Any]:
        body = {"tailnetRef": {"name": self.tailnet}, "tag": self.tag, "image": self.router_image,
                "siteRoutes": [f"{self.server_ip}/32"], "dns": {"zone": ZONE, "image": self.dns_image}, **spec}
        return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetGateway", "metadata": {"name": self.gateway},
                "spec": body}

    @property
    def pod(self) -> str:
        return f"{self.gateway}-gateway-0"


def _diagnose(cluster: ClusterUnderTest, world: GatewayWorld, exc: Exception) -> AssertionError:
    status = get_json(cluster, GATEWAYS, world.gateway).get("status")
    logs = kubectl(cluster, "-n", GATEWAY_NAMESPACE, "logs", world.pod, "-c", "tailscale", "--tail=40", check=False)
    pods = kubectl(cluster, "-n", GATEWAY_NAMESPACE, "get", "pods", "-o", "wide", check=False)
    return AssertionError(f"{exc}\ngateway status: {status}\n{pods}\nrouter logs:\n{logs}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


@pytest.fixture(scope="module")
def world(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale,
          project_image: Any) -> Iterator[GatewayWorld]:
    from hack import image

    router, coredns = image.router_image(), image.coredns_image()
    cluster.load_image(router)
    cluster.load_image(coredns)
    ns = installed_operator
    suffix = uuid.uuid4().hex[:6]
    tailnet, gateway, site = f"gw-{suffix}", f"edge-{suffix}", f"cluster-lan-{suffix}"
    tag = f"tag:gateway-{suffix}"
    secret, base, hosts = f"{tailnet}-bootstrap", f"{tailnet}-policy", f"tailnet-hosts-{suffix}"
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
         "stringData": {"apiKey": cluster_headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": base, "namespace": ns},
         "data": {"policy.hujson": OPEN_BASE}},
        tailnet_object(tailnet, cluster_headscale, ns, secret=secret,
                       policy={"baseConfigMapRef": {"namespace": ns, "name": base, "key": "policy.hujson"},
                               "mode": "Apply"},
                       dns={"hostsConfigMap": {"namespace": "kube-system", "name": hosts}, "zones": [ZONE]}),
    ])
    try:
        with namespace(cluster, "lan") as server_ns:
            apply(cluster, [python_pod("server", server_ns, project_image.ref, HTTP_SERVER, port=8080)])
            wait_pod_running(cluster, server_ns, "server")
            server_ip = get_json(cluster, "-n", server_ns, "pod", "server")["status"]["podIP"]
            apply(cluster, [{"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
                             "spec": {"tailnetRef": {"name": tailnet}, "routes": [f"{server_ip}/32"],
                                      "routerTag": tag}}])
            yield GatewayWorld(ns, tailnet, gateway, tag, site, server_ns, server_ip, router.ref, coredns.ref)
    finally:
        kubectl(cluster, "patch", GATEWAYS, gateway, "--type=merge", "-p",
                '{"spec": {"deletionPolicy": "Delete"}}', check=False)
        kubectl(cluster, "delete", GATEWAYS, gateway, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "delete", SITES, site, "--wait=true", "--timeout=30s", check=False)
        kubectl(cluster, "delete", TAILNETS, tailnet, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "-n", ns, "delete", "secret", secret, check=False)
        kubectl(cluster, "-n", ns, "delete", "configmap", base, check=False)
        kubectl(cluster, "-n", "kube-system", "delete", "configmap", hosts, check=False)


def _gateway(cluster: ClusterUnderTest, world: GatewayWorld) -> dict[str, Any]:
    obj: dict[str, Any] = get_json(cluster, GATEWAYS, world.gateway)
    return obj


def _receipts(cluster: ClusterUnderTest, world: GatewayWorld) -> dict[str, Any] | None:
    receipts: dict[str, Any] | None = (_gateway(cluster, world).get("status") or {}).get("receipts")
    return receipts


def _tagged(headscale: Headscale, tag: str) -> list[dict[str, Any]]:
    return [n for n in headscale.nodes() if tag in (n.get("tags") or [])]


def _labelled(cluster: ClusterUnderTest, kind: str, world: GatewayWorld) -> list[str]:
    items = get_json(cluster, "-n", GATEWAY_NAMESPACE, kind, "-l", f"tailnet.dev/gateway={world.gateway}")["items"]
    return [o["metadata"]["name"] for o in items]


def _pod_uid_ready(cluster: ClusterUnderTest, world: GatewayWorld) -> str | None:
    pods = get_json(cluster, "-n", GATEWAY_NAMESPACE, "pods", "-l", f"tailnet.dev/gateway={world.gateway},"
                    "app.kubernetes.io/component=router")["items"]
    ready = [p for p in pods if condition(p, "Ready") == "True" and not p["metadata"].get("deletionTimestamp")]
    return str(ready[0]["metadata"]["uid"]) if len(ready) == 1 else None


def _ready_running(cluster: ClusterUnderTest, world: GatewayWorld) -> bool:
    obj = _gateway(cluster, world)
    return any(c["type"] == "Ready" and c["status"] == "True" and c["reason"] == "Running"
               for c in (obj.get("status") or {}).get("conditions") or [])


def test_the_kernel_mode_router_registers_once_and_a_deleted_pod_comes_back_as_the_same_node(
        cluster: ClusterUnderTest, world: GatewayWorld, cluster_headscale: Headscale) -> None:
    apply(cluster, [world.gateway_object()])  # suspended
    wait_until(lambda: (_gateway(cluster, world).get("status") or {}).get("conditions"), timeout=30,
               what="the suspended gateway's status")
    assert _labelled(cluster, "statefulsets", world) == [] and _labelled(cluster, "secrets", world) == []
    labels = get_json(cluster, "namespace", GATEWAY_NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"

    kubectl(cluster, "patch", GATEWAYS, world.gateway, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    try:
        receipts = wait_until(lambda: _receipts(cluster, world), timeout=240, what="receipts from the router pod")
        first = wait_until(lambda: _pod_uid_ready(cluster, world), timeout=120, what="the router pod Ready")
        wait_until(lambda: _ready_running(cluster, world), timeout=120, what="the gateway Ready (Running)")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc
    [node] = _tagged(cluster_headscale, world.tag)
    assert receipts["nodeId"] == node["id"] and receipts["nodeKey"] == node["nodeKey"]
    state = get_json(cluster, "-n", GATEWAY_NAMESPACE, "secret", f"{world.gateway}-gateway-state")
    assert state.get("data"), "tailscaled keeps its state in the Secret"
    assert kubectl(cluster, "-n", GATEWAY_NAMESPACE, "get", "secret", f"{world.gateway}-gateway-auth-key",
                   check=False) == "", "the key is gone once the node registered"

    kubectl(cluster, "-n", GATEWAY_NAMESPACE, "delete", "pod", world.pod, "--wait=true", "--timeout=60s")
    try:
        second = wait_until(lambda: (uid := _pod_uid_ready(cluster, world)) != first and uid, timeout=180,
                            what="the router pod back")
        wait_until(lambda: _ready_running(cluster, world) and _tagged(cluster_headscale, world.tag)[0]["online"],
                   timeout=120, what="the node online again")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc
    assert second != first
    [again] = _tagged(cluster_headscale, world.tag)
    assert again["id"] == node["id"] and again["nodeKey"] == node["nodeKey"], "the same node, not a new one"
    assert _receipts(cluster, world) == receipts


def test_a_laptop_reaches_the_lan_behind_the_router(
        cluster: ClusterUnderTest, world: GatewayWorld, cluster_headscale: Headscale,
        module_tailscale_nodes: TailscaleFactory) -> None:
    wait_until(lambda: _ready_running(cluster, world), timeout=240, what="the gateway Ready")
    user = cluster_headscale.create_user(f"laptop-{uuid.uuid4().hex[:6]}")
    laptop = module_tailscale_nodes("gw-laptop", cluster_headscale,
                                    authkey=cluster_headscale.create_preauth_key(user_id=user["id"]),
                                    accept_routes=True)
    url = f"http://{world.server_ip}:8080/"
    try:
        body = wait_until(lambda: _fetch(laptop.http_proxy, url), timeout=120,
                          what="the laptop to reach the server pod through the router")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc
    assert body == "hello from server"
    route = f"{world.server_ip}/32"
    # The route was approved by the Policy reconciler (the site's autoApprovers); the gateway's status
    # follows on its next look at Headscale.

    def approved_status() -> dict[str, Any] | None:
        status: dict[str, Any] = _gateway(cluster, world)["status"]
        return status if route in ((status.get("routes") or {}).get("approved") or []) else None

    status = wait_until(approved_status, timeout=60, what=f"the gateway's status to list {route} as approved")
    assert status["dns"]["zone"] == ZONE and status["dns"]["serverAddress"]


def test_delete_leaves_no_pod_secret_or_node(
        cluster: ClusterUnderTest, world: GatewayWorld, cluster_headscale: Headscale) -> None:
    wait_until(lambda: _receipts(cluster, world), timeout=240, what="receipts")
    kubectl(cluster, "patch", GATEWAYS, world.gateway, "--type=merge", "-p", '{"spec": {"deletionPolicy": "Delete"}}')
    kubectl(cluster, "delete", GATEWAYS, world.gateway, "--wait=true", "--timeout=120s")
    wait_until(lambda: not _labelled(cluster, "pods", world), timeout=120, what="the router pod gone")
    for kind in ("statefulsets", "secrets", "services", "deployments", "configmaps"):
        assert _labelled(cluster, kind, world) == [], kind
    assert _tagged(cluster_headscale, world.tag) == []


def _fetch(proxy: str, url: str) -> str | None:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open(url, timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return None

