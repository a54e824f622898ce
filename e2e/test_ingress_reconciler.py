"""The Ingress reconciler against kube-apiserver (with its garbage collector), Headscale, tailscaled
and cert-manager's own controllers, the operator running from source; no node (no agent pod runs).

A tailscaled node joins with the pre-auth key the operator minted and the ingress's hostname,
standing in for the agent pod: Headscale then has the ingress node the DNS reconciler points
the ingress's names at.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from e2e.cluster import OPEN_BASE
from hack.localenv import ControlPlane, Environment, Headscale
from hack.localenv._pki import CertificateAuthority
from hack.localenv.tailscale import TailscaleNode
from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.controllers.dns import parse_hosts
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_INGRESS
from tailnet_operator.headscale import installation_tag
from tailnet_operator.resources.ingress import record_name
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.kinds import (
    CERTIFICATE,
    CONFIG_MAP,
    DEPLOYMENT,
    EVENT,
    NAMESPACE,
    NETWORK_POLICY,
    SECRET,
)
from tailnet_operator.runtime.kinds import Resource as KubeResource

from .certmanager_plane import CertManagerPlane, ca_cluster_issuer, issued
from .conftest import TailscaleFactory
from .operator import (
    create_bootstrap_secret,
    get_or_none,
    has_condition,
    remove_tailnets,
    running_operator,
    tailnet_object,
    unique,
)
from .polling import eventually

pytestmark = pytest.mark.integration

ZONE = "apps.e2e.internal"
TAG = "tag:ingress-shop"


@dataclass
class Scene:
    admin: Client
    kubeconfig: Path
    headscale: Headscale
    namespace: str
    """The operator's namespace: the bootstrap Secret, the base policy and the hosts file."""
    tenant: str
    tailnet: str


async def _namespace(admin: Client, prefix: str) -> str:
    name = unique(prefix)
    await admin.create(NAMESPACE, {"metadata": {"name": name}})
    return name


async def _tailnet(admin: Client, headscale: Headscale, namespace: str, tenant: str, *, owned_policy: bool) -> str:
    """A Tailnet with a hosts file, ``tenant`` as its tenant (any ingress tag, every name in the
    zone) and (``owned_policy``) the base policy in Apply mode."""
    tailnet = f"{namespace}-tn"
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    spec: dict[str, Any] = {"dns": {"hostsConfigMap": {"namespace": namespace, "name": "hosts"}, "zones": [ZONE]},
                            "tenants": [{"namespaces": [tenant], "tags": ["tag:ingress-*"],
                                         "dnsNames": [f"*.{ZONE}"]}]}
    if owned_policy:
        await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                       "data": {"policy.hujson": OPEN_BASE}})
        spec["policy"] = {"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"},
                          "mode": "Apply"}
    await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, **spec))
    return tailnet


def ingress_object(name: str, namespace: str, tailnet: str, exposes: list[JSON], **spec: Any) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": TAG, "hostname": "shop-gw", "exposes": exposes, **spec}}


def tls_secret(name: str, namespace: str, ca: CertificateAuthority, host: str) -> JSON:
    pair = ca.issue(name, common_name=host, hosts=(host,))
    return {"metadata": {"name": name, "namespace": namespace}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                     "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}}


async def _hosts(admin: Client, namespace: str) -> dict[str, str]:
    cm = await get_or_none(admin, CONFIG_MAP, "hosts", namespace)
    return parse_hosts(((cm or {}).get("data") or {}).get("hosts", ""))


TCP = {"name": "db", "port": 5432, "backend": {"service": "postgres", "port": 5432}}
WEB = {"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 8080},
       "hosts": [{"name": f"shop.{ZONE}", "alias": "store", "tls": {"secretName": "shop-tls"}}]}


@pytest.fixture
async def scene(admin: Client, crds: ControlPlane, headscale: Headscale, operator_namespace: str
                ) -> AsyncIterator[Scene]:
    tenant = await _namespace(admin, "tenant")
    try:
        yield Scene(admin, crds.kubeconfig, headscale, operator_namespace, tenant, f"{operator_namespace}-tn")
    finally:
        for obj in (await admin.list(TAILNET_INGRESS, tenant)).items:
            await admin.merge_patch(TAILNET_INGRESS, obj["metadata"]["name"], {"metadata": {"finalizers": None}},
                                    tenant)
        await admin.delete(NAMESPACE, tenant)


async def test_an_ingress_gets_its_agent_objects_dns_names_and_on_deletion_loses_them_and_its_key(
    scene: Scene, tmp_path: Path, tailscale_nodes: TailscaleFactory,
) -> None:
    admin, tenant = scene.admin, scene.tenant
    ca = CertificateAuthority(tmp_path / "ca", "shop")
    await admin.create(SECRET, tls_secret("shop-tls", tenant, ca, f"shop.{ZONE}"))
    async with running_operator(scene.kubeconfig, scene.namespace):
        tailnet = await _tailnet(admin, scene.headscale, scene.namespace, scene.tenant, owned_policy=True)
        await admin.create(TAILNET_INGRESS, ingress_object("shop", tenant, tailnet, [TCP, WEB],
                                                           dnsTemplate="{hostname}." + ZONE))

        deployment = await eventually(lambda: get_or_none(admin, DEPLOYMENT, "shop-ingress-agent", tenant), timeout=60,
                                      what="the agent Deployment")
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["AGENT_MODE"] == "ingress" and env["TAILNET_HOSTNAME"] == "shop-gw"
        certs = next(v for v in pod["volumes"] if v["name"] == "certs")
        assert [s["secret"]["name"] for s in certs["projected"]["sources"]] == ["shop-tls"]
        config = await admin.get(CONFIG_MAP, "shop-ingress-config", tenant)
        db, web = parse_exposes(config["data"]["exposes.json"])
        assert (db.backend.host, db.port) == (f"postgres.{tenant}.svc", 5432)
        assert set(web.hosts[0].names) == {f"shop.{ZONE}", "store", f"store.{ZONE}"}
        assert web.hosts[0].cert_file.endswith("/tls/shop-tls/tls.crt")
        policy = await eventually(lambda: get_or_none(admin, NETWORK_POLICY, "shop-ingress-agent", tenant), timeout=30,
                                  what="the agent's NetworkPolicy")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        obj = await admin.get(TAILNET_INGRESS, "shop", tenant)
        assert "tailnet.dev/finalizer" in obj["metadata"]["finalizers"]
        await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "CertificatesReady", "True", "Present",
                                       namespace=tenant), what="the TLS Secret found")
        key_secret = await admin.get(SECRET, "shop-ingress-auth-key", tenant)
        key = base64.b64decode(key_secret["data"]["authKey"]).decode()
        record = await admin.get(SECRET, record_name(tenant, "shop"), scene.namespace)  # the operator's bookkeeping
        key_id = record["metadata"]["annotations"]["tailnet.dev/key-id"]
        [hs_key] = [k for k in scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if k["id"] == key_id]
        marker = installation_tag((await admin.get(TAILNET, tailnet))["metadata"]["uid"])
        assert hs_key["aclTags"] == [TAG, marker] and hs_key["reusable"] and hs_key["ephemeral"]

        node = tailscale_nodes("shop-gw", scene.headscale, authkey=key)  # as the agent pod would join
        address = node.ipv4()
        wanted = {f"shop-gw.{ZONE}": address, f"shop.{ZONE}": address, f"store.{ZONE}": address}
        await eventually(lambda: _hosts_match(admin, scene.namespace, wanted), timeout=90,
                         what="the ingress names in the hosts file")
        # the record (which DNS reads) is written just before the status: wait for the status too
        status = await eventually(lambda: _status_with_node(admin, tenant, address), timeout=30,
                                  what="status.node from Headscale")
        assert status["dnsNames"] == [f"shop-gw.{ZONE}", f"shop.{ZONE}", f"store.{ZONE}"]
        assert [e["name"] for e in status["exposes"]] == ["db", "web"]
        assert status["exposes"][1]["hosts"][0]["alias"] == "store"

        await admin.delete(TAILNET_INGRESS, "shop", tenant)
        await eventually(lambda: _gone(admin, TAILNET_INGRESS, "shop", tenant), timeout=60, what="the finalizer")
        expired = [k for k in scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]
                   if k["id"] == hs_key["id"]]
        assert expired and _is_expired(expired[0]), expired
        await eventually(lambda: _gone(admin, DEPLOYMENT, "shop-ingress-agent", tenant), timeout=60,
                         what="garbage collection of the Deployment")
        await eventually(lambda: _hosts_without(admin, scene.namespace, wanted), timeout=60,
                         what="the names leaving the hosts file")


async def _status_with_node(admin: Client, namespace: str, address: str) -> JSON | None:
    status: JSON = (await admin.get(TAILNET_INGRESS, "shop", namespace)).get("status") or {}
    return status if address in (status.get("node") or {}).get("addresses", []) else None


async def _hosts_match(admin: Client, namespace: str, wanted: dict[str, str]) -> bool:
    hosts = await _hosts(admin, namespace)
    return all(hosts.get(name) == address for name, address in wanted.items())


async def _hosts_without(admin: Client, namespace: str, names: dict[str, str]) -> bool:
    return not set(names) & set(await _hosts(admin, namespace))


async def _gone(admin: Client, resource: KubeResource, name: str, namespace: str) -> bool:
    return await get_or_none(admin, resource, name, namespace) is None


def _is_expired(key: JSON) -> bool:
    from datetime import UTC, datetime

    expiration = datetime.fromisoformat(str(key["expiration"]).replace("Z", "+00:00"))
    return expiration <= datetime.now(UTC)


async def test_a_tag_the_live_policy_does_not_own_creates_nothing(scene: Scene) -> None:
    admin = scene.admin
    scene.headscale.api("PUT", "/api/v1/policy", {"policy": OPEN_BASE})
    before = len(scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"])
    async with running_operator(scene.kubeconfig, scene.namespace):
        tailnet = await _tailnet(admin, scene.headscale, scene.namespace, scene.tenant, owned_policy=False)
        await admin.create(TAILNET_INGRESS, ingress_object("shop", scene.tenant, tailnet, [TCP]))
        cond = await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "Ready", "False", "TagNotOwned",
                                              namespace=scene.tenant), timeout=60, what="TagNotOwned")
        assert f'"{TAG}"' in cond["message"] and "tagOwners" in cond["message"]
        assert await get_or_none(admin, DEPLOYMENT, "shop-ingress-agent", scene.tenant) is None
        assert len(scene.headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]) == before


CM_HOST = {"name": f"portal.{ZONE}", "alias": "admin",
           "tls": {"certManager": {"issuerRef": {"name": "e2e-ca", "kind": "ClusterIssuer"}}}}


async def test_without_cert_manager_a_host_asking_for_it_gets_a_condition_saying_so(scene: Scene) -> None:
    admin = scene.admin
    async with running_operator(scene.kubeconfig, scene.namespace):
        tailnet = await _tailnet(admin, scene.headscale, scene.namespace, scene.tenant, owned_policy=True)
        await admin.create(TAILNET_INGRESS, ingress_object("shop", scene.tenant, tailnet,
                                                           [TCP, {**WEB, "hosts": [CM_HOST]}]))
        cond = await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "CertificatesReady", "False",
                                              "CertManagerNotInstalled", namespace=scene.tenant),
                                timeout=60, what="CertManagerNotInstalled")
        assert "install cert-manager" in cond["message"] and f"portal.{ZONE}" in cond["message"]
        assert (await admin.get(TAILNET_INGRESS, "shop", scene.tenant))["status"]["conditions"][0]["reason"] == \
            "CertManagerNotInstalled"
        assert await get_or_none(admin, DEPLOYMENT, "shop-ingress-agent", scene.tenant) is not None


# -- with cert-manager -------------------------------------------------------------------------------


async def test_cert_manager_issues_the_hosts_certificate_from_a_ca_cluster_issuer(
    cert_manager_plane: CertManagerPlane, headscale: Headscale, tmp_path: Path,
) -> None:
    plane = cert_manager_plane.plane
    async with Client(rest_config.load(plane.kubeconfig), field_manager="test-admin") as admin:
        namespace, tenant = await _namespace(admin, "op"), await _namespace(admin, "tenant")
        ca = await ca_cluster_issuer(admin, tmp_path / "ca")
        try:
            async with running_operator(plane.kubeconfig, namespace):
                tailnet = await _tailnet(admin, headscale, namespace, tenant, owned_policy=True)
                await admin.create(TAILNET_INGRESS, ingress_object("shop", tenant, tailnet,
                                                                   [{**WEB, "hosts": [CM_HOST]}]))
                secret_name = f"shop-portal.{ZONE}-tls"
                cert = await eventually(lambda: get_or_none(admin, CERTIFICATE, f"shop-portal.{ZONE}", tenant),
                                        timeout=60, what="the Certificate")
                assert cert["spec"]["dnsNames"] == [f"portal.{ZONE}", f"admin.{ZONE}"]
                assert cert["spec"]["issuerRef"] == {"name": "e2e-ca", "kind": "ClusterIssuer",
                                                     "group": "cert-manager.io"}
                secret = await eventually(lambda: issued(admin, secret_name, tenant), timeout=120,
                                          what=f"cert-manager to issue {secret_name} "
                                               f"(log: {cert_manager_plane.manager.process.log_path})")
                leaf = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
                assert leaf.issuer == x509.load_pem_x509_certificate(ca.pem).subject
                sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                assert sorted(sans.get_values_for_type(x509.DNSName)) == [f"admin.{ZONE}", f"portal.{ZONE}"]
                await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "CertificatesReady", "True", "Present",
                                               namespace=tenant), timeout=60, what="CertificatesReady")
                deployment = await admin.get(DEPLOYMENT, "shop-ingress-agent", tenant)
                certs = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "certs")
                assert [s["secret"]["name"] for s in certs["projected"]["sources"]] == [secret_name]
                config = await admin.get(CONFIG_MAP, "shop-ingress-config", tenant)
                [web] = parse_exposes(config["data"]["exposes.json"])
                assert web.hosts[0].cert_file.endswith(f"/tls/{secret_name}/tls.crt")
        finally:
            for obj in (await admin.list(TAILNET_INGRESS, tenant)).items:
                await admin.merge_patch(TAILNET_INGRESS, obj["metadata"]["name"],
                                        {"metadata": {"finalizers": None}}, tenant)
            await remove_tailnets(admin, namespace)
            await admin.delete(NAMESPACE, tenant)
            await admin.delete(NAMESPACE, namespace)


def _joined(hostname: str, workdir: Path, headscale: Headscale, environment: Environment, key: str) -> TailscaleNode:
    """A tailscaled joined with ``key`` under ``hostname``, in its own state directory: two of
    them may carry one hostname, as an agent pod and its replacement do."""
    environment.guard_tailnet()
    node = TailscaleNode(hostname, workdir, headscale=headscale, log_dir=environment.log_dir,
                         run_id=environment.run_id)
    try:
        node.start()
        node.up(key)
    except BaseException:
        node.stop()
        raise
    return node


async def _shop_with_its_key(scene: Scene) -> str:
    """The ingress ``shop`` (a tcp expose) on a Tailnet whose policy owns its tag; the pre-auth key
    the operator minted for it."""
    admin, tenant = scene.admin, scene.tenant
    tailnet = await _tailnet(admin, scene.headscale, scene.namespace, tenant, owned_policy=True)
    await admin.create(TAILNET_INGRESS, ingress_object("shop", tenant, tailnet, [TCP]))
    secret = await eventually(lambda: get_or_none(admin, SECRET, "shop-ingress-auth-key", tenant), timeout=60,
                              what="the ingress's pre-auth key")
    return base64.b64decode(secret["data"]["authKey"]).decode()


def _node_at(headscale: Headscale, address: str) -> JSON | None:
    return next((n for n in headscale.api("GET", "/api/v1/node")["nodes"] if address in n["ipAddresses"]), None)


async def test_a_restarted_agents_node_is_renamed_to_the_hostname_once_its_crashed_predecessor_is_deleted(
    scene: Scene, tmp_path: Path, environment: Environment,
) -> None:
    """Issue 24: the first node (the agent pod that crashes) holds the hostname; its replacement
    registers with the same reusable key and gets a suffixed name. Once the first is offline, the
    operator deletes it and renames the second to the plain hostname, with Events."""
    admin, tenant = scene.admin, scene.tenant
    nodes: list[TailscaleNode] = []
    try:
        async with running_operator(scene.kubeconfig, scene.namespace):
            key = await _shop_with_its_key(scene)

            nodes.append(_joined("shop-gw", tmp_path / "first", scene.headscale, environment, key))
            first = _node_at(scene.headscale, nodes[0].ipv4())
            assert first is not None and first["givenName"] == "shop-gw"
            await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "HostnameAssigned", "True", "Assigned",
                                           namespace=tenant), timeout=90, what="the first node with the hostname")

            nodes.append(_joined("shop-gw", tmp_path / "second", scene.headscale, environment, key))
            second = _node_at(scene.headscale, nodes[1].ipv4())
            assert second is not None and second["givenName"] != "shop-gw", "Headscale gave it a suffixed name"
            await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "HostnameAssigned", "False",
                                           "HostnameTaken", namespace=tenant), timeout=90,
                             what="the second (newest) node reported with its suffixed name")
            assert _node_at(scene.headscale, nodes[0].ipv4()) is not None, "an online predecessor is left alone"

            nodes[0].process.kill()  # the old agent pod crashes: its node stays, offline
            renamed = await eventually(lambda: _renamed(scene.headscale, second["id"], first["id"]), timeout=120,
                                       what="the first node deleted and the second renamed to shop-gw")
            assert renamed["givenName"] == "shop-gw"
            await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "HostnameAssigned", "True", "Assigned",
                                           namespace=tenant), timeout=90, what="HostnameAssigned on the second node")
            status = (await admin.get(TAILNET_INGRESS, "shop", tenant))["status"]
            assert status["node"]["id"] == second["id"] and status["node"]["name"] == "shop-gw"
            reasons = await eventually(lambda: _event_reasons(admin, tenant, {"SupersededNodeDeleted", "NodeRenamed"}),
                                       timeout=30, what="the Events of the deletion and the rename")
            assert reasons >= {"SupersededNodeDeleted", "NodeRenamed"}
            # the node itself is told its new MagicDNS name
            await eventually(lambda: _self_named(nodes[1], "shop-gw"), timeout=60,
                             what="the second node's own netmap with the name shop-gw")
    finally:
        for node in nodes:
            node.stop()


def _renamed(headscale: Headscale, node_id: str, gone_id: str) -> JSON | None:
    listed = {n["id"]: n for n in headscale.api("GET", "/api/v1/node")["nodes"]}
    node = listed.get(node_id)
    return node if gone_id not in listed and node is not None and node["givenName"] == "shop-gw" else None


async def _event_reasons(admin: Client, namespace: str, wanted: set[str]) -> set[str] | None:
    reasons = {e["reason"] for e in (await admin.list(EVENT, namespace)).items
               if e.get("regarding", {}).get("name") == "shop"}
    return reasons if wanted <= reasons else None


def _self_named(node: TailscaleNode, name: str) -> bool:
    dns_name = str(node.status()["Self"].get("DNSName") or "")
    return dns_name.split(".", 1)[0] == name


async def test_a_rollouts_old_node_hands_the_hostname_over_once_the_new_pod_is_ready_and_keeps_serving(
    scene: Scene, tmp_path: Path, environment: Environment,
) -> None:
    """Issue 24: during a rollout the old agent's node holds the hostname and is online (its pod
    drains). Until the Deployment says the rollout is done the name stays; then the old node takes
    ``shop-gw-old<id>`` and the new one ``shop-gw``, both online (the old one still serves who
    resolved the name before). No kubelet runs here: the Deployment's status is written as its
    controller would once the new pod is ready and the old one terminating."""
    admin, tenant = scene.admin, scene.tenant
    nodes: list[TailscaleNode] = []
    try:
        async with running_operator(scene.kubeconfig, scene.namespace):
            key = await _shop_with_its_key(scene)
            nodes.append(_joined("shop-gw", tmp_path / "old", scene.headscale, environment, key))
            old = _node_at(scene.headscale, nodes[0].ipv4())
            assert old is not None and old["givenName"] == "shop-gw"
            nodes.append(_joined("shop-gw", tmp_path / "new", scene.headscale, environment, key))
            new = _node_at(scene.headscale, nodes[1].ipv4())
            assert new is not None and new["givenName"] != "shop-gw"
            await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "HostnameAssigned", "False",
                                           "HostnameTaken", namespace=tenant), timeout=90,
                             what="the new node reported with its suffixed name")
            held = _node_at(scene.headscale, nodes[0].ipv4())
            assert held is not None and held["givenName"] == "shop-gw", "the name stays while the rollout runs"

            deployment = await admin.get(DEPLOYMENT, "shop-ingress-agent", tenant)
            await admin.apply_status(DEPLOYMENT, {
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "shop-ingress-agent", "namespace": tenant},
                "status": {"observedGeneration": deployment["metadata"]["generation"], "replicas": 1,
                           "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
                field_manager="deployment-controller")

            retired = f"shop-gw-old{old['id']}"
            await eventually(lambda: _named({old["id"]: retired, new["id"]: "shop-gw"}, scene.headscale), timeout=120,
                             what=f"the old node renamed {retired} and the new one shop-gw")
            listed = {n["id"]: n for n in scene.headscale.api("GET", "/api/v1/node")["nodes"]}
            assert listed[old["id"]]["online"], "the old node is not deleted: it drains under its new name"
            await eventually(has_condition(admin, TAILNET_INGRESS, "shop", "HostnameAssigned", "True", "Assigned",
                                           namespace=tenant), timeout=90, what="HostnameAssigned on the new node")
            status = (await admin.get(TAILNET_INGRESS, "shop", tenant))["status"]
            assert status["node"]["id"] == new["id"] and status["node"]["name"] == "shop-gw"
            await eventually(lambda: _self_named(nodes[0], retired), timeout=60,
                             what=f"the old node's own netmap with the name {retired}")
            await eventually(lambda: _self_named(nodes[1], "shop-gw"), timeout=60,
                             what="the new node's own netmap with the name shop-gw")
    finally:
        for node in nodes:
            node.stop()


def _named(wanted: dict[str, str], headscale: Headscale) -> bool:
    listed = {n["id"]: n["givenName"] for n in headscale.api("GET", "/api/v1/node")["nodes"]}
    return all(listed.get(node_id) == name for node_id, name in wanted.items())


async def test_a_hosts_file_another_tailnet_held_is_taken_over_when_that_tailnet_goes(scene: Scene) -> None:
    """The second Tailnet naming a hosts ConfigMap is refused while the first holds it, and takes it
    over as soon as the first is deleted: the first's deletion (and the garbage collector removing
    its file) reaches the second, which does not wait for its retry period."""
    admin, namespace = scene.admin, scene.namespace
    dns = {"hostsConfigMap": {"namespace": namespace, "name": "hosts"}, "zones": [ZONE]}
    await create_bootstrap_secret(admin, namespace, "bootstrap", scene.headscale.api_key)
    async with running_operator(scene.kubeconfig, namespace):
        first = await admin.create(TAILNET, tailnet_object(unique("first"), scene.headscale, namespace, dns=dns))
        await eventually(lambda: _hosts_owner(admin, namespace, first), timeout=60,
                         what="the hosts file owned by the first Tailnet")
        second = await admin.create(TAILNET, tailnet_object(unique("second"), scene.headscale, namespace, dns=dns))
        await eventually(lambda: _refused(admin, second), timeout=60, what="the second Tailnet refused the file")

        await admin.delete(TAILNET, first["metadata"]["name"])
        await eventually(lambda: _absent(admin, TAILNET, first["metadata"]["name"]), timeout=60,
                         what="the first Tailnet deleted")
        await eventually(lambda: _hosts_owner(admin, namespace, second), timeout=60,
                         what="the hosts file taken over by the second Tailnet, well before its retry")


async def _absent(admin: Client, resource: KubeResource, name: str) -> bool:
    return await get_or_none(admin, resource, name) is None


async def _hosts_owner(admin: Client, namespace: str, tailnet: JSON) -> bool:
    cm = await get_or_none(admin, CONFIG_MAP, "hosts", namespace)
    owners = ((cm or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == tailnet["metadata"]["uid"] and o.get("controller") for o in owners)


async def _refused(admin: Client, tailnet: JSON) -> bool:
    uid = tailnet["metadata"]["uid"]
    return any(e["reason"] == "HostsConfigMapRefused" and e.get("regarding", {}).get("uid") == uid
               for e in (await admin.list(EVENT, "default")).items)
