"""TailnetIngress end to end on a real node: the operator installed with ``kubectl apply -k`` runs
an ingress agent pod (admitted under ``restricted``) in a tenant namespace; a tailscaled "laptop"
the policy grants reaches an in-cluster Service through it: tcp by the node's MagicDNS name, https
by the host's DNS name (the address the Tailnet's hosts file gives it) with the certificate
cert-manager issued from a CA ClusterIssuer, HTTP/1.1 and HTTP/2. A wrong Host under a valid SNI
gets 421; a laptop the policy does not grant cannot connect; deleting the CR expires its key,
removes its objects and its names.

The path: laptop (host, userspace tailscaled) -> its HTTP proxy (CONNECT) -> tailnet (DERP or UDP)
-> agent pod (userspace tailnet node) -> ClusterIP -> backend pod. cert-manager's controllers
(hack/certmanager) run on the host against the cluster's apiserver: they need no node.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from e2e.cluster import (
    HOSTS,
    HTTP_SERVER,
    INGRESSES,
    TAILNETS,
    VENV_PYTHON,
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
    wait_available,
    wait_pod_running,
)
from e2e.conftest import TailscaleFactory
from e2e.operator import tailnet_object
from hack.grpc_echo import grpc_frame, grpc_messages
from hack.https_client import Answer, request, tunnel
from hack.localenv import CertManager, Environment, Headscale, TailscaleNode, wait_until
from hack.localenv._pki import CertificateAuthority
from hack.localenv.certmanager import crd_bodies

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

ZONE = "apps.e2e.internal"
GRPC_PORT = 50051
GRPC_SERVER = (Path(__file__).parent.parent / "hack" / "grpc_echo.py").read_text() + f"""

async def _serve_forever() -> None:
    await GrpcEcho.start(host="0.0.0.0", port={GRPC_PORT})
    await asyncio.Event().wait()


asyncio.run(_serve_forever())
"""
"""hack/grpc_echo.py run as a pod's script (it needs the standard library and h2, which the image's venv has)."""
CERT_MANAGER_NAMESPACE = "cert-manager"
ISSUER = "tailnet-e2e-ca"


def _base_policy(ingress_tag: str, granted: str, other: str) -> str:
    """Only laptops with ``granted`` may reach the ingress; ``other`` exists but is granted nothing.
    The ingress tag is owned here too: Headscale refuses a grant to a tag no one owns."""
    return (f'{{"tagOwners": {{"{ingress_tag}": [], "{granted}": [], "{other}": []}},\n'
            f' "grants": [{{"src": ["{granted}"], "dst": ["{ingress_tag}"], "ip": ["*"]}}]}}\n')


@dataclass
class IngressWorld:
    namespace: str
    """The operator's namespace (the Tailnet's bootstrap Secret and base policy)."""
    tenant: str
    tailnet: str
    ingress: str
    tag: str
    hostname: str
    ca: CertificateAuthority
    laptop: TailscaleNode
    stranger: TailscaleNode
    laptop_tag: str
    """The laptop's tag (what the backend learns from ``Tailnet-Node-Tags``)."""

    @property
    def agent(self) -> str:
        return f"{self.ingress}-ingress-agent"

    @property
    def host_name(self) -> str:
        return f"shop-{self.hostname}.{ZONE}"

    @property
    def grpc_name(self) -> str:
        return f"grpc-{self.hostname}.{ZONE}"

    def ingress_object(self) -> dict[str, Any]:
        return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
                "metadata": {"name": self.ingress, "namespace": self.tenant},
                "spec": {"tailnetRef": {"name": self.tailnet}, "tag": self.tag, "hostname": self.hostname,
                         "dnsTemplate": "{hostname}." + ZONE,
                         "exposes": [
                             {"name": "raw", "port": 8080, "backend": {"service": "web", "port": 8080}},
                             {"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 8080},
                              "hosts": [{"name": self.host_name, "alias": "shop",
                                         "tls": {"certManager": {"issuerRef": {"name": ISSUER,
                                                                               "kind": "ClusterIssuer"}}}}]},
                             # a second http expose on the same port, chosen by SNI, to an h2c backend
                             {"name": "grpc", "mode": "http", "port": 443,
                              "backend": {"service": "grpc", "port": GRPC_PORT, "protocol": "h2"},
                              "hosts": [{"name": self.grpc_name,
                                         "tls": {"certManager": {"issuerRef": {"name": ISSUER,
                                                                               "kind": "ClusterIssuer"}}}}]}]}}


def _diagnose(cluster: ClusterUnderTest, world: IngressWorld, exc: BaseException) -> AssertionError:
    status = get_json(cluster, "-n", world.tenant, INGRESSES, world.ingress).get("status")
    agent = kubectl(cluster, "-n", world.tenant, "logs", f"deployment/{world.agent}", "--tail=40", check=False)
    return AssertionError(f"{exc}\ningress status: {status}\nagent logs:\n{agent}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


@pytest.fixture(scope="module")
def cert_manager(cluster: ClusterUnderTest, environment: Environment) -> Iterator[CertManager]:
    """cert-manager's CRDs in the cluster and its controllers on the host, removed afterwards."""
    crds = yaml.safe_dump_all(crd_bodies())
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=crds)
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s", "crd/certificates.cert-manager.io",
            "crd/clusterissuers.cert-manager.io", "crd/certificaterequests.cert-manager.io")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CERT_MANAGER_NAMESPACE}}])
    manager = environment.cert_manager(cluster.kubeconfig, cluster_namespace=CERT_MANAGER_NAMESPACE)
    try:
        yield manager
    finally:
        manager.stop()
        kubectl(cluster, "delete", "clusterissuer", ISSUER, "--ignore-not-found", check=False)
        kubectl(cluster, "delete", "namespace", CERT_MANAGER_NAMESPACE, "--wait=false", check=False)
        kubectl(cluster, "delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=crds, check=False)


@pytest.fixture(scope="module")
def world(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale, project_image: Any,
          cert_manager: CertManager, module_tailscale_nodes: TailscaleFactory,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[IngressWorld]:
    ns = installed_operator
    suffix = uuid.uuid4().hex[:6]
    tailnet, ingress, hostname = f"ingress-{suffix}", f"shop-{suffix}", f"shop-{suffix}"
    tag, granted, other = f"tag:ingress-{suffix}", f"tag:laptop-{suffix}", f"tag:stranger-{suffix}"
    secret, base = f"{tailnet}-bootstrap", f"{tailnet}-policy"

    ca = CertificateAuthority(tmp_path_factory.mktemp("issuer"), "tailnet-e2e-issuer")
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": ISSUER, "namespace": CERT_MANAGER_NAMESPACE},
         "type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(ca.pem).decode(),
                                               "tls.key": base64.b64encode(ca.key_pem).decode()}},
        {"apiVersion": "cert-manager.io/v1", "kind": "ClusterIssuer", "metadata": {"name": ISSUER},
         "spec": {"ca": {"secretName": ISSUER}}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
         "stringData": {"apiKey": cluster_headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": base, "namespace": ns},
         "data": {"policy.hujson": _base_policy(tag, granted, other)}},
        tailnet_object(tailnet, cluster_headscale, ns, secret=secret,
                       policy={"baseConfigMapRef": {"namespace": ns, "name": base, "key": "policy.hujson"},
                               "mode": "Apply"},
                       dns={"hostsConfigMap": {"namespace": HOSTS[0], "name": HOSTS[1]}, "zones": [ZONE]}),
    ])

    def policy_applied() -> bool:
        return condition(get_json(cluster, TAILNETS, tailnet), "PolicyApplied") == "True"

    wait_until(policy_applied, timeout=120, what="the Tailnet's policy applied (it owns the laptops' tags)")
    laptop = module_tailscale_nodes(f"laptop-{suffix}", cluster_headscale,
                                    authkey=cluster_headscale.create_preauth_key(tags=[granted]))
    stranger = module_tailscale_nodes(f"stranger-{suffix}", cluster_headscale,
                                      authkey=cluster_headscale.create_preauth_key(tags=[other]))
    try:
        with namespace(cluster, "tenant", {"pod-security.kubernetes.io/enforce": "restricted"}) as tenant:
            admit_tenant(cluster, tailnet, tenant, [tag], [f"*.{ZONE}"])
            backend = python_pod("web", tenant, project_image.ref, HTTP_SERVER, labels={"app": "web"}, port=8080)
            grpc = python_pod("grpc", tenant, project_image.ref, GRPC_SERVER, labels={"app": "grpc"}, port=GRPC_PORT,
                              python=VENV_PYTHON)
            apply(cluster, [backend, grpc, {
                "apiVersion": "v1", "kind": "Service", "metadata": {"name": "grpc", "namespace": tenant},
                "spec": {"selector": {"app": "grpc"}, "ports": [{"port": GRPC_PORT, "targetPort": GRPC_PORT}]}}, {
                "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": tenant},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]}}, {
                # the namespace lets the operator write its ingresses' objects (docs/reference/rbac.md)
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "tailnet-operator", "namespace": tenant},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "tailnet-operator-tenant"},
                "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": ns}]}])
            wait_pod_running(cluster, tenant, "web")
            wait_pod_running(cluster, tenant, "grpc")
            yield IngressWorld(ns, tenant, tailnet, ingress, tag, hostname, ca, laptop, stranger, granted)
            kubectl(cluster, "-n", tenant, "delete", INGRESSES, ingress, "--wait=true", "--timeout=90s", check=False)
    finally:
        remove_tailnet(cluster, tailnet)
        kubectl(cluster, "-n", ns, "delete", "secret", secret, check=False)
        kubectl(cluster, "-n", ns, "delete", "configmap", base, check=False)


def _ready(cluster: ClusterUnderTest, world: IngressWorld) -> dict[str, Any] | None:
    obj = get_json(cluster, "-n", world.tenant, INGRESSES, world.ingress)
    if condition(obj, "Ready") != "True" or not (obj.get("status") or {}).get("magicDNSName"):
        return None
    result: dict[str, Any] = obj
    return result


def _hosts(cluster: ClusterUnderTest) -> dict[str, str]:
    from tailnet_operator.controllers.dns import parse_hosts

    data = get_json(cluster, "-n", HOSTS[0], "configmap", HOSTS[1]).get("data") or {}
    return parse_hosts(data.get("hosts", ""))


def _run(coro: Any, timeout: float = 20) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _tcp_get(laptop: TailscaleNode, name: str, port: int, path: str) -> bytes:
    reader, writer = await tunnel(laptop.http_proxy_port, name, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def _https(laptop: TailscaleNode, address: str, ca: Path, sni: str, **kw: Any) -> Answer:
    return await request(await tunnel(laptop.http_proxy_port, address, 443), ca=ca, sni=sni, **kw)


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (OSError, TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        return None


def test_a_granted_laptop_reaches_the_service_by_magic_dns_and_https_with_the_issued_certificate(
        cluster: ClusterUnderTest, world: IngressWorld) -> None:
    apply(cluster, [world.ingress_object()])
    try:
        wait_available(cluster, world.tenant, world.agent, timeout=180)
        obj = wait_until(lambda: _ready(cluster, world), timeout=240,
                         what="the ingress Ready (certificate issued, exposes listening)")
    except (AssertionError, TimeoutError) as exc:
        raise _diagnose(cluster, world, exc) from exc
    status = obj["status"]
    magic = status["magicDNSName"]
    assert magic.startswith(world.hostname), status
    assert sorted(status["dnsNames"]) == sorted([f"{world.hostname}.{ZONE}", world.host_name, f"shop.{ZONE}",
                                                 world.grpc_name])
    web = next(e for e in status["exposes"] if e["name"] == "web")
    assert web["hosts"][0]["alias"] == "shop" and web["hosts"][0]["certificateNotAfter"], web
    assert all(e["listening"] for e in status["exposes"]), status["exposes"]

    body = wait_until(lambda: _attempt(lambda: _run(_tcp_get(world.laptop, magic, 8080, "/by-magic-dns"))),
                      timeout=90, what="the laptop to reach the Service through the tcp expose by MagicDNS name")
    assert b"200 OK" in body and b"hello from web" in body, body

    def named() -> dict[str, str] | None:
        hosts = _hosts(cluster)
        return hosts if world.host_name in hosts else None

    hosts = wait_until(named, timeout=60, what="the host's name in the hosts file")
    address = hosts[world.host_name]
    assert address in status["node"]["addresses"] and hosts[f"shop.{ZONE}"] == address

    for alpn in ("http/1.1", "h2"):
        for sni in (world.host_name, f"shop.{ZONE}"):
            answer = wait_until(lambda s=sni, a=alpn: _attempt(lambda: _run(  # type: ignore[misc]
                _https(world.laptop, address, world.ca.cert_path, s, alpn=a))), timeout=60,
                what=f"https to {sni} over {alpn}")
            assert answer.status == 200 and answer.alpn == alpn and b"hello from web" in answer.body, answer
            leaf = x509.load_der_x509_certificate(answer.certificate)
            assert leaf.issuer == x509.load_pem_x509_certificate(world.ca.pem).subject
    wrong = _run(_https(world.laptop, address, world.ca.cert_path, world.host_name, host="other.example"))
    assert wrong.status == 421, wrong

    # gRPC-style HTTP/2 with trailers, through the second http expose of port 443 (chosen by SNI)
    call = wait_until(lambda: _attempt(lambda: _run(_https(
        world.laptop, address, world.ca.cert_path, world.grpc_name, alpn="h2", method="POST",
        path="/echo.Echo/Say", body=grpc_frame(b"hello over the tailnet"),
        headers=(("content-type", "application/grpc"), ("te", "trailers"), ("tailnet-user-login", "mallory")),
        trailers=(("x-checksum", "42"),)))), timeout=60, what="a gRPC-style call to the h2c backend")
    assert call.status == 200 and call.alpn == "h2", call
    assert call.trailers == {"grpc-status": "0", "grpc-message": "echoed"}, call
    [message] = grpc_messages(call.body)
    seen = json.loads(message)
    assert seen["message"] == "hello over the tailnet" and seen["trailers"] == {"x-checksum": "42"}, seen
    assert seen["headers"].get("tailnet-node-tags") == world.laptop_tag, seen["headers"]
    assert "tailnet-user-login" not in seen["headers"], "a header the client sent is not passed on"


def test_a_laptop_the_policy_does_not_grant_cannot_connect(cluster: ClusterUnderTest, world: IngressWorld) -> None:
    apply(cluster, [world.ingress_object()])
    obj = wait_until(lambda: _ready(cluster, world), timeout=240, what="the ingress Ready")
    magic = obj["status"]["magicDNSName"]
    wait_until(lambda: _attempt(lambda: _run(_tcp_get(world.laptop, magic, 8080, "/granted"))), timeout=90,
               what="the granted laptop to connect (so the refusal below is the policy's)")
    for _ in range(3):
        assert _attempt(lambda: _run(_tcp_get(world.stranger, magic, 8080, "/refused"), timeout=10)) in (None, b""), \
            "a laptop the policy does not grant reached the ingress"


async def _plain_get(laptop: TailscaleNode, name: str, host: str, path: str,
                     headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, dict[str, str], bytes]:
    """One plaintext HTTP/1.1 request through the laptop's proxy to ``name`` port 80 for ``host``."""
    reader, writer = await tunnel(laptop.http_proxy_port, name, 80)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), fields, body


def test_a_plaintext_expose_routes_by_header_redirects_and_answers_500_when_no_backend_takes_requests(
        cluster: ClusterUnderTest, world: IngressWorld) -> None:
    """HTTPRoute rules on a TailnetIngress, end to end: a laptop speaks plain HTTP over the tailnet
    to the agent, whose route for a header answers a redirect itself, whose weight-0 route answers
    500, and whose plain path reaches the Service."""
    name, host = f"{world.ingress}-plain", f"plain-{world.hostname}.{ZONE}"
    web = {"service": "web", "port": 8080}
    apply(cluster, [{
        "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
        "metadata": {"name": name, "namespace": world.tenant},
        "spec": {"tailnetRef": {"name": world.tailnet}, "tag": world.tag, "hostname": f"{world.hostname}-plain",
                 "exposes": [{"name": "plain", "mode": "http", "plaintext": True, "port": 80, "backend": web,
                              "hosts": [{"name": host, "unmatchedPaths": "NotFound", "paths": [
                                  {"path": "/", "headers": [{"name": "X-Canary", "value": "yes"}],
                                   "redirect": {"path": {"type": "ReplaceFullPath", "value": "/canary"}}},
                                  {"path": "/none", "backends": [{**web, "weight": 0}]},
                                  {"path": "/", "backend": web}]}]}]}}])
    try:
        def ready() -> dict[str, Any] | None:
            obj: dict[str, Any] = get_json(cluster, "-n", world.tenant, INGRESSES, name)
            named = (obj.get("status") or {}).get("magicDNSName")
            return obj if condition(obj, "Ready") == "True" and named else None

        magic = wait_until(ready, timeout=240, what="the plaintext ingress Ready")["status"]["magicDNSName"]
        status, _, body = wait_until(lambda: _attempt(lambda: _run(_plain_get(world.laptop, magic, host, "/a"))),
                                     timeout=90, what="the laptop to reach the plaintext expose")
        assert status == 200 and body.startswith(b"hello from web"), (status, body)
        status, fields, _ = _run(_plain_get(world.laptop, magic, host, "/a?b=1", (("X-Canary", "yes"),)))
        assert status == 302 and fields["location"] == f"http://{host}/canary?b=1", (status, fields)
        status, _, body = _run(_plain_get(world.laptop, magic, host, "/none"))
        assert status == 500 and b"every weight is 0" in body, (status, body)
        status, _, body = _run(_plain_get(world.laptop, magic, "else.example.test", "/a"))
        assert status == 404, (status, body)
    finally:
        kubectl(cluster, "-n", world.tenant, "delete", INGRESSES, name, "--wait=true", "--timeout=90s", check=False)


def test_deleting_the_ingress_expires_its_key_and_removes_its_objects_and_names(
        cluster: ClusterUnderTest, world: IngressWorld, cluster_headscale: Headscale) -> None:
    apply(cluster, [world.ingress_object()])
    obj = wait_until(lambda: _ready(cluster, world), timeout=240, what="the ingress Ready")
    key_id = str(obj["status"]["preAuthKey"]["id"])
    owned = [("deployment", world.agent), ("service", world.agent), ("networkpolicy", world.agent),
             ("configmap", f"{world.ingress}-ingress-config"), ("secret", f"{world.ingress}-ingress-auth-key"),
             ("certificate.cert-manager.io", f"{world.ingress}-{world.host_name}")]
    for kind, name in owned:
        assert kubectl(cluster, "-n", world.tenant, "get", kind, name, "-o", "name").strip(), (kind, name)
    wait_until(lambda: world.host_name in _hosts(cluster), timeout=60, what="the names in the hosts file")

    kubectl(cluster, "-n", world.tenant, "delete", INGRESSES, world.ingress, "--wait=true", "--timeout=90s")

    keys = cluster_headscale.api("GET", "/api/v1/preauthkey").get("preAuthKeys") or []
    key = next(k for k in keys if str(k["id"]) == key_id)
    expiration = dt.datetime.fromisoformat(key["expiration"].replace("Z", "+00:00"))
    assert expiration <= dt.datetime.now(dt.UTC), key

    def gone() -> bool:
        return all(kubectl(cluster, "-n", world.tenant, "get", kind, name, "--ignore-not-found",
                           "-o", "name") == "" for kind, name in owned)

    wait_until(gone, timeout=60, what="every object the ingress owned to be garbage collected")
    wait_until(lambda: not {world.host_name, f"{world.hostname}.{ZONE}"} & set(_hosts(cluster)), timeout=60,
               what="the names to leave the hosts file")


# -- the Gateway API ---------------------------------------------------------------------------------

GATEWAY_API = "gateway.networking.k8s.io"


@pytest.fixture(scope="module")
def gateway_api(cluster: ClusterUnderTest) -> Iterator[None]:
    """The Gateway API's CRDs, installed after the operator started (as a platform adds them to a
    running cluster: the operator must find them without a restart), removed afterwards."""
    from hack.localenv.gatewayapi import crd_bodies, crd_names

    crds = yaml.safe_dump_all(crd_bodies())
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=crds)
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in crd_names()))
    try:
        yield
    finally:
        kubectl(cluster, "delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=crds, check=False)


def _gateway_api_objects(world: IngressWorld, cls: str, host: str) -> list[dict[str, Any]]:
    """A tailnet GatewayClass naming the world's Tailnet, a Gateway with one HTTP listener for
    ``host``, and an HTTPRoute: ``/split`` weighted over web and canary, ``X-Canary: yes`` to
    canary, everything else to web."""
    web, canary = {"name": "web", "port": 8080}, {"name": "canary", "port": 8080}
    return [
        {"apiVersion": f"{GATEWAY_API}/v1", "kind": "GatewayClass", "metadata": {"name": cls},
         "spec": {"controllerName": "tailnet.dev/gateway-controller",
                  "parametersRef": {"group": "tailnet.dev", "kind": "Tailnet", "name": world.tailnet}}},
        {"apiVersion": f"{GATEWAY_API}/v1", "kind": "Gateway",
         "metadata": {"name": "edge", "namespace": world.tenant,
                      "annotations": {"tailnet.dev/tag": world.tag, "tailnet.dev/hostname": f"{world.hostname}-gw"}},
         "spec": {"gatewayClassName": cls,
                  "listeners": [{"name": "web", "port": 80, "protocol": "HTTP", "hostname": host}]}},
        {"apiVersion": f"{GATEWAY_API}/v1", "kind": "HTTPRoute",
         "metadata": {"name": "shop", "namespace": world.tenant},
         "spec": {"parentRefs": [{"name": "edge"}], "rules": [
             {"matches": [{"path": {"type": "Exact", "value": "/split"}}],
              "backendRefs": [{**web, "weight": 1}, {**canary, "weight": 1}]},
             {"matches": [{"path": {"type": "PathPrefix", "value": "/"},
                           "headers": [{"name": "X-Canary", "value": "yes"}]}], "backendRefs": [canary]},
             {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [web]}]}}]


def _programmed(cluster: ClusterUnderTest, world: IngressWorld) -> dict[str, Any] | None:
    """The Gateway once Programmed with an IP address in its status."""
    obj: dict[str, Any] = get_json(cluster, "-n", world.tenant, f"gateways.{GATEWAY_API}", "edge")
    addresses = [a for a in (obj.get("status") or {}).get("addresses") or [] if a.get("type") == "IPAddress"]
    return obj if condition(obj, "Programmed") == "True" and addresses else None


def test_a_gateway_of_the_tailnet_class_routes_an_httproute_by_path_header_and_weight(
        cluster: ClusterUnderTest, world: IngressWorld, gateway_api: None, project_image: Any) -> None:
    """The Gateway API end to end: a Gateway of a tailnet GatewayClass becomes an agent pod, which
    answers 404 until a route is attached; the laptop reaches it at the address its status gives,
    and its HTTPRoute's exact path splits over
    two Services by weight, its header match picks the canary, and its prefix takes the rest. The
    class, the Gateway and the route say so in the Gateway API's own conditions."""
    cls, host = f"tailnet-{world.hostname}", f"gw-{world.hostname}.{ZONE}"
    canary = python_pod("canary", world.tenant, project_image.ref, HTTP_SERVER, labels={"app": "canary"}, port=8080)
    apply(cluster, [canary, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "canary",
                                                                                   "namespace": world.tenant},
                             "spec": {"selector": {"app": "canary"}, "ports": [{"port": 8080, "targetPort": 8080}]}}])
    wait_pod_running(cluster, world.tenant, "canary")
    *gateway, route = _gateway_api_objects(world, cls, host)
    apply(cluster, gateway)
    try:
        # Before any route: a node that listens and answers 404.
        obj = wait_until(lambda: _programmed(cluster, world), timeout=300,
                         what="the Gateway Programmed with its node's addresses (CRDs found within 30 s)")
        [address] = [a["value"] for a in obj["status"]["addresses"] if a["type"] == "IPAddress"][:1]
        status, _, _ = wait_until(lambda: _attempt(lambda: _run(_plain_get(world.laptop, address, host, "/a"))),
                                  timeout=90, what="the laptop to reach the Gateway without routes")
        assert status == 404
        apply(cluster, [route])

        def attached() -> dict[str, Any] | None:
            found = _programmed(cluster, world)
            return found if found and found["status"]["listeners"][0]["attachedRoutes"] == 1 else None

        obj = wait_until(attached, timeout=120, what="the route attached to the Gateway's listener")
        assert condition(obj, "Accepted") == "True"
        [listener] = obj["status"]["listeners"]
        assert condition({"status": listener}, "Programmed") == "True", listener
        route = get_json(cluster, "-n", world.tenant, f"httproutes.{GATEWAY_API}", "shop")
        [parent] = route["status"]["parents"]
        assert parent["controllerName"] == "tailnet.dev/gateway-controller"
        assert [condition({"status": parent}, c) for c in ("Accepted", "ResolvedRefs")] == ["True", "True"], parent
        assert condition(get_json(cluster, f"gatewayclasses.{GATEWAY_API}", cls), "Accepted") == "True"

        def routed() -> tuple[int, dict[str, str], bytes] | None:
            answer = _attempt(lambda: _run(_plain_get(world.laptop, address, host, "/a")))
            return answer if answer is not None and answer[0] != 404 else None

        status, _, body = wait_until(routed, timeout=90, what="the agent to serve the route")
        assert (status, body) == (200, b"hello from web"), (status, body)
        status, _, body = _run(_plain_get(world.laptop, address, host, "/a", (("X-Canary", "yes"),)))
        assert (status, body) == (200, b"hello from canary"), (status, body)
        answers = [_run(_plain_get(world.laptop, address, host, "/split"))[2] for _ in range(40)]
        counts = {b: answers.count(b) for b in set(answers)}
        assert set(counts) == {b"hello from web", b"hello from canary"} and min(counts.values()) >= 5, counts
        status, _, _ = _run(_plain_get(world.laptop, address, "else.example.test", "/a"))
        assert status == 404
    except AssertionError as exc:
        raise _diagnose_gateway(cluster, world, exc) from exc
    finally:
        kubectl(cluster, "-n", world.tenant, "delete", f"gateways.{GATEWAY_API}", "edge", "--wait=true",
                "--timeout=90s", check=False)
        kubectl(cluster, "delete", f"gatewayclasses.{GATEWAY_API}", cls, "--ignore-not-found", check=False)
        kubectl(cluster, "-n", world.tenant, "delete", "pod,service", "canary", "--ignore-not-found", check=False)
        # The route goes with its Gateway: a later Gateway named edge would find it attached.
        kubectl(cluster, "-n", world.tenant, "delete", f"httproutes.{GATEWAY_API}", "shop", "--ignore-not-found",
                check=False)


def _diagnose_gateway(cluster: ClusterUnderTest, world: IngressWorld, exc: BaseException) -> AssertionError:
    status = get_json(cluster, "-n", world.tenant, f"gateways.{GATEWAY_API}", "edge").get("status")
    agent = kubectl(cluster, "-n", world.tenant, "logs", "deployment/edge-gw-ingress-agent", "--tail=40", check=False)
    return AssertionError(f"{exc}\ngateway status: {status}\nagent logs:\n{agent}\n"
                          f"operator logs:\n{operator_logs(cluster, world.namespace)}")


TLS_SERVER = """
import http.server, socket, ssl
class Hello(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = ("tls from " + socket.gethostname()).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), Hello)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/tls/tls.crt", "/tls/tls.key")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
"""An HTTPS server that terminates TLS itself, with the certificate of the Secret mounted at /tls."""


def _tls_backend(world: IngressWorld, image: str, host: str) -> list[dict[str, Any]]:
    """A pod and Service ``vault`` serving HTTPS on 8443 with a certificate for ``host`` from the
    world's CA, kept in a Secret only the pod mounts (the agent never holds it)."""
    pair = world.ca.issue("vault", common_name=host, hosts=(host,))
    pod = python_pod("vault", world.tenant, image, TLS_SERVER, labels={"app": "vault"}, port=8443)
    pod["spec"]["volumes"] = [{"name": "tls", "secret": {"secretName": "vault-tls"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "tls", "mountPath": "/tls", "readOnly": True}]
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "vault-tls", "namespace": world.tenant},
             "type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                                                   "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}},
            pod, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vault", "namespace": world.tenant},
                  "spec": {"selector": {"app": "vault"}, "ports": [{"port": 8443, "targetPort": 8443}]}}]


def test_a_gateway_passes_tls_through_by_sni_and_tcp_by_port(
        cluster: ClusterUnderTest, world: IngressWorld, gateway_api: None, project_image: Any) -> None:
    """A Gateway of a TLS passthrough listener and a TCP listener: a node with no port open until a
    route is served (Programmed, with its addresses); then the laptop's TLS reaches the backend's
    own certificate (the node only read SNI), an unknown name is refused, and the TCPRoute's port
    reaches its Service. Both routes say so in their own status. When the TCPRoute goes, its port
    closes and the node stays."""
    cls, tls_host = f"tailnet-{world.hostname}-l4", f"vault-{world.hostname}.{ZONE}"
    apply(cluster, _tls_backend(world, project_image.ref, tls_host))
    wait_pod_running(cluster, world.tenant, "vault")
    gateway_class, *_ = _gateway_api_objects(world, cls, tls_host)
    gateway = {"apiVersion": f"{GATEWAY_API}/v1", "kind": "Gateway",
               "metadata": {"name": "edge", "namespace": world.tenant,
                            "annotations": {"tailnet.dev/tag": world.tag,
                                            "tailnet.dev/hostname": f"{world.hostname}-l4"}},
               "spec": {"gatewayClassName": cls, "listeners": [
                   {"name": "vault", "port": 443, "protocol": "TLS", "tls": {"mode": "Passthrough"}},
                   {"name": "db", "port": 5432, "protocol": "TCP"}]}}
    routes = [{"apiVersion": f"{GATEWAY_API}/v1", "kind": "TLSRoute",
               "metadata": {"name": "vault", "namespace": world.tenant},
               "spec": {"parentRefs": [{"name": "edge", "sectionName": "vault"}], "hostnames": [tls_host],
                        "rules": [{"backendRefs": [{"name": "vault", "port": 8443}]}]}},
              {"apiVersion": f"{GATEWAY_API}/v1", "kind": "TCPRoute",
               "metadata": {"name": "db", "namespace": world.tenant},
               "spec": {"parentRefs": [{"name": "edge", "sectionName": "db"}],
                        "rules": [{"backendRefs": [{"name": "web", "port": 8080}]}]}}]
    apply(cluster, [gateway_class, gateway])
    try:
        obj = wait_until(lambda: _programmed(cluster, world), timeout=300,
                         what="the Gateway Programmed before any route: a node with no port open")
        [address] = [a["value"] for a in obj["status"]["addresses"] if a["type"] == "IPAddress"][:1]
        assert {ls["name"]: ls["attachedRoutes"] for ls in obj["status"]["listeners"]} == {"vault": 0, "db": 0}
        with pytest.raises((OSError, ConnectionError, asyncio.IncompleteReadError)):  # TimeoutError is an OSError
            _run(_tcp_get(world.laptop, address, 5432, "/"))
        apply(cluster, routes)

        def served() -> dict[str, Any] | None:
            found = _programmed(cluster, world)
            return found if found and all(ls["attachedRoutes"] == 1 for ls in found["status"]["listeners"]) else None

        obj = wait_until(served, timeout=300, what="the Gateway Programmed with its routes served")
        assert {ls["name"]: ls["attachedRoutes"] for ls in obj["status"]["listeners"]} == {"vault": 1, "db": 1}
        for kind, name in (("tlsroutes", "vault"), ("tcproutes", "db")):
            [parent] = get_json(cluster, "-n", world.tenant, f"{kind}.{GATEWAY_API}", name)["status"]["parents"]
            assert [condition({"status": parent}, c) for c in ("Accepted", "ResolvedRefs")] == ["True", "True"], \
                (kind, parent)

        async def through() -> Answer:
            return await request(await tunnel(world.laptop.http_proxy_port, address, 443), ca=world.ca.cert_path,
                                 sni=tls_host)

        answer = wait_until(lambda: _attempt(lambda: _run(through())), timeout=90,
                            what="the laptop's TLS passed through to the backend")
        assert (answer.status, answer.body) == (200, b"tls from vault"), answer
        leaf = x509.load_der_x509_certificate(answer.certificate)
        assert leaf.subject.rfc4514_string() == f"CN={tls_host}", "the backend's own certificate"

        async def unknown() -> Answer:
            return await request(await tunnel(world.laptop.http_proxy_port, address, 443), ca=world.ca.cert_path,
                                 sni=f"else.{ZONE}", check_name=False)

        with pytest.raises((OSError, ConnectionError, asyncio.IncompleteReadError)):
            _run(unknown())
        data = wait_until(lambda: _attempt(lambda: _run(_tcp_get(world.laptop, address, 5432, "/"))), timeout=60,
                          what="the TCPRoute's port answered")
        assert data.startswith(b"HTTP/1.0 200") and data.endswith(b"hello from web"), data

        kubectl(cluster, "-n", world.tenant, "delete", f"tcproutes.{GATEWAY_API}", "db")

        def closed() -> bool:
            try:
                _run(_tcp_get(world.laptop, address, 5432, "/"))
            except (OSError, ConnectionError, asyncio.IncompleteReadError):
                return True
            return False

        wait_until(closed, timeout=90, what="the TCPRoute's port closed once the route went")
        assert _programmed(cluster, world) is not None, "the node stays, with its addresses"
    except AssertionError as exc:
        raise _diagnose_gateway(cluster, world, exc) from exc
    finally:
        kubectl(cluster, "-n", world.tenant, "delete", f"gateways.{GATEWAY_API}", "edge", "--wait=true",
                "--timeout=90s", check=False)
        kubectl(cluster, "-n", world.tenant, "delete", f"tlsroutes.{GATEWAY_API},tcproutes.{GATEWAY_API}", "--all",
                check=False)
        kubectl(cluster, "delete", f"gatewayclasses.{GATEWAY_API}", cls, "--ignore-not-found", check=False)
        kubectl(cluster, "-n", world.tenant, "delete", "pod,service,secret", "vault", "vault-tls",
                "--ignore-not-found", check=False)


def test_a_grpcroute_on_an_https_listener_reaches_an_h2c_backend_by_service_and_method(
        cluster: ClusterUnderTest, world: IngressWorld, gateway_api: None) -> None:
    """A GRPCRoute on an HTTPS listener: the laptop's gRPC call (HTTP/2 over TLS with the
    listener's certificate) reaches the h2c echo backend by its service and method, trailers and
    the caller's identity with it; a method the route does not name gets 404."""
    cls, host = f"tailnet-{world.hostname}-rpc", f"rpc-{world.hostname}.{ZONE}"
    pair = world.ca.issue("rpc", common_name=host, hosts=(host,))
    gateway_class, *_ = _gateway_api_objects(world, cls, host)
    objects = [
        gateway_class,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rpc-tls", "namespace": world.tenant},
         "type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                                               "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}},
        {"apiVersion": f"{GATEWAY_API}/v1", "kind": "Gateway",
         "metadata": {"name": "edge", "namespace": world.tenant,
                      "annotations": {"tailnet.dev/tag": world.tag, "tailnet.dev/hostname": f"{world.hostname}-rpc"}},
         "spec": {"gatewayClassName": cls, "listeners": [
             {"name": "rpc", "port": 443, "protocol": "HTTPS", "hostname": host,
              "tls": {"mode": "Terminate", "certificateRefs": [{"name": "rpc-tls"}]}}]}},
        {"apiVersion": f"{GATEWAY_API}/v1", "kind": "GRPCRoute",
         "metadata": {"name": "echo", "namespace": world.tenant},
         "spec": {"parentRefs": [{"name": "edge"}], "rules": [
             {"matches": [{"method": {"service": "echo.Echo", "method": "Say"}}],
              "backendRefs": [{"name": "grpc", "port": GRPC_PORT}]}]}}]
    apply(cluster, objects)
    try:
        obj = wait_until(lambda: _programmed(cluster, world), timeout=300, what="the Gateway Programmed")
        [address] = [a["value"] for a in obj["status"]["addresses"] if a["type"] == "IPAddress"][:1]
        [parent] = get_json(cluster, "-n", world.tenant, f"grpcroutes.{GATEWAY_API}", "echo")["status"]["parents"]
        assert [condition({"status": parent}, c) for c in ("Accepted", "ResolvedRefs")] == ["True", "True"], parent
        assert {"group": GATEWAY_API, "kind": "GRPCRoute"} in obj["status"]["listeners"][0]["supportedKinds"]

        def call(method: str) -> Answer:
            answer: Answer = _run(_https(world.laptop, address, world.ca.cert_path, host, alpn="h2", method="POST",
                               path=f"/echo.Echo/{method}", body=grpc_frame(b"hello through a GRPCRoute"),
                               headers=(("content-type", "application/grpc"), ("te", "trailers")),
                               trailers=(("x-checksum", "7"),)))
            return answer

        answer = wait_until(lambda: (found := _attempt(lambda: call("Say"))) and found.status == 200 and found,
                            timeout=90, what="the gRPC call routed to the echo backend")
        assert answer.alpn == "h2" and answer.trailers == {"grpc-status": "0", "grpc-message": "echoed"}, answer
        [message] = grpc_messages(answer.body)
        seen = json.loads(message)
        assert seen["message"] == "hello through a GRPCRoute" and seen["trailers"] == {"x-checksum": "7"}, seen
        assert seen["headers"].get("tailnet-node-tags") == world.laptop_tag, seen["headers"]
        assert call("Shout").status == 404, "a method no rule names"
    except AssertionError as exc:
        raise _diagnose_gateway(cluster, world, exc) from exc
    finally:
        kubectl(cluster, "-n", world.tenant, "delete", f"gateways.{GATEWAY_API}", "edge", "--wait=true",
                "--timeout=90s", check=False)
        kubectl(cluster, "-n", world.tenant, "delete", f"grpcroutes.{GATEWAY_API}", "echo", "--ignore-not-found",
                check=False)
        kubectl(cluster, "delete", f"gatewayclasses.{GATEWAY_API}", cls, "--ignore-not-found", check=False)
        kubectl(cluster, "-n", world.tenant, "delete", "secret", "rpc-tls", "--ignore-not-found", check=False)
