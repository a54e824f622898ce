"""TailnetEgress end to end on a real node: the operator installed with ``kubectl apply -k``
creates an agent pod (admitted under ``restricted``), a Service per target and the CoreDNS hosts
file; a client pod in a consumer namespace reaches a host on a site LAN, behind a tailscaled
subnet router, through ``<target>.<operator-ns>.svc:<port>`` and through an alias.

The path: client pod -> ClusterIP -> agent pod (userspace tailnet node) -> DERP or UDP ->
tailscaled subnet router (host, uid nobody) -> veth -> site host's HTTP server.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.cluster import (
    EGRESSES,
    HOSTS,
    OPEN_BASE,
    SITES,
    SLEEPER,
    TAILNETS,
    ClusterUnderTest,
    apply,
    condition,
    exec_python,
    get_json,
    kubectl,
    namespace,
    operator_logs,
    python_pod,
    python_session,
    remove_tailnet,
    wait_available,
    wait_pod_running,
)
from e2e.conftest import TailscaleFactory
from e2e.disruption import age_key
from e2e.operator import tailnet_object, unique
from hack.localenv import Headscale, SiteHost, TailscaleNode, wait_until

# The first test also waits for the node, the image and the operator (the session fixtures).
pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

ZONE = "branch.e2e.internal"


@dataclass
class EgressWorld:
    namespace: str
    """The operator's namespace (where the egress and its objects live)."""
    consumer: str
    tailnet: str
    egress: str
    tag: str
    host: SiteHost
    router: TailscaleNode
    router_name: str
    router_tag: str
    base: str
    """The Tailnet's base policy ConfigMap (in ``namespace``)."""
    image: str

    def target(self, name: str, port: int, alias: str | None = None) -> dict[str, Any]:
        target: dict[str, Any] = {"name": name, "address": self.host.address,
                                  "ports": [{"port": port, "name": "http"}]}
        if alias:
            target["aliases"] = [alias]
        return target

    def egress_object(self, targets: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
                "metadata": {"name": self.egress, "namespace": self.namespace},
                "spec": {"tailnetRef": {"name": self.tailnet}, "tag": self.tag,
                         "consumerNamespaces": [self.consumer], "targets": targets}}

    echo_running: bool = False

    @property
    def agent(self) -> str:
        return f"{self.egress}-egress-agent"

    def echo_target(self) -> dict[str, Any]:
        """A target for the echo server on the site host (started on first use)."""
        if not self.echo_running:
            self.host.serve_echo(9000)
            self.echo_running = True
        return {"name": "site-echo", "address": self.host.address, "ports": [{"port": 9000, "name": "echo"}]}


def _diagnose(cluster: ClusterUnderTest, world: EgressWorld, exc: Exception) -> AssertionError:
    status = get_json(cluster, "-n", world.namespace, EGRESSES, world.egress).get("status")
    agent = kubectl(cluster, "-n", world.namespace, "logs", f"deployment/{world.agent}", "--tail=40", check=False)
    return AssertionError(f"{exc}\negress status: {status}\nagent logs:\n{agent}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


def _get_through(cluster: ClusterUnderTest, world: EgressWorld, url: str, what: str, timeout: float = 90) -> str:
    """The body of ``url`` fetched from the consumer's client pod, once it answers."""
    try:
        return wait_until(lambda: _get(cluster, world.consumer, url), timeout=timeout, what=what)
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc


def _get(cluster: ClusterUnderTest, ns: str, url: str) -> str:
    code = f"""
import urllib.request
print(urllib.request.urlopen({url!r}, timeout=5).read().decode(), end="")
"""
    return exec_python(cluster, ns, "client", code, timeout=30)


@pytest.fixture(scope="module")
def world(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale, project_image: Any,
          module_site_host: Callable[[], SiteHost], module_tailscale_nodes: TailscaleFactory,
          ) -> Iterator[EgressWorld]:
    ns = installed_operator
    suffix = uuid.uuid4().hex[:6]
    tailnet, site, egress = f"egress-{suffix}", f"branch-{suffix}", f"branch-{suffix}"
    router_tag, tag = f"tag:site-{suffix}", f"tag:egress-{suffix}"
    secret, base = f"{tailnet}-bootstrap", f"{tailnet}-policy"

    host = module_site_host()
    host.serve_http(8080)
    host.serve_http(8081)
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
         "stringData": {"apiKey": cluster_headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": base, "namespace": ns},
         "data": {"policy.hujson": OPEN_BASE}},
        tailnet_object(tailnet, cluster_headscale, ns, secret=secret,
                       policy={"baseConfigMapRef": {"namespace": ns, "name": base, "key": "policy.hujson"},
                               "mode": "Apply"},
                       dns={"hostsConfigMap": {"namespace": HOSTS[0], "name": HOSTS[1]}, "zones": [ZONE]}),
        {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
         "spec": {"tailnetRef": {"name": tailnet}, "routes": [host.subnet], "routerTag": router_tag}},
    ])
    router_name = unique("site-router")
    router = module_tailscale_nodes(router_name, cluster_headscale,
                                    authkey=cluster_headscale.create_preauth_key(tags=[router_tag]),
                                    advertise_routes=[host.subnet], site_router=True)
    try:
        with namespace(cluster, "consumer") as consumer:
            apply(cluster, [python_pod("client", consumer, project_image.ref, SLEEPER)])
            wait_pod_running(cluster, consumer, "client")
            yield EgressWorld(ns, consumer, tailnet, egress, tag, host, router, router_name, router_tag, base,
                              project_image.ref)
    finally:
        kubectl(cluster, "-n", ns, "delete", EGRESSES, egress, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "delete", SITES, site, "--wait=true", "--timeout=30s", check=False)
        remove_tailnet(cluster, tailnet)
        kubectl(cluster, "-n", ns, "delete", "secret", secret, check=False)
        kubectl(cluster, "-n", ns, "delete", "configmap", base, check=False)


def _egress_ready(cluster: ClusterUnderTest, world: EgressWorld, targets: set[str]) -> dict[str, Any] | None:
    obj = get_json(cluster, "-n", world.namespace, EGRESSES, world.egress)
    entries = {t["name"]: t for t in (obj.get("status") or {}).get("targets") or []}
    if condition(obj, "Ready") != "True" or set(entries) != targets:
        return None
    result: dict[str, Any] = obj
    return result


def _agent_pod(cluster: ClusterUnderTest, world: EgressWorld) -> dict[str, Any]:
    pods = get_json(cluster, "-n", world.namespace, "pods", "-l", f"tailnet.dev/egress={world.egress}")["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod: dict[str, Any] = pods[0]
    return pod


def test_a_consumer_pod_reaches_a_site_host_through_the_target_service_and_its_alias(
        cluster: ClusterUnderTest, world: EgressWorld) -> None:
    alias = f"web.{ZONE}"
    apply(cluster, [world.egress_object([world.target("site-web", 8080, alias)])])
    try:
        wait_available(cluster, world.namespace, world.agent, timeout=180)
    except AssertionError as exc:
        raise _diagnose(cluster, world, exc) from exc

    # Admitted under the namespace's enforced `restricted` level, as the Deployment wrote it.
    labels = get_json(cluster, "namespace", world.namespace)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    pod = _agent_pod(cluster, world)
    assert condition(pod, "Ready") == "True"

    url = f"http://site-web.{world.namespace}.svc:8080/through-the-egress"
    expected = f"hello from {world.host.address}:8080 path /through-the-egress\n"
    body = _get_through(cluster, world, url, "the client pod to reach the site host through the target's Service")
    assert body == expected

    by_alias = f"http://{alias}:8080/through-the-egress"
    try:
        body = wait_until(lambda: _get(cluster, world.consumer, by_alias), timeout=60,
                          what="the alias to resolve through CoreDNS and reach the site host")
    except TimeoutError as exc:
        hosts = get_json(cluster, "-n", HOSTS[0], "configmap", HOSTS[1]).get("data")
        raise AssertionError(f"{exc}\nhosts ConfigMap: {hosts}") from exc
    assert body == expected

    try:
        obj = wait_until(lambda: _egress_ready(cluster, world, {"site-web"}), timeout=90,
                         what="the egress Ready with its target routed")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc
    status = obj["status"]
    (entry,) = status["targets"]
    assert entry["route"] == "Ready", entry
    assert entry["router"] == world.router_name, entry
    assert entry["service"] == f"site-web.{world.namespace}.svc"
    assert status["node"]["id"] and status["node"]["addresses"], status
    assert status["preAuthKey"]["prefix"] and "key" not in status["preAuthKey"]


def test_a_target_added_and_removed_never_restarts_the_agent(
        cluster: ClusterUnderTest, world: EgressWorld) -> None:
    first = world.target("site-web", 8080, f"web.{ZONE}")
    apply(cluster, [world.egress_object([first])])
    wait_until(lambda: _egress_ready(cluster, world, {"site-web"}), timeout=120, what="the egress Ready")
    before = _agent_pod(cluster, world)

    apply(cluster, [world.egress_object([first, world.target("site-api", 8081, f"api.{ZONE}")])])
    url = f"http://site-api.{world.namespace}.svc:8081/added"
    body = _get_through(cluster, world, url, "the added target's Service to reach the site host", timeout=90)
    assert body == f"hello from {world.host.address}:8081 path /added\n"
    wait_until(lambda: _egress_ready(cluster, world, {"site-web", "site-api"}), timeout=90,
               what="both targets Ready")

    apply(cluster, [world.egress_object([first])])

    def removed() -> bool:
        return kubectl(cluster, "-n", world.namespace, "get", "service", "site-api", "--ignore-not-found",
                       "-o", "name") == ""

    wait_until(removed, timeout=60, what="the removed target's Service to be deleted")
    wait_until(lambda: _egress_ready(cluster, world, {"site-web"}), timeout=60, what="one target left in status")
    body = _get(cluster, world.consumer, f"http://site-web.{world.namespace}.svc:8080/kept")
    assert body == f"hello from {world.host.address}:8080 path /kept\n"

    after = _agent_pod(cluster, world)
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the agent pod was replaced"
    restarts = [c["restartCount"] for c in after["status"]["containerStatuses"]]
    assert restarts == [c["restartCount"] for c in before["status"]["containerStatuses"]], restarts



ECHO_CLIENT = """
import hashlib, os, socket, threading
data = os.urandom({size})
conn = socket.create_connection(({host!r}, {port}), timeout=60)
def send():
    conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
sender = threading.Thread(target=send)
sender.start()
digest, received = hashlib.sha256(), 0
while chunk := conn.recv(1 << 16):
    digest.update(chunk)
    received += len(chunk)
sender.join()
print(received, digest.hexdigest() == hashlib.sha256(data).hexdigest())
"""



def test_sixteen_mebibytes_each_way_arrive_intact_and_half_close_is_honoured(
        cluster: ClusterUnderTest, world: EgressWorld) -> None:
    first = world.target("site-web", 8080, f"web.{ZONE}")
    apply(cluster, [world.egress_object([first, world.echo_target()])])
    wait_until(lambda: _egress_ready(cluster, world, {"site-web", "site-echo"}), timeout=120,
               what="the echo target Ready")
    size = 16 << 20
    code = ECHO_CLIENT.format(size=size, host=f"site-echo.{world.namespace}.svc", port=9000)
    try:
        out = wait_until(lambda: exec_python(cluster, world.consumer, "client", code, timeout=120), timeout=240,
                         what="16 MiB echoed through the egress")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc
    # Everything sent came back, and the far end's EOF (after ours) reached the client.
    assert out.split() == [str(size), "True"], out


ECHO_SESSION = """
import socket, sys
conn = socket.create_connection(({host!r}, {port}), timeout=30)
for line in sys.stdin:
    data = line.encode()
    conn.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = conn.recv(65536)
        if not chunk:
            print("closed", flush=True)
            sys.exit(1)
        got += chunk
    print("echo " + got.decode().strip(), flush=True)
"""


def _target_entry(cluster: ClusterUnderTest, world: EgressWorld, name: str, route: str) -> dict[str, Any] | None:
    obj = get_json(cluster, "-n", world.namespace, EGRESSES, world.egress)
    for entry in (obj.get("status") or {}).get("targets") or []:
        if entry["name"] == name and entry["route"] == route:
            result: dict[str, Any] = entry
            return result
    return None


def _wait_route(cluster: ClusterUnderTest, world: EgressWorld, name: str, route: str,
                timeout: float = 120) -> dict[str, Any]:
    try:
        return wait_until(lambda: _target_entry(cluster, world, name, route), timeout=timeout,
                          what=f"target {name} reported {route}")
    except TimeoutError as exc:
        raise _diagnose(cluster, world, exc) from exc


def _policy_condition(cluster: ClusterUnderTest, world: EgressWorld) -> str:
    obj = get_json(cluster, TAILNETS, world.tailnet)
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == "PolicyApplied":
            return f"{cond['status']}/{cond['reason']}"
    return ""


def _set_policy(cluster: ClusterUnderTest, world: EgressWorld, *, base: str | None = None,
                mode: str | None = None) -> None:
    if base is not None:
        apply(cluster, [{"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": world.base, "namespace": world.namespace},
                         "data": {"policy.hujson": base}}])
    if mode is not None:
        kubectl(cluster, "patch", TAILNETS, world.tailnet, "--type=merge",
                "-p", json.dumps({"spec": {"policy": {"mode": mode}}}))


def test_each_route_problem_is_named_and_heals_to_ready(
        cluster: ClusterUnderTest, world: EgressWorld, module_site_host: Callable[[], SiteHost],
        cluster_headscale: Headscale) -> None:
    """NotAdvertised until the router advertises the LAN, NotApproved until a TailnetSite makes
    the policy approve it (the route was advertised first: the operator's replay approves it, the
    test never calls approve-routes), NoGrant for a port the live policy does not grant (Render
    mode over a closed base) until the operator writes the grant (Apply)."""
    lan = module_site_host()
    lan.serve_http(8080)
    lan.serve_http(8081)
    first = world.target("site-web", 8080, f"web.{ZONE}")
    lan_web = {"name": "lan-web", "address": lan.address, "ports": [{"port": 8080, "name": "http"}]}
    lan_api = {"name": "lan-api", "address": lan.address, "ports": [{"port": 8081, "name": "http"}]}
    site = f"lan-{uuid.uuid4().hex[:6]}"
    try:
        apply(cluster, [world.egress_object([first, lan_web])])
        entry = _wait_route(cluster, world, "lan-web", "NotAdvertised")
        assert lan.address in entry["message"], entry

        world.router.set(f"--advertise-routes={world.host.subnet},{lan.subnet}")
        entry = _wait_route(cluster, world, "lan-web", "NotApproved")
        assert entry.get("router") == world.router_name, entry
        assert "autoApprovers" in entry["message"], entry

        apply(cluster, [{"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
                         "spec": {"tailnetRef": {"name": world.tailnet}, "routes": [lan.subnet],
                                  "routerTag": world.router_tag}}])
        _wait_route(cluster, world, "lan-web", "Ready", timeout=150)
        body = _get_through(cluster, world, f"http://lan-web.{world.namespace}.svc:8080/healed",
                            "the healed target to carry traffic", timeout=60)
        assert body == f"hello from {lan.address}:8080 path /healed\n"

        # A base with a grant of its own (one that admits nothing here): with no grants at all,
        # Headscale allows everything.
        closed = json.dumps({"grants": [{"src": [world.tag], "dst": ["198.18.255.1"], "ip": ["tcp:1"]}]})
        _set_policy(cluster, world, base=closed + "\n")
        wait_until(lambda: '"*"' not in cluster_headscale.api("GET", "/api/v1/policy").get("policy", '"*"'),
                   timeout=60, what="the closed base applied")
        _set_policy(cluster, world, mode="Render")
        wait_until(lambda: _policy_condition(cluster, world) == "False/RenderOnly", timeout=60,
                   what="the Tailnet in Render mode")
        apply(cluster, [world.egress_object([first, lan_web, lan_api])])
        entry = _wait_route(cluster, world, "lan-api", "NoGrant")
        assert "8081" in entry["message"] and world.tag in entry["message"], entry

        _set_policy(cluster, world, mode="Apply")
        _wait_route(cluster, world, "lan-api", "Ready", timeout=150)
        body = _get_through(cluster, world, f"http://lan-api.{world.namespace}.svc:8081/granted",
                            "the granted target to carry traffic", timeout=60)
        assert body == f"hello from {lan.address}:8081 path /granted\n"
    finally:
        _set_policy(cluster, world, base=OPEN_BASE, mode="Apply")
        apply(cluster, [world.egress_object([first])])
        kubectl(cluster, "delete", SITES, site, "--ignore-not-found", "--wait=true", "--timeout=30s", check=False)
        world.router.set(f"--advertise-routes={world.host.subnet}")


def test_key_rotation_keeps_connections_and_a_deleted_agent_pod_comes_back(
        cluster: ClusterUnderTest, world: EgressWorld, cluster_headscale: Headscale) -> None:
    first = world.target("site-web", 8080, f"web.{ZONE}")
    apply(cluster, [world.egress_object([first, world.echo_target()])])
    obj = wait_until(lambda: _egress_ready(cluster, world, {"site-web", "site-echo"}), timeout=120,
                     what="the egress Ready")
    old_key = str(obj["status"]["preAuthKey"]["id"])
    pod = _agent_pod(cluster, world)
    code = ECHO_SESSION.format(host=f"site-echo.{world.namespace}.svc", port=9000)
    with python_session(cluster, world.consumer, "client", code) as session:
        assert session.ask("before") == "echo before"

        age_key(cluster, world.namespace, f"{world.egress}-auth-key", hours=13)  # past half of the 24 h lifetime

        def rotated() -> dict[str, Any] | None:
            status = get_json(cluster, "-n", world.namespace, EGRESSES, world.egress).get("status") or {}
            key = status.get("preAuthKey") or {}
            return key if key.get("id") and str(key["id"]) != old_key else None

        try:
            new = wait_until(rotated, timeout=90, what="the pre-auth key rotated")
        except TimeoutError as exc:
            raise _diagnose(cluster, world, exc) from exc
        keys = {str(k["id"]): k for k in cluster_headscale.api("GET", "/api/v1/preauthkey").get("preAuthKeys") or []}
        expiry = dt.datetime.fromisoformat(keys[old_key]["expiration"].replace("Z", "+00:00"))
        assert expiry <= dt.datetime.now(dt.UTC), "the old key is expired once the new one is stored"
        assert dt.datetime.fromisoformat(new["nextRotationAt"].replace("Z", "+00:00")) > dt.datetime.now(dt.UTC)

        assert session.ask("after rotation") == "echo after rotation", "the open connection survived"
    after = _agent_pod(cluster, world)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"], "rotation does not restart the agent"

    kubectl(cluster, "-n", world.namespace, "delete", "pod", pod["metadata"]["name"], "--wait=false")

    def replaced() -> dict[str, Any] | None:
        pods = get_json(cluster, "-n", world.namespace, "pods", "-l", f"tailnet.dev/egress={world.egress}")["items"]
        fresh = [p for p in pods if p["metadata"]["uid"] != pod["metadata"]["uid"]
                 and not p["metadata"].get("deletionTimestamp") and condition(p, "Ready") == "True"]
        return fresh[0] if fresh else None

    wait_until(replaced, timeout=120, what="a new agent pod Ready")
    url = f"http://site-web.{world.namespace}.svc:8080/after-restart"
    body = _get_through(cluster, world, url, "traffic through the re-registered agent", timeout=90)
    assert body == f"hello from {world.host.address}:8080 path /after-restart\n"


def test_deleting_the_egress_expires_its_key_and_removes_its_objects(
        cluster: ClusterUnderTest, world: EgressWorld, cluster_headscale: Headscale) -> None:
    apply(cluster, [world.egress_object([world.target("site-web", 8080, f"web.{ZONE}")])])
    obj = wait_until(lambda: _egress_ready(cluster, world, {"site-web"}), timeout=120, what="the egress Ready")
    key_id = str(obj["status"]["preAuthKey"]["id"])
    owned = [("deployment", world.agent), ("service", world.agent), ("service", "site-web"),
             ("configmap", f"{world.egress}-egress-config"), ("secret", f"{world.egress}-auth-key"),
             ("networkpolicy", world.agent)]
    for kind, name in owned:
        assert kubectl(cluster, "-n", world.namespace, "get", kind, name, "-o", "name").strip(), (kind, name)

    kubectl(cluster, "-n", world.namespace, "delete", EGRESSES, world.egress, "--wait=true", "--timeout=90s")

    keys = cluster_headscale.api("GET", "/api/v1/preauthkey").get("preAuthKeys") or []
    key = next(k for k in keys if str(k["id"]) == key_id)
    expiration = dt.datetime.fromisoformat(key["expiration"].replace("Z", "+00:00"))
    assert expiration <= dt.datetime.now(dt.UTC), key

    def gone() -> bool:
        return all(kubectl(cluster, "-n", world.namespace, "get", kind, name, "--ignore-not-found",
                           "-o", "name") == "" for kind, name in owned)

    wait_until(gone, timeout=60, what="every object the egress owned to be garbage collected")

    def alias_gone() -> bool:
        return f"web.{ZONE}" not in get_json(cluster, "-n", HOSTS[0], "configmap", HOSTS[1])["data"]["hosts"]

    wait_until(alias_gone, timeout=30, what="the alias to leave the hosts file")
