"""The install tree (`kubectl apply -k manifests/`): structural facts that must not regress.

manifests/install/ is generated from the Helm chart (``python -m hack.render_install``;
e2e/test_chart.py checks it is current), so these facts hold for the chart's defaults too.

The files are rendered here in Python, following the subset of kustomize the tree uses
(``resources``, ``patches`` with a target, ``images``); a kustomization with any other field
fails the render, so the tree cannot grow a feature these tests silently ignore.
e2e/test_install_rbac.py renders the same tree with the real kustomize (``kubectl kustomize``).

The RBAC is compared with the table in docs/reference/rbac.md both ways, and with the
informers the controllers actually register.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack import versions
from tailnet_operator.__main__ import parse_args
from tailnet_operator.controllers.setup import setup
from tailnet_operator.names import LEADER_ELECTION_ID
from tailnet_operator.runtime.client.config import RestConfig
from tailnet_operator.runtime.events import CLUSTER_SCOPED_NAMESPACE, EventRecorder
from tailnet_operator.runtime.leaderelection import LeaderElectionConfig
from tailnet_operator.runtime.manager import Manager, ManagerOptions

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "manifests"
RBAC_DOC = REPO / "docs" / "reference" / "rbac.md"

NAMESPACE = "tailnet-system"
SERVICE_ACCOUNT = "tailnet-operator"
GATEWAY_NAMESPACE = "tailnet-gateway"
IMAGE = "localhost/tailnet-operator:dev"
PROBE_PORT = 8081
METRICS_PORT = 8080
PART_OF = "tailnet-operator"
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                      "app.kubernetes.io/part-of")

Obj = dict[str, Any]
CLUSTER_SCOPED_KINDS = ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
Grant = tuple[str, str, str, str, tuple[str, ...]]
"""(scope, API group, resource, verb, resource names); scope is ``cluster`` or a namespace."""


# -- rendering ------------------------------------------------------------------------------------


def _merge(into: Obj, patch: Obj) -> None:
    """A strategic merge of maps (all the tree's patches need: no lists, no directives)."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _matches(obj: Obj, target: Obj) -> bool:
    group, _, _ = str(obj.get("apiVersion", "")).rpartition("/")
    return all(obj.get(k) == v if k == "kind" else
               group == v if k == "group" else
               obj["metadata"].get(k) == v if k in ("name", "namespace") else
               _unsupported(f"patch target field {k}") for k, v in target.items())


def _unsupported(what: str) -> bool:
    raise AssertionError(f"the test renderer does not implement {what}; extend it or render with kustomize")


def render(directory: Path = MANIFESTS) -> list[Obj]:
    """The objects `kubectl kustomize <directory>` prints, for the features the tree uses."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches", "images"}
    if unknown:
        _unsupported(f"kustomization fields {sorted(unknown)} in {directory}")
    objects: list[Obj] = []
    for entry in kustomization.get("resources") or []:
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches") or []:
        if set(patch) != {"target", "patch"}:
            _unsupported(f"a patch with {sorted(patch)}")
        body = yaml.safe_load(patch["patch"])
        if not isinstance(body, dict):
            _unsupported("JSON 6902 patches")
        body = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
        body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
        for obj in objects:
            if _matches(obj, patch["target"]):
                _merge(obj, body)
    for image in kustomization.get("images") or []:
        for container in (c for obj in objects for c in _containers(obj)):
            if re.split(r"[:@]", container["image"])[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objects


def _containers(obj: Obj) -> list[Obj]:
    if obj.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod"):
        return []
    spec = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


RENDERED = render()


def one(kind: str, name: str) -> Obj:
    found = [o for o in RENDERED if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def deployment() -> Obj:
    return one("Deployment", "tailnet-operator")


def pod_spec() -> Obj:
    spec: Obj = deployment()["spec"]["template"]["spec"]
    return spec


def manager_container() -> Obj:
    containers = pod_spec()["containers"]
    assert len(containers) == 1
    container: Obj = containers[0]
    return container


# -- the tree -------------------------------------------------------------------------------------


def test_install_has_the_crds_and_the_operator_but_not_the_samples() -> None:
    crd_files = sorted(p.name for p in (MANIFESTS / "crd").glob("*.yaml") if p.name != "kustomization.yaml")
    crds = [o for o in RENDERED if o["kind"] == "CustomResourceDefinition"]
    assert len(crds) == len(crd_files) > 0
    assert not [o for o in RENDERED if o["apiVersion"].startswith("tailnet.dev/")], "samples are not installed"
    kinds = sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
                   for o in RENDERED if o["kind"] != "CustomResourceDefinition")
    assert kinds == sorted([
        ("Namespace", "", NAMESPACE),
        ("ServiceAccount", NAMESPACE, SERVICE_ACCOUNT),
        ("ClusterRole", "", "tailnet-operator"),
        ("ClusterRoleBinding", "", "tailnet-operator"),
        ("Role", NAMESPACE, "tailnet-operator"),
        ("RoleBinding", NAMESPACE, "tailnet-operator"),
        ("Role", CLUSTER_SCOPED_NAMESPACE, "tailnet-operator-events"),
        ("Role", "kube-system", "tailnet-operator-dns"),
        ("RoleBinding", "kube-system", "tailnet-operator-dns"),
        ("RoleBinding", CLUSTER_SCOPED_NAMESPACE, "tailnet-operator-events"),
        ("Deployment", NAMESPACE, "tailnet-operator"),
        ("Service", NAMESPACE, "tailnet-operator-metrics"),
        ("PodDisruptionBudget", NAMESPACE, "tailnet-operator"),
        ("ClusterRole", "", "tailnet-operator-view"),
        ("ClusterRole", "", "tailnet-operator-edit"),
        ("ClusterRole", "", "tailnet-operator-tenant"),
        ("ClusterRole", "", "tailnet-operator-platform"),
        ("ValidatingAdmissionPolicy", "", "tailnet-egress-operator-namespace"),
        ("ValidatingAdmissionPolicyBinding", "", "tailnet-egress-operator-namespace"),
        ("ValidatingAdmissionPolicy", "", "tailnet-ingress-tenancy"),
        ("ValidatingAdmissionPolicyBinding", "", "tailnet-ingress-tenancy"),
        ("Namespace", "", GATEWAY_NAMESPACE),
        ("Role", GATEWAY_NAMESPACE, "tailnet-operator-gateway"),
        ("RoleBinding", GATEWAY_NAMESPACE, "tailnet-operator-gateway"),
    ])


@pytest.mark.parametrize("obj", RENDERED, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_carries_the_recommended_labels(obj: Obj) -> None:
    labels = obj["metadata"].get("labels") or {}
    missing = [k for k in RECOMMENDED_LABELS if not labels.get(k)]
    assert not missing, f"{obj['kind']} {obj['metadata']['name']} lacks {missing}"
    assert labels["app.kubernetes.io/part-of"] == PART_OF
    assert labels["app.kubernetes.io/name"] == labels["app.kubernetes.io/instance"] == "tailnet-operator"


def test_the_gateway_namespace_admits_the_privileged_router_and_warns_above_baseline() -> None:
    labels = one("Namespace", GATEWAY_NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "baseline"


def test_no_identity_is_shared_by_the_routers() -> None:
    """Each router gets its own ServiceAccount and a Role on its own state Secret from the operator
    (resources/gateway.py); the install makes none that every router would share."""
    assert not [o for o in RENDERED if o.get("metadata", {}).get("namespace") == GATEWAY_NAMESPACE
                and o["kind"] in ("ServiceAccount", "Role", "RoleBinding")
                and o["metadata"]["name"] != "tailnet-operator-gateway"]
    can = {(g[1], g[2], g[3]) for g in granted() if g[0] == GATEWAY_NAMESPACE}
    router_role = {("", "secrets", verb) for verb in ("get", "update", "patch")}
    assert router_role <= can, "the operator holds what it grants a router (RBAC's escalation check)"
    assert {("", "serviceaccounts", "create"), ("rbac.authorization.k8s.io", "roles", "create"),
            ("rbac.authorization.k8s.io", "rolebindings", "create")} <= can


def test_the_namespace_enforces_the_restricted_pod_security_standard() -> None:
    labels = one("Namespace", NAMESPACE)["metadata"]["labels"]
    major, minor, _ = versions.KUBERNETES.split(".")
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == f"v{major}.{minor}", \
        "enforce is pinned to the Kubernetes minor the tests run (hack/versions.py)"
    for mode in ("warn", "audit"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "latest"


def test_namespaced_objects_live_in_the_operator_namespace_except_the_events_role() -> None:
    for obj in RENDERED:
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            assert "namespace" not in obj["metadata"]
            continue
        expected = {"tailnet-operator-events": CLUSTER_SCOPED_NAMESPACE, "tailnet-operator-dns": "kube-system",
                    "tailnet-operator-gateway": GATEWAY_NAMESPACE}.get(obj["metadata"]["name"], NAMESPACE)
        assert obj["metadata"].get("namespace") == expected, f"{obj['kind']} {obj['metadata']['name']}"


# -- the Deployment -------------------------------------------------------------------------------


def test_the_deployment_runs_the_operator_image_as_its_service_account() -> None:
    dep = deployment()
    assert dep["spec"]["replicas"] == 2, "HA by default: a leader and a warm standby"
    spec = pod_spec()
    assert spec["serviceAccountName"] == SERVICE_ACCOUNT
    assert spec["automountServiceAccountToken"] is True
    container = manager_container()
    assert container["image"] == IMAGE
    assert container["imagePullPolicy"] == "IfNotPresent"
    [source] = [d for d in yaml.safe_load_all((MANIFESTS / "install" / "deployment.yaml").read_text()) if d]
    assert source["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE, \
        "the chart's default image; manifests/kustomization.yaml's images: entry is where to change it"
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_the_arguments_are_the_operators_flags_with_leader_election_and_the_pod_namespace() -> None:
    container = manager_container()
    args = parse_args(container["args"])
    assert args.leader_elect is True
    assert args.metrics_bind_address.rpartition(":")[2] == str(METRICS_PORT)
    assert args.health_probe_bind_address.rpartition(":")[2] == str(PROBE_PORT)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def _port(container: Obj, ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    named = [p["containerPort"] for p in container["ports"] if p.get("name") == ref]
    assert named, f"no container port named {ref}"
    return int(named[0])


def test_probes_use_the_probe_port_and_metrics_the_metrics_port() -> None:
    container = manager_container()
    live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
    assert live["path"] == "/healthz" and _port(container, live["port"]) == PROBE_PORT
    assert ready["path"] == "/readyz" and _port(container, ready["port"]) == PROBE_PORT
    assert _port(container, "metrics") == METRICS_PORT


def test_the_metrics_service_selects_the_operator_pod_on_the_metrics_port() -> None:
    svc = one("Service", "tailnet-operator-metrics")
    pod_labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    [port] = svc["spec"]["ports"]
    assert port["port"] == METRICS_PORT and port["name"] == "metrics"
    assert _port(manager_container(), port["targetPort"]) == METRICS_PORT


def test_the_pod_meets_the_restricted_pod_security_standard() -> None:
    """The checks of the `restricted` profile (latest) that a pod spec can fail."""
    spec, container = pod_spec(), manager_container()
    pod_sc, sc = spec.get("securityContext") or {}, container.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert spec.get(host) in (None, False)
    assert sc.get("privileged") in (None, False)
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    assert set(sc.get("capabilities", {}).get("add") or []) <= {"NET_BIND_SERVICE"}
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True
    assert sc.get("runAsUser", pod_sc.get("runAsUser")) == 65532
    profile = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    assert profile == "RuntimeDefault"
    assert sc.get("readOnlyRootFilesystem") is True
    assert not [p for p in container["ports"] if p.get("hostPort")]
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for volume in spec.get("volumes") or []:
        assert set(volume) - {"name"} <= allowed_volumes, volume


def test_resources_are_requested_and_limited() -> None:
    resources = manager_container()["resources"]
    for kind in ("requests", "limits"):
        assert set(resources[kind]) == {"cpu", "memory"}


def test_the_grace_period_covers_draining_and_releasing_the_lease() -> None:
    needed = ManagerOptions().graceful_shutdown_timeout + LeaderElectionConfig().renew_deadline
    assert pod_spec()["terminationGracePeriodSeconds"] >= needed


# -- RBAC -----------------------------------------------------------------------------------------


def _aggregated(obj: Obj) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in labels)


def _per_namespace(obj: Obj) -> bool:
    return (obj["metadata"].get("labels") or {}).get("tailnet.dev/bind") == "per-namespace"


def _bound_by_someone_else(obj: Obj) -> bool:
    """A role the install ships for someone else to bind: per namespace, or to the platform team."""
    return "tailnet.dev/bind" in (obj["metadata"].get("labels") or {})


def _rbac(kind: str) -> list[Obj]:
    """The operator's own RBAC: the roles aggregated into view/edit/admin are for people, the
    per-namespace one is bound by namespace admins and the platform one by the cluster admin, not
    by the install."""
    return [o for o in RENDERED if o["kind"] == kind and not _aggregated(o) and not _bound_by_someone_else(o)]


def granted() -> list[Grant]:
    """Every (scope, group, resource, verb, names) the bindings give the operator's ServiceAccount."""
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
             for o in _rbac("Role") + _rbac("ClusterRole")}
    grants: list[Grant] = []
    for binding in _rbac("RoleBinding") + _rbac("ClusterRoleBinding"):
        scope = binding["metadata"].get("namespace", "cluster")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], "" if ref["kind"] == "ClusterRole" else scope, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        grants.append((scope, group, resource, verb, tuple(sorted(rule.get("resourceNames", [])))))
    return grants


def documented() -> list[Grant]:
    """The rows of the "Granted" table in docs/reference/rbac.md."""
    lines = iter(RBAC_DOC.read_text().splitlines())
    header = next((line for line in lines if line.startswith("| scope | API group | resource | verb |")), None)
    assert header is not None, "docs/reference/rbac.md has no table of grants"
    next(lines)  # |---|
    rows: list[Grant] = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
        scope, group, resource, verb, names, needed_by, why = cells
        assert needed_by and why, f"a row without its justification: {line}"
        rows.append((scope, "" if group == "core" else group, resource, verb,
                     tuple(sorted(n.strip() for n in names.split(",") if n.strip()))))
    return rows


def test_the_rbac_and_the_docs_table_agree_both_ways() -> None:
    rules, rows = granted(), documented()
    assert len(rows) == len(set(rows)), "a row appears twice in docs/reference/rbac.md"
    assert len(rules) == len(set(rules)), "a permission is granted twice"
    undocumented = sorted(set(rules) - set(rows))
    unused = sorted(set(rows) - set(rules))
    assert not undocumented, f"granted but not justified in docs/reference/rbac.md: {undocumented}"
    assert not unused, f"documented but not granted in manifests/install/rbac.yaml: {unused}"


def test_no_rule_uses_a_wildcard_or_a_dangerous_verb() -> None:
    for role in _rbac("Role") + _rbac("ClusterRole"):
        assert "aggregationRule" not in role
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not [v for v in rule.get(field, []) if "*" in v], f"{role['metadata']['name']}: {rule}"
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate", "deletecollection"}


def test_bindings_name_only_the_operators_service_account_and_every_role_is_bound() -> None:
    bound = set()
    for binding in _rbac("RoleBinding") + _rbac("ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}]
        ref = binding["roleRef"]
        if binding["kind"] == "ClusterRoleBinding":
            assert ref["kind"] == "ClusterRole"
        bound.add((ref["kind"], binding["metadata"].get("namespace", "") if ref["kind"] == "Role" else "",
                   ref["name"]))
    defined = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
               for o in _rbac("Role") + _rbac("ClusterRole")}
    assert bound == defined


def test_kinds_of_the_controllers_not_written_yet_are_not_granted() -> None:
    assert sorted(g for g in granted() if g[2].split("/")[0] == "namespaces") == [
        ("cluster", "", "namespaces", "list", ()), ("cluster", "", "namespaces", "watch", ())], \
        "namespaces are read for their labels (a Gateway listener's allowedRoutes selector), never written"
    identities = {"serviceaccounts", "roles", "rolebindings", "clusterroles", "clusterrolebindings"}
    assert {g[0] for g in granted() if g[2] in identities} == {GATEWAY_NAMESPACE}, \
        "identities are made only for the routers, in the gateway namespace"
    assert sorted(g for g in granted() if g[2] == "pods") == sorted([
        (NAMESPACE, "", "pods", "get", ()), (GATEWAY_NAMESPACE, "", "pods", "list", ()),
        (GATEWAY_NAMESPACE, "", "pods", "watch", ()), (GATEWAY_NAMESPACE, "", "pods", "delete", ())]), \
        "the operator reads its own Pod (for its image), watches the router pods, deletes them only with Delete"


def test_no_secret_or_configmap_is_granted_cluster_wide() -> None:
    """A metadata-only watch needs list and watch as much as a whole one, and list returns whole
    objects to whoever holds it: Secrets and ConfigMaps are granted per namespace only."""
    wide = [g for g in granted() if g[0] == "cluster" and g[1] == "" and g[2] in ("secrets", "configmaps")]
    assert wide == []
    secrets = {(g[0], g[3]) for g in granted() if g[1] == "" and g[2] == "secrets"}
    assert secrets == {(NAMESPACE, verb) for verb in ("list", "watch", "create", "patch", "delete")} | {
        (GATEWAY_NAMESPACE, verb) for verb in ("list", "watch", "get", "create", "update", "patch", "delete")}


def test_kube_system_is_granted_the_hosts_configmap_by_name_and_nothing_else() -> None:
    there = [g for g in granted() if g[0] == "kube-system"]
    assert sorted(there) == sorted(("kube-system", "", "configmaps", verb, ("tailnet-hosts",))
                                   for verb in ("get", "create", "patch"))


def _registered_informers(scope: str | None = None) -> set[tuple[str, str]]:
    """(group, plural) of every informer the controllers register at start-up in ``scope`` (a
    namespace; None: cluster-wide)."""
    manager = Manager(RestConfig(host="https://127.0.0.1:1"), ManagerOptions())
    setup(manager, namespace=NAMESPACE, events=EventRecorder(manager.client, reporting_instance="test"))
    keys = list(manager.cache._informers)
    assert {namespace for _, namespace, _ in keys} <= {None, NAMESPACE, GATEWAY_NAMESPACE}, "an informer elsewhere"
    whole = {(resource.plural, namespace) for resource, namespace, _ in keys if namespace == NAMESPACE}
    assert whole == {("secrets", NAMESPACE), ("configmaps", NAMESPACE)}, \
        "only Secrets and ConfigMaps are cached in the operator's namespace (and in the gateway namespace)"
    assert not [k for k in keys if k[0].plural in ("secrets", "configmaps") and k[1] is None], \
        "no Secret or ConfigMap informer of all namespaces"
    return {(resource.group, resource.plural) for resource, namespace, _ in keys if namespace == scope}


def test_the_informers_of_the_gateway_namespace_may_list_and_watch_there() -> None:
    informers = _registered_informers(GATEWAY_NAMESPACE)
    assert informers == {("apps", "statefulsets"), ("", "pods"), ("", "secrets"), ("", "configmaps")}
    there = {(g[1], g[2], g[3]) for g in granted() if g[0] == GATEWAY_NAMESPACE}
    assert not [(group, plural, verb) for group, plural in informers for verb in ("list", "watch")
                if (group, plural, verb) not in there]


def test_every_informer_the_controllers_register_may_list_and_watch_cluster_wide() -> None:
    informers = _registered_informers()
    cluster = {(g[1], g[2], g[3]) for g in granted() if g[0] == "cluster" and not g[4]}
    missing = sorted((group, plural, verb) for group, plural in informers for verb in ("list", "watch")
                     if (group, plural, verb) not in cluster)
    assert not missing, f"informers without list/watch in the ClusterRole: {missing}"
    listed = {(g[1], g[2]) for g in granted() if g[3] in ("list", "watch") and g[0] == "cluster"}
    assert listed == informers, "list/watch granted on a kind no controller watches"
    for scope in (NAMESPACE, GATEWAY_NAMESPACE):
        there = {(g[1], g[2]) for g in granted() if g[3] in ("list", "watch") and g[0] == scope}
        assert there == _registered_informers(scope), f"list/watch granted in {scope} where no informer watches"
    elsewhere = [g for g in granted() if g[3] in ("list", "watch") and g[0] not in ("cluster", NAMESPACE,
                                                                                     GATEWAY_NAMESPACE)]
    assert elsewhere == []


def test_the_lease_role_names_the_managers_lease_in_the_operator_namespace() -> None:
    lease = LEADER_ELECTION_ID
    assert sorted(g for g in granted() if g[2] == "leases") == sorted([
        (NAMESPACE, "coordination.k8s.io", "leases", "create", ()),
        (NAMESPACE, "coordination.k8s.io", "leases", "get", (lease,)),
        (NAMESPACE, "coordination.k8s.io", "leases", "update", (lease,)),
    ])


def test_events_are_written_only_where_the_recorder_puts_them() -> None:
    events = [g for g in granted() if g[2] == "events"]
    # cluster-scoped objects' Events go to `default`; a TailnetEgress's to its own (the operator's) namespace
    assert {g[0] for g in events} == {CLUSTER_SCOPED_NAMESPACE, NAMESPACE}
    assert {g[1] for g in events} == {"events.k8s.io"}


def _aggregates(role: Obj) -> set[str]:
    return {k.rpartition("-")[2] for k, v in role["metadata"]["labels"].items()
            if k.startswith("rbac.authorization.k8s.io/aggregate-to-") and v == "true"}


def test_view_and_edit_aggregate_the_custom_resources_and_are_bound_to_nobody() -> None:
    view, edit = one("ClusterRole", "tailnet-operator-view"), one("ClusterRole", "tailnet-operator-edit")
    plurals = {o["spec"]["names"]["plural"] for o in RENDERED if o["kind"] == "CustomResourceDefinition"}
    namespaced = {"tailnetegresses", "tailnetingresses"}
    for role, verbs, aggregates, resources in (
            (view, {"get", "list", "watch"}, {"view", "edit", "admin"}, plurals),
            (edit, {"create", "update", "patch", "delete"}, {"edit", "admin"}, namespaced)):
        assert _aggregates(role) == aggregates
        [rule] = role["rules"]
        assert rule["apiGroups"] == ["tailnet.dev"] and set(rule["resources"]) == resources
        assert set(rule["verbs"]) == verbs
    refs = {o["roleRef"]["name"] for o in RENDERED if o["kind"] in ("RoleBinding", "ClusterRoleBinding")}
    assert not refs & {"tailnet-operator-view", "tailnet-operator-edit", "tailnet-operator-platform"}


def test_tailnets_sites_and_gateways_are_written_by_the_platform_role_alone() -> None:
    """A Tailnet names a Headscale admin key and where the operator sends keys; a site feeds the
    autoApprovers; a gateway runs a router: none of them comes with `edit` or `admin`."""
    platform = {"tailnets", "tailnetsites", "tailnetgateways"}
    for role in (o for o in RENDERED if o["kind"] == "ClusterRole" and _aggregates(o) & {"edit", "admin"}):
        writes = {r for rule in role["rules"] if set(rule["verbs"]) & {"create", "update", "patch", "delete"}
                  for r in rule["resources"]}
        assert not writes & platform, role["metadata"]["name"]
    role = one("ClusterRole", "tailnet-operator-platform")
    assert not _aggregates(role) and role["metadata"]["labels"]["tailnet.dev/bind"] == "platform"
    [rule] = role["rules"]
    assert platform <= set(rule["resources"]) and {"create", "update", "patch", "delete"} <= set(rule["verbs"])


# -- high availability ----------------------------------------------------------------------------


def test_the_disruption_budget_keeps_one_replica_through_a_drain() -> None:
    pdb = one("PodDisruptionBudget", "tailnet-operator")
    assert pdb["spec"]["minAvailable"] == 1 < deployment()["spec"]["replicas"]
    assert pdb["spec"]["selector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]


def test_replicas_spread_over_nodes_but_still_schedule_on_one() -> None:
    [spread] = pod_spec()["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway", "a single-node cluster runs both replicas"
    assert spread["labelSelector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]


def test_the_chart_labels_are_on_every_object() -> None:
    versions_seen = set()
    for obj in RENDERED:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/managed-by"), obj["metadata"]["name"]
        versions_seen.add(labels.get("app.kubernetes.io/version"))
    assert versions_seen == {deployment()["metadata"]["labels"]["app.kubernetes.io/version"]}, \
        "manifests/kustomization.yaml labels the CRDs with the chart's appVersion"


# -- admission ------------------------------------------------------------------------------------


def test_the_egress_admission_policy_is_bound_and_names_the_operator_namespace() -> None:
    policy = one("ValidatingAdmissionPolicy", "tailnet-egress-operator-namespace")
    binding = one("ValidatingAdmissionPolicyBinding", "tailnet-egress-operator-namespace")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["tailnetegresses"] and set(rule["operations"]) == {"CREATE", "UPDATE"}
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["operatorNamespace"] == f"'{NAMESPACE}'"


def test_the_tenant_role_is_bound_by_nobody_and_grants_only_applying_an_ingresss_objects() -> None:
    [tenant] = [o for o in RENDERED if o["kind"] == "ClusterRole" and _per_namespace(o)]
    assert tenant["metadata"]["name"] == "tailnet-operator-tenant"
    bindings = [o for o in RENDERED if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert not [b for b in bindings if b["roleRef"]["name"] == tenant["metadata"]["name"]]
    grants = {(group, resource, verb) for rule in tenant["rules"] for group in rule["apiGroups"]
              for resource in rule["resources"] for verb in rule["verbs"]}
    kinds = {("", "secrets"), ("", "configmaps"), ("", "services"), ("apps", "deployments"),
             ("networking.k8s.io", "networkpolicies"), ("cert-manager.io", "certificates"),
             ("events.k8s.io", "events"), ("policy", "poddisruptionbudgets")}
    # and Secrets and ConfigMaps read by name (TLS Secrets, what it applied), never listed or watched;
    # and a LoadBalancer Service's: the owner of its agent's objects, which are deleted when it is
    # released without being deleted; and an Ingress of a tailnet IngressClass's (and a Gateway of a tailnet
    # GatewayClass's) finalizer and ownership
    # and the PodDisruptionBudget of an ingress's replicas, pruned when it goes back to one
    released = {("", "secrets"), ("", "configmaps"), ("", "services"), ("apps", "deployments"),
                ("networking.k8s.io", "networkpolicies"), ("policy", "poddisruptionbudgets")}
    assert grants == {(g, r, v) for g, r in kinds for v in ("create", "patch")} | {
        ("", "secrets", "get"), ("", "configmaps", "get"), ("", "services/finalizers", "update"),
        ("networking.k8s.io", "ingresses", "patch"), ("networking.k8s.io", "ingresses/finalizers", "update"),
        ("gateway.networking.k8s.io", "gateways", "patch"),
        ("gateway.networking.k8s.io", "gateways/finalizers", "update")} | {
        (g, r, "delete") for g, r in released}
    doc = RBAC_DOC.read_text()
    assert "tailnet-operator-tenant" in doc and all(f"`{r}`" in doc for _, r in kinds)


@pytest.mark.parametrize(("env", "flags", "expected"), [
    ({}, [], False),
    ({"TAILNET_GATEWAY_ROUTER_SYSCTLS": "true"}, [], True),
    ({"TAILNET_GATEWAY_ROUTER_SYSCTLS": "true"}, ["--no-gateway-router-sysctls"], False),
    ({"TAILNET_GATEWAY_ROUTER_SYSCTLS": "yes"}, [], False),
])
def test_the_routers_forwarding_sysctls_come_from_the_flag_else_the_environment(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flags: list[str], expected: bool) -> None:
    monkeypatch.delenv("TAILNET_GATEWAY_ROUTER_SYSCTLS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parse_args(flags).gateway_router_sysctls is expected
