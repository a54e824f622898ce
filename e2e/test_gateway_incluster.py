"""TailnetGateway end to end on a real node: the operator installed with ``kubectl apply -k``
creates one kernel-mode router pod in the gateway namespace (admitted under ``privileged``, though
it runs no privileged container and keeps no capability but NET_ADMIN, as its own ServiceAccount),
which registers once with the minted key and keeps its identity in the state Secret; a deleted pod
comes back as the same node; a tailscaled laptop reaches the "site LAN" behind the router (IP
forwarding inherited from the node on the local node, set by the pod's sysctls on kind, never by a
privileged container); and
``deletionPolicy: Delete`` leaves no pod, Secret or node.

The site LAN here is an HTTP server pod of the cluster: the router advertises its address as a
/32 (spec.siteRoutes), a TailnetSite with the gateway's tag approves it through the policy's
autoApprovers, and the laptop (userspace tailscaled on the host, --accept-routes) fetches from it
through its HTTP proxy: laptop -> tailnet -> router pod (kernel TUN, IP forwarding, SNAT) ->
pod network -> server pod.

The router image is the operator's configuration, not the TailnetGateway's: the module sets it on
the installed operator (``TAILNET_GATEWAY_ROUTER_IMAGE``, what the chart's
``gateway.router.image`` sets as a flag) to ``hack.image.router_image()``, with
``TAILNET_GATEWAY_ROUTER_SYSCTLS`` (chart value ``gateway.router.forwardingSysctls``) where the
cluster's pods must set forwarding themselves, and takes both off again afterwards: the
project's Debian base plus the pinned tailscaled and tailscale, because the local
node pulls nothing from registries (the tailscale/tailscale image a user runs has the same two
programs and a shell).

The module runs its own Headscale (on the cluster's host address, as the session's), because split
DNS is Headscale's configuration file: once the gateway's CoreDNS has its address, the test writes
``dns.nameservers.split`` for the zone and restarts Headscale, as its operator would. A laptop that
accepts DNS then resolves an egress alias and an ingress name of the zone through tailscaled's
resolver (``tailscale dns query``), which sends the query over the tailnet to the gateway's CoreDNS.
MetalLB's controller (the allocator only) gives a Service of type LoadBalancer an address of
``advertiseLoadBalancerRange``; the laptop reaches it through the router, where kube-proxy routes
the address to the Service's endpoints.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from e2e.cluster import (
    EGRESSES,
    GATEWAYS,
    HTTP_SERVER,
    INGRESSES,
    OPEN_BASE,
    SITES,
    ClusterUnderTest,
    admit_tenant,
    apply,
    condition,
    get_json,
    kubectl,
    namespace,
    operator_logs,
    python_pod,
    remove_tailnet,
    wait_pod_running,
)
from e2e.conftest import TailscaleFactory
from e2e.operator import tailnet_object
from hack.localenv import Environment, Headscale, TailscaleNode, metallb, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

GATEWAY_NAMESPACE = "tailnet-gateway"
ZONE = "gw.e2e.internal"
LB_RANGE = "198.19.200.0/29"
"""Inside the test ranges (198.18.0.0/15), apart from the node's pod and Service ranges."""


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
    hosts: str
    """The Tailnet's hosts ConfigMap (in kube-system), which the gateway copies into its zone."""

    def gateway_object(self, **spec: Any) -> dict[str, Any]:
        body = {"tailnetRef": {"name": self.tailnet}, "tag": self.tag,
                "siteRoutes": [f"{self.server_ip}/32"], "advertiseLoadBalancerRange": LB_RANGE,
                "dns": {"zone": ZONE, "image": self.dns_image}, **spec}
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
def cluster_headscale(environment: Environment, cluster: ClusterUnderTest) -> Iterator[Headscale]:
    """This module's own Headscale: its split DNS configuration changes (and it restarts) mid-module."""
    server = environment.headscale(f"gw-headscale-{uuid.uuid4().hex[:4]}", address=cluster.host_address)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def load_balancer(cluster: ClusterUnderTest, environment: Environment) -> Iterator[None]:
    """MetalLB's CRDs, its controller on the host and a pool of LB_RANGE; removed afterwards."""
    crds = yaml.safe_dump_all(metallb.crd_bodies())
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=crds)
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s", "crd/ipaddresspools.metallb.io")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": metallb.NAMESPACE}}])
    apply(cluster, [metallb.address_pool("gateway-range", LB_RANGE)])
    allocator = environment.metallb(cluster.kubeconfig)
    try:
        yield
    finally:
        allocator.stop()
        kubectl(cluster, "delete", "namespace", metallb.NAMESPACE, "--wait=false", check=False)
        kubectl(cluster, "delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=crds, check=False)


@pytest.fixture(scope="module")
def world(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale,
          project_image: Any, load_balancer: None) -> Iterator[GatewayWorld]:
    from hack import image

    router, coredns = image.router_image(), image.coredns_image()
    cluster.load_image(router)
    cluster.load_image(coredns)
    ns = installed_operator
    with _routers_of_the_operator(cluster, ns, router.ref):
        yield from _world(cluster, ns, cluster_headscale, project_image, router.ref, coredns.ref)


@contextlib.contextmanager
def _routers_of_the_operator(cluster: ClusterUnderTest, namespace: str, ref: str) -> Iterator[None]:
    """The installed operator, rolled out with its routers' image set to ``ref`` (and their
    forwarding sysctls on where the cluster's pods must set it); set back after."""
    deployment = "deployment/tailnet-operator"
    settings = {"TAILNET_GATEWAY_ROUTER_IMAGE": ref}
    if cluster.pods_set_forwarding:
        settings["TAILNET_GATEWAY_ROUTER_SYSCTLS"] = "true"
    kubectl(cluster, "-n", namespace, "set", "env", deployment, *(f"{k}={v}" for k, v in settings.items()))
    kubectl(cluster, "-n", namespace, "rollout", "status", deployment, "--timeout=240s", timeout=260)
    try:
        yield
    finally:
        kubectl(cluster, "-n", namespace, "set", "env", deployment, *(f"{k}-" for k in settings), check=False)
        kubectl(cluster, "-n", namespace, "rollout", "status", deployment, "--timeout=240s", timeout=260,
                check=False)


def _world(cluster: ClusterUnderTest, ns: str, cluster_headscale: Headscale, project_image: Any, router: str,
           coredns: str) -> Iterator[GatewayWorld]:
    suffix = uuid.uuid4().hex[:6]
    tailnet, gateway, site = f"gw-{suffix}", f"edge-{suffix}", f"cluster-lan-{suffix}"
    tag = f"tag:gateway-{suffix}"
    # the one hosts ConfigMap the install lets the operator write (chart value dns.hostsConfigMaps)
    secret, base, hosts = f"{tailnet}-bootstrap", f"{tailnet}-policy", "tailnet-hosts"
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
            apply(cluster, [python_pod("server", server_ns, project_image.ref, HTTP_SERVER, port=8080,
                                       labels={"app": "server"}),
                            {"apiVersion": "v1", "kind": "Service",
                             "metadata": {"name": "server", "namespace": server_ns},
                             "spec": {"type": "LoadBalancer", "selector": {"app": "server"},
                                      "ports": [{"port": 8080, "targetPort": 8080}]}}])
            wait_pod_running(cluster, server_ns, "server")
            server_ip = get_json(cluster, "-n", server_ns, "pod", "server")["status"]["podIP"]
            apply(cluster, [{"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
                             "spec": {"tailnetRef": {"name": tailnet}, "routes": [f"{server_ip}/32"],
                                      "routerTag": tag}}])
            yield GatewayWorld(ns, tailnet, gateway, tag, site, server_ns, server_ip, router, coredns, hosts)
    finally:
        kubectl(cluster, "patch", GATEWAYS, gateway, "--type=merge", "-p",
                '{"spec": {"deletionPolicy": "Delete"}}', check=False)
        kubectl(cluster, "delete", GATEWAYS, gateway, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "delete", SITES, site, "--wait=true", "--timeout=30s", check=False)
        remove_tailnet(cluster, tailnet)
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
    _assert_least_privilege(cluster, world)
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


def test_a_new_site_route_waits_for_a_person_to_restart_the_pod_then_is_advertised(
        cluster: ClusterUnderTest, world: GatewayWorld, cluster_headscale: Headscale) -> None:
    wait_until(lambda: _ready_running(cluster, world), timeout=240, what="the gateway Ready")
    before = wait_until(lambda: _pod_uid_ready(cluster, world), timeout=120, what="the router pod Ready")
    added = "198.18.251.0/24"
    routes = [f"{world.server_ip}/32", added]
    kubectl(cluster, "patch", GATEWAYS, world.gateway, "--type=merge", "-p",
            json.dumps({"spec": {"siteRoutes": routes}}))
    wait_until(lambda: _condition_of(cluster, world, "RestartPending") == ("True", "TemplateChanged"), timeout=60,
               what="RestartPending True after the route change")
    assert _pod_uid_ready(cluster, world) == before, "the operator never restarts the router"
    assert added not in _tagged(cluster_headscale, world.tag)[0]["availableRoutes"]

    kubectl(cluster, "-n", GATEWAY_NAMESPACE, "delete", "pod", world.pod, "--wait=true", "--timeout=60s")
    try:
        wait_until(lambda: added in _tagged(cluster_headscale, world.tag)[0]["availableRoutes"], timeout=180,
                   what=f"the restarted router to advertise {added}")
        wait_until(lambda: _condition_of(cluster, world, "RestartPending") == ("False", "UpToDate"), timeout=60,
                   what="RestartPending False once the pod runs the template")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc


NET_ADMIN = 1 << 12
"""CAP_NET_ADMIN's bit in /proc/<pid>/status."""


def _assert_least_privilege(cluster: ClusterUnderTest, world: GatewayWorld) -> None:
    """The running router: the operator's image, no privileged or init container, its own
    ServiceAccount, and a process holding NET_ADMIN and nothing else."""
    spec = get_json(cluster, "-n", GATEWAY_NAMESPACE, "pod", world.pod)["spec"]
    assert "initContainers" not in spec and spec["serviceAccountName"] == f"{world.gateway}-gateway"
    [container] = spec["containers"]
    assert container["image"] == world.router_image
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert not container["securityContext"].get("privileged")
    sysctls = (spec.get("securityContext") or {}).get("sysctls") or []
    assert bool(sysctls) is cluster.pods_set_forwarding, sysctls
    status = kubectl(cluster, "-n", GATEWAY_NAMESPACE, "exec", world.pod, "-c", "tailscale", "--",
                     "cat", "/proc/1/status")
    caps = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines() if line.startswith("Cap")}
    assert caps["CapEff"] == caps["CapBnd"] == NET_ADMIN, caps
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status, "no privilege escalation, a seccomp filter"


def _condition_of(cluster: ClusterUnderTest, world: GatewayWorld, kind: str) -> tuple[str, str] | None:
    conditions = (_gateway(cluster, world).get("status") or {}).get("conditions") or []
    found = next((c for c in conditions if c["type"] == kind), None)
    return (found["status"], found["reason"]) if found else None


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
    status = wait_until(lambda: _status_approving(cluster, world, route), timeout=60,
                        what=f"the gateway's status to list {route} as approved")
    assert status["dns"]["zone"] == ZONE and status["dns"]["serverAddress"]


def test_a_laptop_reaches_a_load_balancer_address_and_resolves_the_zone_by_split_dns(
        cluster: ClusterUnderTest, world: GatewayWorld, cluster_headscale: Headscale,
        module_tailscale_nodes: TailscaleFactory) -> None:
    wait_until(lambda: _ready_running(cluster, world), timeout=240, what="the gateway Ready")
    lb_ip = wait_until(lambda: _load_balancer_ip(cluster, world), timeout=60,
                       what="MetalLB to give the LoadBalancer Service an address")
    assert ipaddress.ip_address(lb_ip) in ipaddress.ip_network(LB_RANGE)
    status = wait_until(lambda: _status_approving(cluster, world, LB_RANGE), timeout=60,
                        what=f"the gateway's status to list {LB_RANGE} as approved")
    dns_address = status["dns"]["serverAddress"]

    user = cluster_headscale.create_user(f"dns-laptop-{uuid.uuid4().hex[:6]}")
    laptop = module_tailscale_nodes("gw-dns-laptop", cluster_headscale,
                                    authkey=cluster_headscale.create_preauth_key(user_id=user["id"]),
                                    accept_routes=True)
    body = wait_until(lambda: _fetch(laptop.http_proxy, f"http://{lb_ip}:8080/"), timeout=120,
                      what=f"the laptop to reach the LoadBalancer address {lb_ip} through the router")
    assert body == "hello from server"

    with _named_objects(cluster, world) as (alias, ingress_name, tenant):
        try:
            hosts = wait_until(lambda: _hosts_with(cluster, world, alias, ingress_name), timeout=180,
                               what=f"{alias} and {ingress_name} in the Tailnet's hosts file")
        except TimeoutError as exc:
            raise _diagnose_names(cluster, world, tenant, exc) from exc
        cluster_headscale.set_split_dns({ZONE: [dns_address]})  # restarts Headscale: the nodes reconnect
        laptop.set("--accept-dns=true")
        for name in (alias, ingress_name):
            try:
                answer = wait_until(functools.partial(_resolves, laptop, name, hosts[name]), timeout=240,
                                    what=f"the laptop to resolve {name} through split DNS")
            except TimeoutError as exc:
                raise _diagnose_zone(cluster, world, exc) from exc
            assert dns_address in answer, f"answered by the gateway's CoreDNS {dns_address}: {answer}"


def _diagnose_names(cluster: ClusterUnderTest, world: GatewayWorld, tenant: str, exc: Exception) -> AssertionError:
    """What the DNS reconciler had to go on: the hosts file, the named objects' conditions, the
    Tailnet's events, the tenant's pods and the operator's logs."""
    data = get_json(cluster, "-n", "kube-system", "configmap", world.hosts)
    objects = [*get_json(cluster, "-n", world.namespace, EGRESSES)["items"],
               *get_json(cluster, "-n", tenant, INGRESSES)["items"]]
    conditions = {o["metadata"]["name"]: [(c["type"], c["status"], c.get("reason")) for c in
                                          (o.get("status") or {}).get("conditions") or []] for o in objects}
    events = kubectl(cluster, "get", "events", "-A", "--field-selector", f"involvedObject.name={world.tailnet}",
                     check=False)
    pods = kubectl(cluster, "-n", tenant, "get", "pods", "-o", "wide", check=False)
    # the ingress's key record, where the Ingress reconciler notes its node's address for the DNS reconciler
    records = get_json(cluster, "-n", world.namespace, "secrets", "-l", f"tailnet.dev/tailnet={world.tailnet}")
    notes = {r["metadata"]["name"]: r["metadata"].get("annotations") for r in records["items"]}
    nodes = {o["metadata"]["name"]: (o.get("status") or {}).get("node") for o in objects}
    return AssertionError(f"{exc}\nhosts ConfigMap: {data.get('metadata', {}).get('labels')} "
                          f"{data.get('data')}\nconditions: {conditions}\nnodes: {nodes}\nrecords: {notes}\n"
                          f"Tailnet events:\n{events}\n{pods}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


def _diagnose_zone(cluster: ClusterUnderTest, world: GatewayWorld, exc: Exception) -> AssertionError:
    zone = get_json(cluster, "-n", GATEWAY_NAMESPACE, "configmap", f"{world.gateway}-gateway").get("data") or {}
    logs = kubectl(cluster, "-n", GATEWAY_NAMESPACE, "logs", f"deployment/{world.gateway}-gateway-dns", "--tail=40",
                   check=False)
    return AssertionError(f"{exc}\nthe zone's hosts file:\n{zone.get('hosts')}\nCoreDNS logs:\n{logs}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


def _load_balancer_ip(cluster: ClusterUnderTest, world: GatewayWorld) -> str | None:
    service = get_json(cluster, "-n", world.server_ns, "service", "server")
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    return str(ingress[0]["ip"]) if ingress and ingress[0].get("ip") else None


def _status_approving(cluster: ClusterUnderTest, world: GatewayWorld, route: str) -> dict[str, Any] | None:
    status: dict[str, Any] = _gateway(cluster, world).get("status") or {}
    return status if route in ((status.get("routes") or {}).get("approved") or []) else None


@contextlib.contextmanager
def _named_objects(cluster: ClusterUnderTest, world: GatewayWorld) -> Iterator[tuple[str, str, str]]:
    """An egress whose target has an alias in the zone and an ingress whose DNS name is in the zone;
    yields the two names and the ingress's namespace. The egress target is never dialled (the
    address is inside the test ranges)."""
    suffix = uuid.uuid4().hex[:6]
    egress, ingress, alias = f"db-{suffix}", f"shop-{suffix}", f"db-{suffix}.{ZONE}"
    with namespace(cluster, "tenant", {"pod-security.kubernetes.io/enforce": "restricted"}) as tenant:
        admit_tenant(cluster, world.tailnet, tenant, [f"tag:ingress-{suffix}"], [f"*.{ZONE}"])
        apply(cluster, [
            {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
             "metadata": {"name": egress, "namespace": world.namespace},
             "spec": {"tailnetRef": {"name": world.tailnet}, "tag": f"tag:egress-{suffix}",
                      "consumerNamespaces": [tenant],
                      "targets": [{"name": "db", "address": "198.18.250.1", "ports": [{"port": 5432}],
                                   "aliases": [alias]}]}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "tailnet-operator", "namespace": tenant},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "tailnet-operator-tenant"},
             "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": world.namespace}]},
            {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
             "metadata": {"name": ingress, "namespace": tenant},
             "spec": {"tailnetRef": {"name": world.tailnet}, "tag": f"tag:ingress-{suffix}", "hostname": ingress,
                      "dnsTemplate": "{hostname}." + ZONE,
                      "exposes": [{"name": "raw", "port": 8080, "backend": {"service": "web", "port": 8080}}]}},
        ])
        try:
            yield alias, f"{ingress}.{ZONE}", tenant
        finally:
            kubectl(cluster, "-n", tenant, "delete", INGRESSES, ingress, "--wait=true", "--timeout=90s", check=False)
            kubectl(cluster, "-n", world.namespace, "delete", EGRESSES, egress, "--wait=true", "--timeout=90s",
                    check=False)


def _hosts_with(cluster: ClusterUnderTest, world: GatewayWorld, *names: str) -> dict[str, str] | None:
    """``{name: address}`` of the hosts file once it holds every name of ``names``."""
    from tailnet_operator.controllers.dns import parse_hosts

    data = get_json(cluster, "-n", "kube-system", "configmap", world.hosts).get("data") or {}
    hosts = parse_hosts(data.get("hosts", ""))
    return hosts if all(name in hosts for name in names) else None


def _resolves(laptop: TailscaleNode, name: str, address: str) -> str:
    """``tailscale dns query``'s answer when it gives ``address`` for ``name`` (else the answer is
    raised, so that a timeout shows the last one)."""
    answer = laptop.cli("dns", "query", name, "A")
    if address not in answer:
        raise AssertionError(f"{name} not answered with {address}:\n{answer}")
    return answer


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

