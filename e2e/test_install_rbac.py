"""The install tree against a real kube-apiserver: `kubectl apply -k manifests/`, then the
operator from this source tree authenticated only by a token of its ServiceAccount.

This control plane has no node, so the Deployment never gets a pod here; what these tests
prove is that the objects are accepted (the pod template under the `restricted` Pod Security
standard included) and that the RBAC is enough for everything the operator does (a Tailnet
becomes Ready, its policy is rendered, its TailnetSite gets a status, Events are recorded, the
Lease is held, the finalizer comes off, and not one request is refused) and no more.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import re
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from hack import binaries
from hack.localenv import ControlPlane, Environment, Headscale, ManagedProcess, free_port
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_INGRESS, TAILNET_SITE
from tailnet_operator.controllers.policy import rendered_config_map_name
from tailnet_operator.controllers.tailnet import working_key_secret_name
from tailnet_operator.resources import egress as build
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import APIError, Forbidden, NotFound
from tailnet_operator.runtime.kinds import (
    CONFIG_MAP,
    DEPLOYMENT,
    EVENT,
    LEASE,
    NAMESPACE,
    NETWORK_POLICY,
    SECRET,
    SERVICE,
    Resource,
)

from .operator import create_bootstrap_secret, has_condition, remove_tailnets, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "manifests"
OPERATOR_NAMESPACE = "tailnet-system"
GATEWAY_NAMESPACE = "tailnet-gateway"
SERVICE_ACCOUNT = "tailnet-operator"
LEASE_NAME = "tailnet-operator"
POD = Resource("", "v1", "pods", "Pod")
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
          "app.kubernetes.io/part-of")


@dataclass
class Installed:
    rendered: list[JSON]
    """`kubectl kustomize manifests/`."""
    apply_output: str
    """What `kubectl apply -k manifests/` printed (warnings included)."""
    kubeconfig: Path
    """Authenticates as the operator's ServiceAccount, with a token from the TokenRequest API."""


def _kubectl(kubectl: Path, *args: str | Path, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(kubectl), *([f"--kubeconfig={kubeconfig}"] if kubeconfig else []), *map(str, args)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _service_account_kubeconfig(plane: ControlPlane, path: Path) -> Path:
    """The admin kubeconfig's cluster, with a user that is the ServiceAccount's token."""
    review = plane.request("POST", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                            "spec": {"expirationSeconds": 3600}})
    config = yaml.safe_load(plane.kubeconfig.read_text())
    config["users"] = [{"name": SERVICE_ACCOUNT, "user": {"token": review["status"]["token"]}}]
    for context in config["contexts"]:
        context["context"]["user"] = SERVICE_ACCOUNT
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def installed(crds: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """manifests/ applied as a user would; everything but the shared CRDs is deleted afterwards."""
    kubectl = binaries.binary("kubectl")
    rendered = [d for d in yaml.safe_load_all(_kubectl(kubectl, "kustomize", MANIFESTS).stdout) if d]
    try:
        applied = _kubectl(kubectl, "apply", "-k", MANIFESTS, kubeconfig=crds.kubeconfig)
        kubeconfig = _service_account_kubeconfig(crds, tmp_path_factory.mktemp("sa") / "kubeconfig")
        yield Installed(rendered, applied.stdout + applied.stderr, kubeconfig)
    finally:
        # The namespace (and the Lease, Secrets and ConfigMaps in it), the RBAC and the Events
        # Role in `default`; waits until the namespace is gone so a later install starts clean.
        _kubectl(kubectl, "delete", "-k", MANIFESTS / "install", "--ignore-not-found", "--timeout=120s",
                 kubeconfig=crds.kubeconfig)


def _rendered(installed: Installed, kind: str, name: str) -> JSON:
    [obj] = [o for o in installed.rendered if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


# -- the install ----------------------------------------------------------------------------------


async def test_install_is_labelled_and_applies_without_pod_security_warnings(
    installed: Installed, admin: Client
) -> None:
    for obj in installed.rendered:
        labels = obj["metadata"].get("labels") or {}
        assert all(labels.get(k) for k in LABELS), f"{obj['kind']} {obj['metadata']['name']}: {labels}"
    assert not [o for o in installed.rendered if o["apiVersion"].startswith("tailnet.dev/")], "no samples"
    container = _rendered(installed, "Deployment", "tailnet-operator")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "localhost/tailnet-operator:dev"
    assert "PodSecurity" not in installed.apply_output, installed.apply_output

    namespace = await admin.get(NAMESPACE, OPERATOR_NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    await admin.get(Resource("", "v1", "serviceaccounts", "ServiceAccount"), SERVICE_ACCOUNT, OPERATOR_NAMESPACE)


async def test_the_operator_pod_is_admitted_under_restricted_and_an_unconfined_one_is_not(
    installed: Installed, admin: Client
) -> None:
    template = _rendered(installed, "Deployment", "tailnet-operator")["spec"]["template"]
    pod: JSON = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "tailnet-operator-admission", "namespace": OPERATOR_NAMESPACE,
                              "labels": template["metadata"]["labels"]},
                 "spec": copy.deepcopy(template["spec"])}
    await admin.request("POST", POD.path(OPERATOR_NAMESPACE), body=pod, params={"dryRun": "All"})

    unconfined = copy.deepcopy(pod)
    del unconfined["spec"]["securityContext"]
    del unconfined["spec"]["containers"][0]["securityContext"]
    with pytest.raises(Forbidden, match="violates PodSecurity"):
        await admin.request("POST", POD.path(OPERATOR_NAMESPACE), body=unconfined, params={"dryRun": "All"})


# -- the operator on its ServiceAccount -----------------------------------------------------------


def _while_running(operator: ManagedProcess, check: Callable[[], Any]) -> Callable[[], Any]:
    """``check``, failing at once (with the operator's log) if the operator has exited."""

    def checked() -> Any:
        operator.check_running()
        return check()

    return checked


async def _http_text(url: str) -> str | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(2)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _admitted(client: Client, body: JSON) -> bool:
    """Whether a dry run of creating ``body`` passes admission."""
    try:
        await client.request("POST", TAILNET_INGRESS.path(body["metadata"]["namespace"]), body=body,
                             params={"dryRun": "All"})
    except APIError:
        return False
    return True


def _gone(admin: Client, resource: Resource, name: str, namespace: str | None = None) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            await admin.get(resource, name, namespace)
        except NotFound:
            return True
        return False

    return check


async def test_the_operator_reconciles_with_only_its_service_accounts_permissions(
    installed: Installed, admin: Client, headscale: Headscale, environment: Environment
) -> None:
    name = unique("rbac")
    site, base, bootstrap = f"{name}-site", f"{name}-base", f"{name}-bootstrap"
    await create_bootstrap_secret(admin, OPERATOR_NAMESPACE, bootstrap, headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": base, "namespace": OPERATOR_NAMESPACE},
                                   "data": {"policy.hujson": "{}"}})
    metrics, probes = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    operator = ManagedProcess(f"operator-{name}", [
        sys.executable, "-m", "tailnet_operator", "--kubeconfig", installed.kubeconfig,
        "--namespace", OPERATOR_NAMESPACE, "--leader-elect",
        f"--metrics-bind-address={metrics}", f"--health-probe-bind-address={probes}",
    ], log_dir=environment.log_dir, run_id=environment.run_id, cwd=REPO)
    operator.start()
    try:
        await eventually(_while_running(operator, lambda: _http_text(f"http://{probes}/readyz")), timeout=60,
                         what="the operator's /readyz (its informers listed everything)")
        lease = await eventually(_while_running(operator, lambda: _lease_holder(admin)), timeout=30,
                                 what="the operator to hold its Lease")
        assert lease.startswith(f"{socket.gethostname()}_")

        await admin.create(TAILNET, tailnet_object(
            name, headscale, OPERATOR_NAMESPACE, secret=bootstrap,
            policy={"baseConfigMapRef": {"namespace": OPERATOR_NAMESPACE, "name": base, "key": "policy.hujson"},
                    "mode": "Render"}))
        await admin.create(TAILNET_SITE, {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
            "spec": {"tailnetRef": {"name": name}, "routes": ["192.168.77.0/24"], "routerTag": "tag:site-rbac"}})

        # Each wait proves one group of rows of docs/reference/rbac.md.
        await eventually(_while_running(operator, has_condition(admin, TAILNET, name, "Ready", "True", "Connected")),
                         timeout=60, what="the Tailnet to be Ready (working key minted and stored)")
        await admin.get(SECRET, working_key_secret_name(name), OPERATOR_NAMESPACE)
        await eventually(_while_running(operator, has_condition(admin, TAILNET, name, "PolicyApplied", "False",
                                                                "RenderOnly")),
                         timeout=60, what="the policy to be rendered into its ConfigMap")

        async def site_rendered() -> bool:
            # (RenderOnly may first come from a render before the site: on freshly installed CRDs
            # a watch can still be restarting when the site is created)
            rendered = await admin.get(CONFIG_MAP, rendered_config_map_name(name), OPERATOR_NAMESPACE)
            return "tag:site-rbac" in rendered["data"]["policy.hujson"]

        await eventually(_while_running(operator, site_rendered), timeout=60,
                         what="the render to name the site's router tag")
        await eventually(_while_running(operator, has_condition(admin, TAILNET_SITE, site, "Ready", "False",
                                                                "NoRouter")),
                         timeout=60, what="the TailnetSite's status")
        await eventually(_while_running(operator, lambda: _event_reasons(admin, name)), timeout=30,
                         what="an Event about the Tailnet from the operator")

        assert await _refusals(metrics) == [], "kube-apiserver refused requests of the operator"

        # A TailnetIngress in a tenant namespace: its key, exposes, agent and Events are written there,
        # once the namespace has bound tailnet-operator-tenant (until then its writes are refused).
        tenant = unique("rbac-tenant")
        await admin.create(NAMESPACE, {"metadata": {"name": tenant}})
        await admin.merge_patch(TAILNET, name, {"spec": {"tenants": [
            {"namespaces": [tenant], "tags": ["tag:ingress-rbac"]}]}})
        headscale.api("PUT", "/api/v1/policy", {"policy": '{"tagOwners": {"tag:ingress-rbac": []}}'})
        shop = {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
            "metadata": {"name": "shop", "namespace": tenant},
            "spec": {"tailnetRef": {"name": name}, "tag": "tag:ingress-rbac", "hostname": "shop",
                     "exposes": [{"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 80},
                                  "hosts": [{"name": "shop.example.internal", "tls": {"certManager": {
                                      "issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}}]}]}}
        # the installed tenancy admission policy reads the Tailnet from its own cache
        await eventually(lambda: _admitted(admin, shop), timeout=30, what="admission to take the tenant")
        await admin.create(TAILNET_INGRESS, shop)
        cond = await eventually(_while_running(operator, has_condition(
            admin, TAILNET_INGRESS, "shop", "Ready", "False", "NamespaceNotGranted", namespace=tenant)),
            timeout=60, what="NamespaceNotGranted before the tenant lets the operator in")
        assert f"kubectl -n {tenant} create rolebinding" in cond["message"]
        await admin.apply(ROLE_BINDING, {
            "metadata": {"name": "tailnet-operator", "namespace": tenant},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "tailnet-operator-tenant"},
            "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": OPERATOR_NAMESPACE}]})
        await eventually(_while_running(operator, has_condition(
            admin, TAILNET_INGRESS, "shop", "CertificatesReady", "False", "CertManagerNotInstalled",
            namespace=tenant)), timeout=90, what="the ingress's objects and status (no cert-manager here)")
        for resource, object_name in ((SECRET, "shop-ingress-auth-key"), (CONFIG_MAP, "shop-ingress-config"),
                                      (DEPLOYMENT, "shop-ingress-agent"), (SERVICE, "shop-ingress-agent"),
                                      (NETWORK_POLICY, "shop-ingress-agent")):
            await admin.get(resource, object_name, tenant)
        allowed_in = await _refusals(metrics)  # the refusals before the binding, and no more from here
        await admin.delete(TAILNET_INGRESS, "shop", tenant)
        await eventually(_while_running(operator, _gone(admin, TAILNET_INGRESS, "shop", tenant)), timeout=60,
                         what="the operator to expire the ingress's key and remove its finalizer")

        await admin.delete(TAILNET_SITE, site)
        await admin.delete(TAILNET, name)
        await eventually(_while_running(operator, _gone(admin, TAILNET, name)), timeout=60,
                         what="the operator to expire the working key and remove its finalizer")

        refused = await _refusals(metrics)
        assert refused == allowed_in, f"kube-apiserver refused requests of the operator: {refused}"
    finally:
        operator.stop()
        for resource, obj in ((TAILNET_SITE, site), (TAILNET, name)):
            with contextlib.suppress(NotFound):
                await admin.delete(resource, obj)
        await remove_tailnets(admin, OPERATOR_NAMESPACE)
    lease_spec = (await admin.get(LEASE, LEASE_NAME, OPERATOR_NAMESPACE))["spec"]
    assert not lease_spec.get("holderIdentity"), "a graceful stop releases the Lease"


async def _refusals(metrics: str) -> list[str]:
    """The operator's request counters of 401 and 403 answers."""
    text = await _http_text(f"http://{metrics}/metrics")
    assert text is not None
    return re.findall(r'^rest_client_requests_total\{code="40[13]".*$', text, re.MULTILINE)


async def _lease_holder(admin: Client) -> str | None:
    try:
        lease = await admin.get(LEASE, LEASE_NAME, OPERATOR_NAMESPACE)
    except NotFound:
        return None
    holder = lease.get("spec", {}).get("holderIdentity")
    return str(holder) if holder else None


async def _event_reasons(admin: Client, name: str) -> set[str]:
    events = await admin.list(EVENT, "default")
    return {e["reason"] for e in events.items
            if e.get("regarding", {}).get("name") == name and e.get("reportingController") == "tailnet-operator"}


# -- and no more ----------------------------------------------------------------------------------


def _grants(rendered: list[JSON]) -> list[dict[str, str]]:
    """The resource attributes of every rule the bindings give the ServiceAccount."""
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
             for o in rendered if o["kind"] in ("Role", "ClusterRole")}
    attributes = []
    for binding in (o for o in rendered if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(subject.get("name") == SERVICE_ACCOUNT for subject in binding["subjects"]):
            continue  # a binding of someone else's
        namespace = binding["metadata"].get("namespace", "")
        ref = binding["roleRef"]
        for rule in roles[(ref["kind"], "" if ref["kind"] == "ClusterRole" else namespace, ref["name"])]["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    plural, _, subresource = resource.partition("/")
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [""]:
                            attributes.append({"namespace": namespace, "group": group, "resource": plural,
                                               "subresource": subresource, "verb": verb, "name": name})
    return attributes


async def _allowed(client: Client, attributes: dict[str, str]) -> bool:
    review = await client.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {k: v for k, v in attributes.items() if v}}})
    return bool(review["status"].get("allowed"))


def _refused(other: str) -> list[dict[str, str]]:
    """Requests the operator does not make, so its ServiceAccount must not be allowed them
    (``other`` has not bound ``tailnet-operator-tenant``, so no ingress's objects go there)."""
    ns = OPERATOR_NAMESPACE
    return [
        # no Secret or ConfigMap anywhere but where it was let in: not listed, watched or read
        {"resource": "secrets", "verb": "list"},
        {"resource": "secrets", "verb": "watch"},
        {"resource": "secrets", "verb": "get"},
        {"resource": "configmaps", "verb": "list"},
        {"resource": "configmaps", "verb": "watch"},
        {"namespace": other, "resource": "secrets", "verb": "get"},
        {"namespace": other, "resource": "secrets", "verb": "list"},
        {"namespace": other, "resource": "configmaps", "verb": "get"},
        {"namespace": "kube-system", "resource": "secrets", "verb": "get"},
        {"namespace": "kube-system", "resource": "secrets", "verb": "list"},
        # kube-system: the hosts ConfigMap by name, never CoreDNS's own configuration
        {"namespace": "kube-system", "resource": "configmaps", "verb": "list"},
        {"namespace": "kube-system", "resource": "configmaps", "verb": "get", "name": "coredns"},
        {"namespace": "kube-system", "resource": "configmaps", "verb": "patch", "name": "coredns"},
        {"namespace": "kube-system", "resource": "configmaps", "verb": "create", "name": "coredns"},
        {"namespace": "kube-system", "resource": "configmaps", "verb": "delete", "name": "tailnet-hosts"},
        {"namespace": other, "resource": "secrets", "verb": "patch"},
        {"namespace": other, "resource": "secrets", "verb": "delete"},
        {"namespace": other, "resource": "secrets", "verb": "create"},
        {"namespace": other, "resource": "configmaps", "verb": "patch"},
        {"namespace": ns, "resource": "secrets", "verb": "update"},
        {"namespace": ns, "resource": "pods", "verb": "create"},
        {"namespace": ns, "resource": "pods", "verb": "list"},
        {"namespace": other, "group": "apps", "resource": "deployments", "verb": "patch"},
        {"namespace": ns, "group": "apps", "resource": "deployments", "verb": "delete"},
        {"namespace": other, "resource": "services", "verb": "patch"},
        {"namespace": other, "resource": "services", "verb": "delete"},
        {"namespace": other, "group": "networking.k8s.io", "resource": "networkpolicies", "verb": "patch"},
        {"namespace": other, "group": "cert-manager.io", "resource": "certificates", "verb": "patch"},
        {"namespace": other, "group": "cert-manager.io", "resource": "certificates", "verb": "get"},
        {"namespace": other, "resource": "pods", "verb": "get"},
        {"namespace": other, "group": "tailnet.dev", "resource": "tailnetegresses", "verb": "patch"},
        {"namespace": other, "group": "tailnet.dev", "resource": "tailnetingresses", "verb": "delete"},
        {"namespace": other, "group": "tailnet.dev", "resource": "tailnetingresses", "verb": "update"},
        {"namespace": ns, "group": "coordination.k8s.io", "resource": "leases", "verb": "update", "name": "other"},
        {"namespace": other, "group": "events.k8s.io", "resource": "events", "verb": "create"},
        {"namespace": other, "resource": "events", "verb": "create"},
        {"group": "tailnet.dev", "resource": "tailnets", "verb": "delete"},
        {"group": "tailnet.dev", "resource": "tailnets", "verb": "create"},
        {"group": "tailnet.dev", "resource": "tailnets", "verb": "update"},
        {"group": "tailnet.dev", "resource": "tailnetegresses", "subresource": "status", "verb": "patch"},
        {"group": "rbac.authorization.k8s.io", "resource": "clusterroles", "verb": "escalate"},
        {"resource": "serviceaccounts", "subresource": "token", "verb": "create", "namespace": ns},
        # the routers' identities: made in the gateway namespace only, and never used by the operator
        {"resource": "serviceaccounts", "verb": "create", "namespace": ns},
        {"resource": "serviceaccounts", "verb": "create", "namespace": other},
        {"resource": "serviceaccounts", "subresource": "token", "verb": "create", "namespace": GATEWAY_NAMESPACE},
        {"group": "rbac.authorization.k8s.io", "resource": "roles", "verb": "create", "namespace": other},
        {"group": "rbac.authorization.k8s.io", "resource": "roles", "verb": "escalate",
         "namespace": GATEWAY_NAMESPACE},
        {"group": "rbac.authorization.k8s.io", "resource": "roles", "verb": "bind", "namespace": GATEWAY_NAMESPACE},
        {"group": "rbac.authorization.k8s.io", "resource": "clusterrolebindings", "verb": "create"},
        {"resource": "secrets", "verb": "update", "namespace": other},
    ]


async def test_the_service_account_may_do_what_the_rbac_lists_and_is_refused_the_rest(
    installed: Installed, admin: Client
) -> None:
    other = unique("rbac-other")
    await admin.create(NAMESPACE, {"metadata": {"name": other}})
    try:
        await admin.apply(SECRET, {"metadata": {"name": "unrelated", "namespace": other}, "type": "Opaque",
                                   "data": {"key": base64.b64encode(b"value").decode()}})
        async with Client(rest_config.load(installed.kubeconfig)) as sa:
            granted = _grants(installed.rendered)
            assert granted
            denied = [a for a in granted if not await _allowed(sa, a)]
            assert not denied, f"rules the apiserver does not grant: {denied}"
            allowed = [a for a in _refused(other) if await _allowed(sa, a)]
            assert not allowed, f"allowed, though the operator never needs it: {allowed}"

            # Real requests, not only reviews: in a namespace that has not bound the tenant role
            # the operator may neither read nor write a Secret.
            with pytest.raises(Forbidden):
                await sa.get(SECRET, "unrelated", other)
            with pytest.raises(Forbidden):
                await sa.apply(SECRET, {"metadata": {"name": "unrelated", "namespace": other},
                                        "data": {"key": base64.b64encode(b"changed").decode()}})
            with pytest.raises(Forbidden):
                await sa.list(SECRET)
            with pytest.raises(Forbidden):
                await sa.delete(TAILNET, "any")
            # Once it has, the operator reads a Secret there by name, and still lists none.
            await admin.apply(ROLE_BINDING, {
                "metadata": {"name": "tailnet-operator", "namespace": other},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "tailnet-operator-tenant"},
                "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": OPERATOR_NAMESPACE}]})
            await eventually(lambda: _readable(sa, other), timeout=30, what="the tenant role's get in effect")
            with pytest.raises(Forbidden):
                await sa.list(SECRET, other)
        secret = await admin.get(SECRET, "unrelated", other)
        assert base64.b64decode(secret["data"]["key"]) == b"value"
    finally:
        await admin.delete(NAMESPACE, other)


async def _readable(sa: Client, namespace: str) -> bool:
    try:
        await sa.get(SECRET, "unrelated", namespace)
    except Forbidden:
        return False
    return True


async def test_people_edit_ingresses_and_egresses_and_only_the_platform_role_writes_tailnets(
    installed: Installed, admin: Client
) -> None:
    """The roles aggregated into edit and admin write the namespaced kinds only; a Tailnet (a
    Headscale admin key, and where the operator sends keys), a site and a gateway need the
    platform role, bound by the cluster admin."""
    binding = Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding")
    people = {"editor": "tailnet-operator-edit", "platform": "tailnet-operator-platform"}
    names = {user: unique(f"rbac-{user}") for user in people}
    for user, role in people.items():
        await admin.apply(binding, {"metadata": {"name": names[user]},
                                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                "name": role},
                                    "subjects": [{"kind": "User", "name": names[user],
                                                  "apiGroup": "rbac.authorization.k8s.io"}]})
    try:
        async def may(user: str, verb: str, plural: str, namespace: str = "") -> bool:
            review = await admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": names[user], "groups": ["system:authenticated"], "resourceAttributes": {
                    k: v for k, v in {"group": "tailnet.dev", "resource": plural, "verb": verb,
                                      "namespace": namespace}.items() if v}}})
            return bool(review["status"].get("allowed"))

        for verb in ("create", "update", "patch", "delete"):
            assert await may("editor", verb, "tailnetingresses", "shop")
            assert await may("editor", verb, "tailnetegresses", OPERATOR_NAMESPACE)
            for plural in ("tailnets", "tailnetsites", "tailnetgateways"):
                assert not await may("editor", verb, plural), f"edit/admin may {verb} {plural}"
                assert await may("platform", verb, plural)
    finally:
        for name in names.values():
            with contextlib.suppress(NotFound):
                await admin.delete(binding, name)


# -- SubjectAccessReview: the docs' table, for the operator and for the agents ----------------------

RBAC_DOC = REPO / "docs" / "reference" / "rbac.md"
AGENT_SERVICE_ACCOUNT = "default"
"""The agent pods name no ServiceAccount (``resources/agent.py``): they run as their namespace's
``default``, with ``automountServiceAccountToken: false``."""


def _documented() -> list[dict[str, str]]:
    """The rows of the "Granted" table in docs/reference/rbac.md as resource attributes."""
    lines = iter(RBAC_DOC.read_text().splitlines())
    assert any(line.startswith("| scope | API group | resource | verb |") for line in lines)
    next(lines)
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        scope, group, resource, verb, names = [c.strip().replace("`", "") for c in line.strip("|").split("|")][:5]
        plural, _, subresource = resource.partition("/")
        for name in [n.strip() for n in names.split(",") if n.strip()] or [""]:
            rows.append({"namespace": "" if scope == "cluster" else scope, "group": "" if group == "core" else group,
                         "resource": plural, "subresource": subresource, "verb": verb, "name": name})
    return rows


async def _review(admin: Client, user: str, attributes: dict[str, str]) -> bool:
    namespace = user.split(":")[2]
    review = await admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                                          "system:authenticated"],
                 "resourceAttributes": {k: v for k, v in attributes.items() if v}}})
    return bool(review["status"].get("allowed"))


async def test_subject_access_reviews_grant_the_operator_the_docs_table_and_the_agents_nothing(
    installed: Installed, admin: Client
) -> None:
    operator = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{SERVICE_ACCOUNT}"
    rows = _documented()
    assert len(rows) > 40
    denied = [row for row in rows if not await _review(admin, operator, row)]
    assert not denied, f"in the docs' table but refused to the operator: {denied}"
    other = unique("rbac-sar")
    allowed = [a for a in _refused(other) if await _review(admin, operator, a)]
    assert not allowed, f"allowed to the operator, though the docs' table does not list it: {allowed}"

    # the agents: every row the operator has, and reading Secrets anywhere, is refused to them
    tenant = unique("rbac-tenant")
    agent_asks = rows + [{"namespace": ns, "resource": "secrets", "verb": verb}
                         for ns in (OPERATOR_NAMESPACE, tenant, "kube-system") for verb in ("get", "list", "watch")]
    for namespace in (OPERATOR_NAMESPACE, tenant):
        agent = f"system:serviceaccount:{namespace}:{AGENT_SERVICE_ACCOUNT}"
        allowed = [a for a in agent_asks if await _review(admin, agent, a)]
        assert not allowed, f"the agent pods' ServiceAccount {namespace}/default may: {allowed}"

    owner = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
             "metadata": {"name": "db", "namespace": OPERATOR_NAMESPACE, "uid": "u-1"}}
    egress = TailnetEgress.model_validate({**owner, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "db", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}})
    spec = build.deployment(owner, egress, build.AgentSpec(
        image="img", control_url="https://hs.test", auth_secret="db-auth-key", ca_bundle="",
        operator_labels={}))["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
