"""A tenant as an attacker: the admin of its own namespace only, with a real ServiceAccount token
against kube-apiserver (RBAC), the operator running from source and a real Headscale.

The platform owns the Tailnet, an egress and the hosts file; the tenant namespace ``shop`` may use
``tag:shop-*`` and names under ``*.shop.<zone>`` (spec.tenants). Each attack must fail with an
admission error or a condition that says why, and nothing may reach Headscale (no key for the
tag), the hosts file or the policy. Two tiers: with the shipped ValidatingAdmissionPolicy, and
without it (the operator alone must hold the line).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.localenv import ControlPlane, Headscale
from hack.localenv.headscale import HeadscaleError
from tailnet_operator.controllers.dns import parse_hosts
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS, TAILNET_INGRESS
from tailnet_operator.policy.hujson import parse_hujson
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import APIError, Forbidden, NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, NAMESPACE, SECRET, Resource

from .operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

INSTALL = Path(__file__).resolve().parent.parent / "manifests" / "install"
VAP = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies",
               "ValidatingAdmissionPolicy", namespaced=False)
VAP_BINDING = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
                       "ValidatingAdmissionPolicyBinding", namespaced=False)
CLUSTER_ROLE = Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False)
ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
SERVICE_ACCOUNT = Resource("", "v1", "serviceaccounts", "ServiceAccount")
SELF_REVIEW = Resource("authorization.k8s.io", "v1", "selfsubjectaccessreviews", "SelfSubjectAccessReview",
                       namespaced=False)

ZONE = "apps.e2e.internal"
EGRESS_TAG = "tag:shop-egress"
SHARED_RANGE = "198.18.5.0/28"
"""The range the Tailnet lets the tenant take shared addresses from."""
"""The platform's egress tag, under the tenant's prefix on purpose: a prefix must not hand it over."""
GRANT_SOURCE = "tag:shop-ci"
"""A grant source of the base policy, also under the prefix."""
BASE = ('{"tagOwners": {"tag:shop-ci": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]},'
        ' {"src": ["tag:shop-ci"], "dst": ["tag:shop-egress"], "ip": ["*"]}]}\n')
TCP = {"name": "db", "port": 5432, "backend": {"service": "postgres", "port": 5432}}


@dataclass
class Scene:
    admin: Client
    tenant: Client
    """The namespace admin of ``shop`` (and nothing else)."""
    shop: str
    intruder: str
    """A namespace whose admin the tenant also is, which the Tailnet does not name."""
    operator_namespace: str
    tailnet: str
    headscale: Headscale


async def _namespace_admin_token(admin: Client, plane: ControlPlane, namespaces: list[str], path: Path) -> Path:
    """A kubeconfig for a ServiceAccount that is the admin of ``namespaces`` only."""
    home = namespaces[0]
    await admin.create(SERVICE_ACCOUNT, {"metadata": {"name": "tenant-admin", "namespace": home}}, home)
    # What a namespace's `admin` holds for the objects an attack uses (this control plane runs no
    # aggregation controller, so the built-in `admin` is empty here): everything on Secrets,
    # ConfigMaps, Services, Deployments and RoleBindings, and the chart's roles that aggregate into
    # `admin` (TailnetIngresses, but not their status).
    await admin.apply(CLUSTER_ROLE, {"metadata": {"name": "tenant-namespace-admin"}, "rules": [
        {"apiGroups": [""], "resources": ["secrets", "configmaps", "services", "pods"], "verbs": ["*"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"], "verbs": ["*"]}]})
    for namespace in namespaces:
        for role in ("tenant-namespace-admin", "tailnet-operator-view", "tailnet-operator-edit"):
            await admin.create(ROLE_BINDING, {
                "metadata": {"name": role, "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": "tenant-admin", "namespace": home}]}, namespace)
    review = plane.request("POST", f"/api/v1/namespaces/{home}/serviceaccounts/tenant-admin/token",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                            "spec": {"expirationSeconds": 3600}})
    return _token_kubeconfig(plane.kubeconfig, review["status"]["token"], path)


def _token_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """The admin kubeconfig's cluster, with a user that is ``token``."""
    config = yaml.safe_load(admin_kubeconfig.read_text())
    config["users"] = [{"name": "tenant", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "tenant"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


async def _may_create_ingresses(client: Client, namespace: str) -> bool:
    review = await client.create(SELF_REVIEW, {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"group": "tailnet.dev", "resource": "tailnetingresses", "verb": "create",
                                        "namespace": namespace}}})
    return bool(review.get("status", {}).get("allowed"))


def _shipped(kind: str, name: str) -> JSON:
    """One object of manifests/install by kind and name."""
    for path in INSTALL.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == kind and doc["metadata"]["name"] == name:
                return dict(doc)
    raise LookupError(f"{kind} {name} is not in {INSTALL}")


async def _create_tailnet(scene_admin: Client, headscale: Headscale, namespace: str, shop: str) -> str:
    tailnet = f"{namespace}-tn"
    await create_bootstrap_secret(scene_admin, namespace, "bootstrap", headscale.api_key)
    await scene_admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                         "data": {"policy.hujson": BASE}})
    spec: dict[str, Any] = {
        "dns": {"hostsConfigMap": {"namespace": namespace, "name": "hosts"}, "zones": [ZONE]},
        "policy": {"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"},
                   "mode": "Apply"},
        "tenants": [{"namespaces": [shop], "tags": ["tag:shop-*"], "dnsNames": [f"*.shop.{ZONE}"],
                     "sharedAddresses": [SHARED_RANGE]}],
    }
    await scene_admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, **spec))
    await scene_admin.create(TAILNET_EGRESS, {
        "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
        "metadata": {"name": "db", "namespace": namespace},
        "spec": {"tailnetRef": {"name": tailnet}, "tag": EGRESS_TAG, "consumerNamespaces": [shop],
                 "targets": [{"name": "db", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}}, namespace)
    return tailnet


@pytest.fixture
async def scene(admin: Client, crds: ControlPlane, headscale: Headscale, operator_namespace: str,
                tmp_path: Path) -> AsyncIterator[Scene]:
    shop, intruder = unique("shop"), unique("intruder")
    for namespace in (shop, intruder):
        await admin.create(NAMESPACE, {"metadata": {"name": namespace}})
    # The chart's aggregated roles: `admin` of a namespace may create TailnetIngresses there.
    for name in ("tailnet-operator-view", "tailnet-operator-edit"):
        await admin.apply(CLUSTER_ROLE, _shipped("ClusterRole", name))
    kubeconfig = await _namespace_admin_token(admin, crds, [shop, intruder], tmp_path / "tenant.kubeconfig")
    try:
        async with (Client(rest_config.load(kubeconfig), field_manager="tenant") as tenant,
                    running_operator(crds.kubeconfig, operator_namespace)):
            for namespace in (shop, intruder):
                await eventually(functools.partial(_may_create_ingresses, tenant, namespace), timeout=30,
                                 what=f"the tenant's RoleBindings in {namespace} in force")
            tailnet = await _create_tailnet(admin, headscale, operator_namespace, shop)
            await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60,
                             what="the Tailnet Ready")
            yield Scene(admin, tenant, shop, intruder, operator_namespace, tailnet, headscale)
    finally:
        for namespace in (shop, intruder):
            for obj in (await admin.list(TAILNET_INGRESS, namespace)).items:
                await admin.merge_patch(TAILNET_INGRESS, obj["metadata"]["name"],
                                        {"metadata": {"finalizers": None}}, namespace)
            await admin.delete(NAMESPACE, namespace)
        with contextlib.suppress(NotFound):
            await admin.merge_patch(TAILNET_EGRESS, "db", {"metadata": {"finalizers": None}}, operator_namespace)


@pytest.fixture
async def admission(admin: Client, scene: Scene) -> AsyncIterator[None]:
    """The shipped tenancy ValidatingAdmissionPolicy, in force."""
    policy = _shipped("ValidatingAdmissionPolicy", "tailnet-ingress-tenancy")
    binding = _shipped("ValidatingAdmissionPolicyBinding", "tailnet-ingress-tenancy")
    name = unique("tenancy")
    policy["metadata"] = {"name": name}
    binding["metadata"] = {"name": name}
    binding["spec"]["policyName"] = name
    await admin.apply(VAP, policy)
    await admin.apply(VAP_BINDING, binding)
    probe = ingress("probe", scene.intruder, scene.tailnet, "tag:shop-probe")
    try:
        await eventually(lambda: _refusal(admin, probe), timeout=30, what="the policy in force")
        yield
    finally:
        await admin.delete(VAP_BINDING, name)
        await admin.delete(VAP, name)
        await eventually(lambda: _accepted(admin, probe), timeout=30, what="the policy gone")


def ingress(name: str, namespace: str, tailnet: str, tag: str, **spec: Any) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": tag, "hostname": name, "exposes": [TCP], **spec}}


async def _refusal(client: Client, body: JSON) -> str | None:
    """The API's refusal of creating ``body`` (None when admitted): a dry run, so nothing is stored
    and the operator never sees it."""
    meta = body["metadata"]
    try:
        await client.request("POST", TAILNET_INGRESS.path(meta["namespace"]), body=body, params={"dryRun": "All"})
    except APIError as exc:
        return exc.message
    return None


async def _accepted(client: Client, body: JSON) -> bool:
    return await _refusal(client, body) is None


def _keys_for(headscale: Headscale, tag: str) -> list[JSON]:
    return [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if tag in (k.get("aclTags") or [])]


def _live_policy_with(headscale: Headscale, tag: str) -> str:
    """The live policy once it names ``tag`` ("" before; Headscale has none until the first apply)."""
    try:
        text = str(headscale.api("GET", "/api/v1/policy").get("policy") or "")
    except HeadscaleError:
        return ""
    return text if tag in text else ""


async def _hosts(admin: Client, namespace: str) -> dict[str, str]:
    try:
        cm = await admin.get(CONFIG_MAP, "hosts", namespace)
    except NotFound:
        return {}
    return parse_hosts((cm.get("data") or {}).get("hosts", ""))


async def _refused_by_the_operator(scene: Scene, body: JSON, reason: str) -> JSON:
    """Create ``body`` as the tenant and wait for the operator's refusal; nothing may have been made."""
    meta = body["metadata"]
    await scene.tenant.create(TAILNET_INGRESS, body, meta["namespace"])
    cond: JSON = await eventually(
        has_condition(scene.admin, TAILNET_INGRESS, meta["name"], "Ready", "False", reason,
                      namespace=meta["namespace"]), timeout=60, what=f"Ready=False {reason}")
    assert "nothing was created on the tailnet" in cond["message"], cond
    assert not _keys_for(scene.headscale, body["spec"]["tag"]) or body["spec"]["tag"] == EGRESS_TAG
    with pytest.raises(NotFound):
        await scene.admin.get(SECRET, f"{meta['name']}-ingress-auth-key", meta["namespace"])
    return cond


# -- with the shipped admission policy ------------------------------------------------------------


@pytest.mark.usefixtures("admission")
async def test_admission_refuses_a_namespace_the_tailnet_does_not_name(scene: Scene) -> None:
    message = await _refusal(scene.tenant, ingress("web", scene.intruder, scene.tailnet, "tag:shop-web"))
    assert message is not None and f"namespace {scene.intruder} is not a tenant of the Tailnet" in message


@pytest.mark.usefixtures("admission")
async def test_admission_refuses_a_tag_outside_the_tenants_patterns(scene: Scene) -> None:
    message = await _refusal(scene.tenant, ingress("web", scene.shop, scene.tailnet, "tag:gateway"))
    assert message is not None and "may not use the tag tag:gateway" in message


@pytest.mark.usefixtures("admission")
@pytest.mark.parametrize("template", ["kubernetes.default.svc.cluster.local", "web.other." + ZONE])
async def test_admission_refuses_a_name_outside_the_tenants_names(scene: Scene, template: str) -> None:
    message = await _refusal(scene.tenant, ingress("web", scene.shop, scene.tailnet, "tag:shop-web",
                                                   dnsTemplate=template))
    assert message is not None and f"the dnsTemplate name {template}" in message


@pytest.mark.usefixtures("admission")
async def test_admission_refuses_a_shared_address_outside_the_tenants_ranges(scene: Scene) -> None:
    outside = ingress("ha", scene.shop, scene.tailnet, "tag:shop-ha", replicas=2, sharedAddress="198.18.9.10")
    message = await _refusal(scene.tenant, outside)
    assert message is not None and "may not use the sharedAddress 198.18.9.10" in message
    assert await _refusal(scene.tenant, ingress("ha", scene.shop, scene.tailnet, "tag:shop-ha", replicas=2,
                                                sharedAddress="198.18.5.10")) is None


@pytest.mark.usefixtures("admission")
async def test_admission_lets_the_tenant_use_what_it_was_given(scene: Scene) -> None:
    assert await _refusal(scene.tenant, ingress("web", scene.shop, scene.tailnet, "tag:shop-web",
                                                dnsTemplate=f"web.shop.{ZONE}")) is None


def _tls_expose(*hosts: JSON) -> JSON:
    """A TLS passthrough expose: its hosts claim DNS names as an http expose's do."""
    return {"name": "pg", "mode": "tls", "port": 443, "backend": {"service": "postgres", "port": 5432},
            "hosts": list(hosts)}


@pytest.mark.usefixtures("admission")
async def test_admission_judges_a_tls_expose_s_hosts_as_an_http_expose_s(scene: Scene) -> None:
    """A tenant gets no more names with a passthrough expose than with an http one: its host names
    and aliases are judged against the tenancy's dnsNames; a wildcard host claims no name."""
    for host in ({"name": f"pg.other.{ZONE}"}, {"name": f"pg.shop.{ZONE}", "alias": "pg"}):
        message = await _refusal(scene.tenant, ingress("pg", scene.shop, scene.tailnet, "tag:shop-pg",
                                                       exposes=[_tls_expose(host)]))
        assert message is not None and "a host name or alias of pg is outside" in message, (host, message)
    assert await _refusal(scene.tenant, ingress("pg", scene.shop, scene.tailnet, "tag:shop-pg", exposes=[
        _tls_expose({"name": f"pg.shop.{ZONE}"}, {"name": f"*.pg.shop.{ZONE}"}, {"name": "*"})])) is None


@pytest.mark.usefixtures("admission")
async def test_a_withdrawn_tenant_s_ingress_can_still_be_finalized_but_not_changed(scene: Scene) -> None:
    """The policy judges what a tenant writes into the spec. Once the cluster admin withdraws the
    namespace, a write that leaves the spec alone (the operator's finalizer, a label) is still
    admitted, so the operator can revoke the ingress and let it go; a change of the spec is not."""
    body = ingress("web", scene.shop, scene.tailnet, "tag:shop-web", dnsTemplate=f"web.shop.{ZONE}")
    await scene.tenant.create(TAILNET_INGRESS, body, scene.shop)
    await eventually(lambda: _has_finalizer(scene.admin, scene.shop, "web"), timeout=60,
                     what="the operator's finalizer on the ingress")

    await scene.admin.merge_patch(TAILNET, scene.tailnet, {"spec": {"tenants": [
        {"namespaces": [scene.intruder], "tags": ["tag:other-*"]}]}})
    probe = ingress("probe", scene.shop, scene.tailnet, "tag:shop-probe")
    await eventually(lambda: _refusal(scene.admin, probe), timeout=30, what="the withdrawal in force")

    await scene.tenant.merge_patch(TAILNET_INGRESS, "web", {"metadata": {"labels": {"team": "shop"}}}, scene.shop)
    with pytest.raises(APIError, match=f"namespace {scene.shop} is not a tenant"):
        await scene.tenant.merge_patch(TAILNET_INGRESS, "web", {"spec": {"hostname": "web2"}}, scene.shop)

    await scene.tenant.delete(TAILNET_INGRESS, "web", scene.shop)
    await eventually(lambda: _gone(scene.admin, TAILNET_INGRESS, "web", scene.shop), timeout=60,
                     what="the ingress deleted (the operator removed its finalizer)")


async def _has_finalizer(client: Client, namespace: str, name: str) -> bool:
    obj = await client.get(TAILNET_INGRESS, name, namespace)
    return bool(obj["metadata"].get("finalizers"))


# -- the operator alone -----------------------------------------------------------------------------


async def test_the_egress_tag_is_not_the_tenants_even_under_its_prefix(scene: Scene) -> None:
    keys_before = {k["id"] for k in _keys_for(scene.headscale, EGRESS_TAG)}
    await _refused_by_the_operator(scene, ingress("steal", scene.shop, scene.tailnet, EGRESS_TAG), "TagReserved")
    assert {k["id"] for k in _keys_for(scene.headscale, EGRESS_TAG)} == keys_before, "a key was minted"


async def test_a_grant_source_of_the_policy_is_not_the_tenants_under_its_prefix(scene: Scene) -> None:
    await _refused_by_the_operator(scene, ingress("ci", scene.shop, scene.tailnet, GRANT_SOURCE), "TagReserved")


async def test_a_namespace_the_tailnet_does_not_name_gets_nothing(scene: Scene) -> None:
    await _refused_by_the_operator(scene, ingress("web", scene.intruder, scene.tailnet, "tag:shop-intruder"),
                                   "NamespaceNotTenant")
    # An allowed ingress after it: once the live policy owns its tag, the render has seen both.
    await scene.tenant.create(TAILNET_INGRESS, ingress("ok", scene.shop, scene.tailnet, "tag:shop-ok"), scene.shop)
    live = await eventually(lambda: _live_policy_with(scene.headscale, "tag:shop-ok"), timeout=60,
                            what="the allowed ingress's tag in the live policy")
    assert "tag:shop-intruder" not in live, "the refused tag reached the policy"


@pytest.mark.parametrize("template", ["kubernetes.default.svc.cluster.local", "headscale.tailnet-system.svc"])
async def test_a_cluster_name_never_reaches_the_hosts_file(scene: Scene, template: str) -> None:
    await _refused_by_the_operator(scene, ingress("dns", scene.shop, scene.tailnet, "tag:shop-web",
                                                  dnsTemplate=template), "DNSNameOutsideZones")
    assert template not in await _hosts(scene.admin, scene.operator_namespace)


async def test_a_tls_host_outside_the_tenants_names_is_refused_by_the_operator(scene: Scene) -> None:
    name = f"pg.other.{ZONE}"
    await _refused_by_the_operator(scene, ingress("pg", scene.shop, scene.tailnet, "tag:shop-pg",
                                                  exposes=[_tls_expose({"name": name})]), "DNSNameNotAllowed")
    assert name not in await _hosts(scene.admin, scene.operator_namespace)


async def test_a_shared_address_is_approved_for_its_holder_alone_and_leaves_its_tag_the_tenants(
        scene: Scene) -> None:
    """The render approves the address's host route for the ingress's tag (its replicas advertise
    it); that approval must not make the tag reserved, or the ingress would refuse itself on its next
    pass. A later ingress claiming the same address is refused and gets no approval."""
    await scene.tenant.create(TAILNET_INGRESS, ingress("ha", scene.shop, scene.tailnet, "tag:shop-ha", replicas=2,
                                                       sharedAddress="198.18.5.10"), scene.shop)
    live = await eventually(lambda: _live_policy_with(scene.headscale, '"198.18.5.10/32"'), timeout=60,
                            what="the shared address's route approved in the live policy")
    assert parse_hujson(live)["autoApprovers"]["routes"]["198.18.5.10/32"] == ["tag:shop-ha"]
    await scene.tenant.merge_patch(TAILNET_INGRESS, "ha", {"spec": {"hostname": "ha2"}}, scene.shop)
    await eventually(lambda: _observed(scene.admin, scene.shop, "ha", 2), timeout=60,
                     what="the ingress reconciled after the approval went live")
    conditions = {c["type"]: c for c in (await scene.admin.get(TAILNET_INGRESS, "ha", scene.shop))["status"]
                  ["conditions"]}
    assert conditions["Ready"]["reason"] != "TagReserved", conditions["Ready"]
    assert conditions["TagOwned"]["status"] == "True", conditions["TagOwned"]
    # No agent runs on this control plane: no node advertises the address.
    assert conditions["SharedAddressServed"]["reason"] == "NotAdvertised", conditions["SharedAddressServed"]

    cond = await _refused_by_the_operator(scene, ingress("copy", scene.shop, scene.tailnet, "tag:shop-copy",
                                                         replicas=2, sharedAddress="198.18.5.10"),
                                          "SharedAddressTaken")
    assert f"198.18.5.10 is held by TailnetIngress {scene.shop}/ha" in cond["message"]
    live = _live_policy_with(scene.headscale, '"198.18.5.10/32"')
    assert parse_hujson(live)["autoApprovers"]["routes"]["198.18.5.10/32"] == ["tag:shop-ha"]


async def _observed(client: Client, namespace: str, name: str, generation: int) -> bool:
    status = (await client.get(TAILNET_INGRESS, name, namespace)).get("status") or {}
    return int(status.get("observedGeneration") or 0) >= generation


async def test_a_name_held_by_another_ingress_is_refused_on_the_later_one(scene: Scene) -> None:
    name = f"web.shop.{ZONE}"
    await scene.tenant.create(TAILNET_INGRESS, ingress("first", scene.shop, scene.tailnet, "tag:shop-web",
                                                       dnsTemplate=name), scene.shop)
    await eventually(lambda: _keys_for(scene.headscale, "tag:shop-web"), timeout=60, what="the first one's key")
    cond = await _refused_by_the_operator(
        scene, ingress("second", scene.shop, scene.tailnet, "tag:shop-other", dnsTemplate=name), "DNSNameTaken")
    assert f"TailnetIngress {scene.shop}/first" in cond["message"]


async def test_the_tenant_cannot_write_the_status_the_dns_name_would_come_from(scene: Scene) -> None:
    await scene.tenant.create(TAILNET_INGRESS, ingress("web", scene.shop, scene.tailnet, "tag:shop-web",
                                                       dnsTemplate=f"web.shop.{ZONE}"), scene.shop)
    with pytest.raises(Forbidden):
        await scene.tenant.merge_patch(TAILNET_INGRESS, "web", {"status": {"node": {
            "id": "1", "name": "web", "addresses": ["10.96.0.1"]}}}, scene.shop, subresource="status")
    key = await eventually(lambda: _keys_for(scene.headscale, "tag:shop-web"), timeout=60, what="its key")
    assert key, "the allowed ingress got its key"
    assert "10.96.0.1" not in (await _hosts(scene.admin, scene.operator_namespace)).values()


async def test_the_tenant_cannot_read_or_steer_the_key_bookkeeping(scene: Scene) -> None:
    egress_keys = await eventually(lambda: _keys_for(scene.headscale, EGRESS_TAG), timeout=60,
                                   what="the egress's key")
    await scene.tenant.create(TAILNET_INGRESS, ingress("web", scene.shop, scene.tailnet, "tag:shop-web"), scene.shop)
    mounted = await eventually(lambda: _get(scene.tenant, SECRET, "web-ingress-auth-key", scene.shop), timeout=60,
                               what="the agent's key Secret")
    assert not (mounted["metadata"].get("annotations") or {}).get("tailnet.dev/key-id")
    with pytest.raises(Forbidden):
        await scene.tenant.list(SECRET, scene.operator_namespace)
    # The tenant points its own Secret at the egress's key, then deletes its ingress.
    target = egress_keys[0]["id"]
    await scene.tenant.merge_patch(SECRET, "web-ingress-auth-key", {"metadata": {"annotations": {
        "tailnet.dev/key-id": target, "tailnet.dev/previous-key-id": target}}}, scene.shop)
    await scene.tenant.delete(TAILNET_INGRESS, "web", scene.shop)
    await eventually(lambda: _gone(scene.admin, TAILNET_INGRESS, "web", scene.shop), timeout=60, what="its finalizer")
    [egress_key] = [k for k in _keys_for(scene.headscale, EGRESS_TAG) if k["id"] == target]
    assert not _expired(egress_key), "the tenant expired the egress's key"


async def _get(client: Client, resource: Resource, name: str, namespace: str) -> JSON | None:
    try:
        return await client.get(resource, name, namespace)
    except NotFound:
        return None


async def _gone(client: Client, resource: Resource, name: str, namespace: str) -> bool:
    return await _get(client, resource, name, namespace) is None


def _expired(key: JSON) -> bool:
    from datetime import UTC, datetime
    expiration = str(key.get("expiration") or "")
    if not expiration:
        return False
    moment = datetime.fromisoformat(expiration.replace("Z", "+00:00"))
    return moment <= datetime.now(UTC)
