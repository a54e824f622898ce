"""The IngressClass against kube-apiserver (with its garbage collector), Headscale, the agent and a
tailscaled "laptop", the operator running from source; no node (no agent pod runs).

The agent runs in this process (as :func:`e2e.test_agent_ingress.ingress_agent` assembles it),
with the pre-auth key and the exposes file the operator wrote for the Ingress, standing in for the
agent pod: the test does what kubelet and the cluster's DNS would, writing the projected TLS
Secret's files and pointing each backend Service's name at a server on 127.0.0.1. Its ``/status``
is what the operator reads. The laptop then reaches the Ingress's hosts over the tailnet and gets
answers from two backends by path, over HTTP/1.1 and HTTP/2.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from e2e.backends import served
from e2e.test_agent_egress import wait_peer_sees
from e2e.test_agent_ingress import IngressAgent, ingress_agent
from hack.https_client import request, tunnel
from hack.localenv import ControlPlane, Headscale
from hack.localenv._pki import CertificateAuthority
from hack.localenv.tailscale import TailscaleNode
from tailnet_operator.controllers.ingressclass import FIELD_MANAGER
from tailnet_operator.controllers.kinds import INGRESS, INGRESS_CLASS, TAILNET
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.resources.ingress import CERTS_DIR, EXPOSES_FILE
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime import managed_paths
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CERTIFICATE, CONFIG_MAP, DEPLOYMENT, EVENT, NAMESPACE, SECRET, SERVICE

from .certmanager_plane import ISSUER, CertManagerPlane, ca_cluster_issuer, issued
from .conftest import TailscaleFactory
from .operator import (
    create_bootstrap_secret,
    get_or_none,
    gone,
    remove_tailnets,
    running_operator,
    tailnet_object,
    unique,
)
from .polling import eventually

pytestmark = pytest.mark.integration

TAG = "tag:ic-shop"
LAPTOP_TAG = "tag:ic-laptop"
BASE = ('{"tagOwners": {"tag:ic-shop": [], "tag:ic-laptop": []}, '
        '"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}\n')
"""Everyone reaches everything; the laptop's tag is owned (the Ingress's the render adds)."""
HOST = "shop.ic.e2e.internal"


class AgentInProcess:
    """The agent's ``/status`` for the operator: the in-process agent's (None until it runs)."""

    def __init__(self) -> None:
        self.agent: IngressAgent | None = None

    async def read(self, owner: Any) -> JSON | None:
        return None if self.agent is None else await self.agent.status()


@dataclass
class Scene:
    admin: Client
    kubeconfig: Path
    headscale: Headscale
    namespace: str
    """The operator's namespace: the bootstrap Secret, the base policy, the key records."""
    tenant: str
    tailnet: str
    ca: CertificateAuthority


@contextlib.asynccontextmanager
async def _scene(admin: Client, kubeconfig: Path, headscale: Headscale, namespace: str,
                 ca: CertificateAuthority) -> AsyncIterator[Scene]:
    """A tenant namespace and what the test leaves behind removed after it: the Ingresses'
    finalizers, the namespace, the classes."""
    tenant = unique("ic-tenant")
    await admin.create(NAMESPACE, {"metadata": {"name": tenant}})
    tailnet = f"{namespace}-tn"
    classes = (f"{tenant}-tailnet", f"{tenant}-other")
    try:
        yield Scene(admin, kubeconfig, headscale, namespace, tenant, tailnet, ca)
    finally:
        for obj in (await admin.list(INGRESS, tenant)).items:
            if obj["metadata"].get("finalizers"):
                await admin.merge_patch(INGRESS, obj["metadata"]["name"], {"metadata": {"finalizers": None}}, tenant)
        await admin.delete(NAMESPACE, tenant)
        for name in classes:
            with contextlib.suppress(NotFound):
                await admin.delete(INGRESS_CLASS, name)


@pytest.fixture
async def scene(admin: Client, crds: ControlPlane, headscale: Headscale, operator_namespace: str,
                tmp_path: Path) -> AsyncIterator[Scene]:
    async with _scene(admin, crds.kubeconfig, headscale, operator_namespace,
                      CertificateAuthority(tmp_path / "pki", "ic")) as made:
        yield made


async def _world(scene: Scene, *, tls_secret: bool = True) -> str:
    """The Tailnet (its tenant may use ``tag:ic-*``; the base policy in Apply mode), the class
    naming it, the Services the Ingress's backends name and (``tls_secret``) the TLS Secret of its
    host; returns the class's name."""
    admin, namespace, tenant = scene.admin, scene.namespace, scene.tenant
    await create_bootstrap_secret(admin, namespace, "bootstrap", scene.headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                   "data": {"policy.hujson": BASE}})
    await admin.create(TAILNET, tailnet_object(
        scene.tailnet, scene.headscale, namespace, tenants=[{"namespaces": [tenant], "tags": ["tag:ic-*"]}],
        policy={"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"},
                "mode": "Apply"}))
    cls = f"{tenant}-tailnet"
    await admin.create(INGRESS_CLASS, {"metadata": {"name": cls}, "spec": {
        "controller": ic.CONTROLLER,
        "parameters": {"apiGroup": "tailnet.dev", "kind": "Tailnet", "name": scene.tailnet, "scope": "Cluster"}}})
    await admin.create(INGRESS_CLASS, {"metadata": {"name": f"{tenant}-other"},
                                       "spec": {"controller": "example.com/other-controller"}})
    for name, port in (("api", {"name": "http", "port": 8080}), ("web", {"name": "web", "port": 80})):
        await admin.create(SERVICE, {"metadata": {"name": name, "namespace": tenant}, "spec": {"ports": [port]}})
    if not tls_secret:
        return cls
    pair = scene.ca.issue("shop", common_name=HOST, hosts=(HOST,))
    await admin.create(SECRET, {"metadata": {"name": "shop-tls", "namespace": tenant}, "type": "kubernetes.io/tls",
                                "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                                         "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}})
    return cls


def _path(path: str, kind: str, service: str, port: JSON) -> JSON:
    return {"path": path, "pathType": kind, "backend": {"service": {"name": service, "port": port}}}


def ingress(name: str, namespace: str, cls: str, host: str, hostname: str) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace,
                         "annotations": {lb.TAG_ANNOTATION: TAG, lb.HOSTNAME_ANNOTATION: hostname}},
            "spec": {"ingressClassName": cls, "tls": [{"hosts": [HOST], "secretName": "shop-tls"}],
                     "rules": [{"host": host, "http": {"paths": [
                         _path("/api", "Prefix", "api", {"name": "http"}),
                         _path("/api/health", "Exact", "web", {"number": 80}),
                         _path("/", "ImplementationSpecific", "web", {"number": 80})]}}]}}


async def _events(admin: Client, namespace: str, name: str, wanted: set[str]) -> dict[str, str] | None:
    """The Ingress's Events by reason (their notes), once every reason of ``wanted`` is among them."""
    found = {e["reason"]: str(e.get("note") or "") for e in (await admin.list(EVENT, namespace)).items
             if e.get("regarding", {}).get("kind") == "Ingress" and e["regarding"].get("name") == name}
    return found if wanted <= set(found) else None


def _as_kubelet_and_dns(exposes: list[JSON], certs: Path, tls: JSON, ports: dict[tuple[str, int], int]) -> list[JSON]:
    """The exposes file as the agent pod would find it working: the projected Secret's files
    written under ``certs`` (for the pod's CERTS_DIR), each backend Service name resolved to the
    server on 127.0.0.1 that stands in for it."""
    def local(backend: JSON) -> JSON:
        return {**backend, "host": "127.0.0.1", "port": ports[(backend["host"], backend["port"])]}

    out = []
    for expose in exposes:
        hosts = []
        for host in expose["hosts"]:
            for key in ("certFile", "keyFile"):
                file = certs / Path(host["tls"][key]).relative_to(CERTS_DIR)
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(base64.b64decode(tls["data"][Path(file).name]))
            hosts.append({**host, "tls": {k: str(certs / Path(v).relative_to(CERTS_DIR))
                                          for k, v in host["tls"].items()},
                          "routes": [{**r, "backend": local(r["backend"])} for r in host.get("routes", [])]})
        out.append({**expose, "backend": local(expose["backend"]), "hosts": hosts})
    return out


def _named(name: str) -> web.Application:
    """A backend that answers with its name and the path it was asked for."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"backend": name, "path": request.path_qs})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


async def _served_at(admin: Client, namespace: str, agent: IngressAgent) -> JSON | None:
    """The Ingress once ``status.loadBalancer.ingress`` carries the node's MagicDNS name and addresses."""
    node = (await agent.status())["node"]
    obj = await admin.get(INGRESS, "shop", namespace)
    entries = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    wanted = [{"hostname": str(node["name"]).rstrip(".")}, *({"ip": ip} for ip in node["addresses"])]
    return obj if entries == wanted else None


@contextlib.asynccontextmanager
async def _served(scene: Scene, hostname: str, tailscale_nodes: TailscaleFactory, ports: dict[tuple[str, int], int],
                  standin: AgentInProcess, workdir: Path,
                  ) -> AsyncIterator[tuple[list[JSON], IngressAgent, TailscaleNode]]:
    """The Ingress ``shop`` served as its agent pod would serve it, once the operator has written
    its exposes file and pre-auth key and its TLS Secret holds a certificate: the exposes file as
    written, the agent (whose ``/status`` the operator reads meanwhile) and a laptop that sees it."""
    admin, tenant = scene.admin, scene.tenant
    config = await eventually(lambda: get_or_none(admin, CONFIG_MAP, "shop-ing-ingress-config", tenant), timeout=90,
                              what="the Ingress's exposes file")
    key_secret = await eventually(lambda: get_or_none(admin, SECRET, "shop-ing-ingress-auth-key", tenant), timeout=60,
                                  what="the Ingress's pre-auth key")
    key = base64.b64decode(key_secret["data"]["authKey"]).decode()
    exposes = json.loads(config["data"][EXPOSES_FILE])
    tls = await eventually(lambda: issued(admin, "shop-tls", tenant), timeout=120, what="the TLS Secret shop-tls")
    working = _as_kubelet_and_dns(exposes, workdir / "certs", tls, ports)
    laptop_key = scene.headscale.create_preauth_key(tags=[LAPTOP_TAG], reusable=True, ephemeral=True)
    (workdir / "agent").mkdir()
    async with ingress_agent(scene.headscale, hostname, key, workdir / "agent", working) as agent:
        standin.agent = agent
        try:
            laptop = tailscale_nodes(unique("ic-laptop"), scene.headscale, authkey=laptop_key)
            await wait_peer_sees(laptop, hostname)
            yield exposes, agent, laptop
        finally:
            standin.agent = None  # the agent pod is gone


async def _answers(agent: IngressAgent, laptop: TailscaleNode, ca: Path, cases: tuple[tuple[str, str], ...]) -> None:
    """Each path, asked by the laptop over the tailnet (HTTP/1.1 and HTTP/2, the certificate checked
    against ``ca``), answered by the backend named beside it."""
    for alpn in ("http/1.1", "h2"):
        for path, backend in cases:
            answer = await request(await tunnel(laptop.http_proxy_port, agent.ip, 443), ca=ca, sni=HOST, alpn=alpn,
                                   path=path)
            assert answer.alpn == alpn and answer.status == 200, (alpn, path, answer)
            assert json.loads(answer.body) == {"backend": backend, "path": path}, (alpn, path)


async def test_an_ingress_of_the_class_routes_by_path_to_two_backends_over_the_tailnet(
    scene: Scene, tailscale_nodes: TailscaleFactory, tmp_path: Path,
) -> None:
    admin, tenant = scene.admin, scene.tenant
    hostname = unique("ic-shop")
    standin = AgentInProcess()
    async with (running_operator(scene.kubeconfig, scene.namespace, agent_status=standin),
                served(_named("api")) as api_port, served(_named("web")) as web_port):
        cls = await _world(scene)
        await admin.create(INGRESS, ingress("shop", tenant, cls, HOST, hostname))
        await admin.create(INGRESS, ingress("elsewhere", tenant, f"{tenant}-other", HOST, unique("ic-other")))
        await admin.create(INGRESS, ingress("bare", tenant, cls, "plain.ic.e2e.internal", unique("ic-bare")))

        ports = {(f"api.{tenant}.svc", 8080): api_port, (f"web.{tenant}.svc", 80): web_port}
        async with _served(scene, hostname, tailscale_nodes, ports, standin, tmp_path) as (exposes, agent, laptop):
            [expose] = exposes
            assert (expose["name"], expose["port"], expose["mode"]) == ("https-0", 443, "http")
            [host] = expose["hosts"]
            assert [(r["path"], r["type"], r["backend"]["host"], r["backend"]["port"]) for r in host["routes"]] == [
                ("/api", "Prefix", f"api.{tenant}.svc", 8080), ("/api/health", "Exact", f"web.{tenant}.svc", 80),
                ("/", "Prefix", f"web.{tenant}.svc", 80)]
            assert host["fallback"] is False  # no defaultBackend: what no path matches gets 404
            key_id = (await admin.get(SECRET, ic.record_name(tenant, "shop"), scene.namespace)
                      )["metadata"]["annotations"]["tailnet.dev/key-id"]
            await _answers(agent, laptop, scene.ca.cert_path, (
                ("/api/orders?id=7", "api"), ("/api", "api"), ("/api/health", "web"), ("/apiary", "web"), ("/", "web")))
            obj = await eventually(lambda: _served_at(admin, tenant, agent), timeout=90,
                                   what="status.loadBalancer.ingress with the node's name and addresses")
            assert "tailnet.dev/finalizer" in obj["metadata"]["finalizers"]
            notes = await eventually(lambda: _events(admin, tenant, "shop", {"Serving"}), timeout=60,
                                     what="the Event saying where the Ingress is served")
            assert str(obj["status"]["loadBalancer"]["ingress"][0]["hostname"]) in notes["Serving"]

        refused = await eventually(lambda: _events(admin, tenant, "bare", {"HostWithoutTLS"}), timeout=60,
                                   what="the Warning Event of the Ingress whose host has no TLS")
        assert "plain.ic.e2e.internal is in no spec.tls entry" in refused["HostWithoutTLS"]
        assert await get_or_none(admin, DEPLOYMENT, "bare-ing-ingress-agent", tenant) is None
        other = await admin.get(INGRESS, "elsewhere", tenant)
        assert not other["metadata"].get("finalizers") and not (other.get("status") or {}).get("loadBalancer")
        assert not [m for m in other["metadata"].get("managedFields") or []
                    if str(m.get("manager")).startswith("tailnet-operator")]
        assert await get_or_none(admin, DEPLOYMENT, "elsewhere-ing-ingress-agent", tenant) is None

        await admin.merge_patch(INGRESS, "shop", {"spec": {"ingressClassName": f"{tenant}-other"}}, tenant)
        await eventually(lambda: _released(admin, tenant), timeout=60,
                         what="the agent's objects, the status and the finalizer gone with the class")
        await eventually(lambda: _events(admin, tenant, "shop", {"IngressReleased"}), timeout=30,
                         what="the Event saying the Ingress was released")
        # What the release leaves of the controller's status entry owns no field: a later reconcile
        # (every operator start) has nothing to undo and reads nothing of the agent.
        released = await admin.get(INGRESS, "shop", tenant)
        assert managed_paths(released, FIELD_MANAGER, subresource="status") <= {("f:status",)}
        assert await get_or_none(admin, SECRET, ic.record_name(tenant, "shop"), scene.namespace) is None
        [hs_key] = [k for k in scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if k["id"] == key_id]
        assert datetime.fromisoformat(str(hs_key["expiration"]).replace("Z", "+00:00")) <= datetime.now(UTC)
        # This control plane has no namespace controller: what stays is seen by every later operator.
        for name in ("shop", "elsewhere", "bare"):
            await admin.delete(INGRESS, name, tenant)


async def _released(admin: Client, namespace: str) -> bool:
    for resource, name in ((DEPLOYMENT, "shop-ing-ingress-agent"), (CONFIG_MAP, "shop-ing-ingress-config"),
                           (SECRET, "shop-ing-ingress-auth-key")):
        if await get_or_none(admin, resource, name, namespace) is not None:
            return False
    obj = await admin.get(INGRESS, "shop", namespace)
    return not obj["metadata"].get("finalizers") and not (obj.get("status") or {}).get("loadBalancer")


async def test_cert_managers_ingress_shim_issues_the_certificate_an_ingress_of_the_class_is_served_with(
    cert_manager_plane: CertManagerPlane, headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path,
) -> None:
    """An Ingress with cert-manager's ``cert-manager.io/cluster-issuer`` annotation and no TLS
    Secret of its own: cert-manager's ingress-shim makes the Certificate of its ``spec.tls`` entry,
    cert-manager issues it into the Secret, and the laptop reaches the Ingress's two paths over the
    tailnet with that certificate, checked against the issuer's CA."""
    kubeconfig = cert_manager_plane.plane.kubeconfig
    async with Client(rest_config.load(kubeconfig), field_manager="test-admin") as admin:
        namespace = unique("op")
        await admin.create(NAMESPACE, {"metadata": {"name": namespace}})
        try:
            ca = await ca_cluster_issuer(admin, tmp_path / "ca")
            async with _scene(admin, kubeconfig, headscale, namespace, ca) as scene:
                await _shim_served(scene, cert_manager_plane, tailscale_nodes, tmp_path)
        finally:
            await remove_tailnets(admin, namespace)
            await admin.delete(NAMESPACE, namespace)


async def _shim_served(scene: Scene, cert_manager: CertManagerPlane, tailscale_nodes: TailscaleFactory,
                       tmp_path: Path) -> None:
    admin, tenant = scene.admin, scene.tenant
    standin = AgentInProcess()
    async with (running_operator(scene.kubeconfig, scene.namespace, agent_status=standin),
                served(_named("api")) as api_port, served(_named("web")) as web_port):
        cls = await _world(scene, tls_secret=False)
        hostname = unique("ic-shim")
        body = ingress("shop", tenant, cls, HOST, hostname)
        body["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] = ISSUER
        body["spec"]["rules"][0]["http"]["paths"] = [_path("/api", "Prefix", "api", {"name": "http"}),
                                                     _path("/", "Prefix", "web", {"number": 80})]
        await admin.create(INGRESS, body)
        cert = await eventually(lambda: get_or_none(admin, CERTIFICATE, "shop-tls", tenant), timeout=60,
                                what=f"the ingress-shim's Certificate (log: {cert_manager.manager.process.log_path})")
        assert cert["spec"]["dnsNames"] == [HOST] and cert["spec"]["secretName"] == "shop-tls"
        assert cert["spec"]["issuerRef"]["name"] == ISSUER and cert["spec"]["issuerRef"]["kind"] == "ClusterIssuer"
        assert [(o["kind"], o["name"]) for o in cert["metadata"]["ownerReferences"]] == [("Ingress", "shop")]
        ports = {(f"api.{tenant}.svc", 8080): api_port, (f"web.{tenant}.svc", 80): web_port}
        async with _served(scene, hostname, tailscale_nodes, ports, standin, tmp_path) as served_by:
            _, agent, laptop = served_by
            await _answers(agent, laptop, scene.ca.cert_path, (("/api/orders?id=7", "api"), ("/", "web"),
                                                               ("/apiary", "web")))
            await eventually(lambda: _served_at(admin, tenant, agent), timeout=90,
                             what="status.loadBalancer.ingress with the node's name and addresses")
        await admin.delete(INGRESS, "shop", tenant)
        await eventually(lambda: gone(admin, INGRESS, "shop", tenant), timeout=60,
                         what="the Ingress deleted past the operator's finalizer")

