"""The chart installed as a Helm release on a cluster under test, and what tests and benchmarks read
from it: its pods, the leader election Lease, a Tailnet's reconciled state. Shared by
e2e/test_helm_install.py and benchmarks/failover.py.

The release is ``helm-e2e`` in its own namespace, without the admission policy (it names one
operator namespace cluster-wide), without the post-install check hook (e2e/test_check_hook.py
tests it; here it would add minutes to an install that helm gets 240 s for, and it fails on any
Tailnet another test left behind whose Headscale is gone) and with its own gateway namespace.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from typing import Any

from e2e.cluster import ClusterUnderTest, apply, condition, get_json, kubectl
from hack import binaries, render_install, versions
from hack.crds import CRD_DIR
from hack.localenv import wait_until
from hack.localenv.install import OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE

RELEASE = "helm-e2e"
NAMESPACE = "tailnet-helm"
GATEWAY_NAMESPACE = "tailnet-helm-gateway"
"""Not the static install's ``tailnet-gateway``: Helm does not take over objects it did not make."""
DEPLOYMENT = f"{RELEASE}-tailnet-operator"
LEASE = "tailnet-operator"
CRDS = sorted(p.name.removesuffix(".yaml") for p in CRD_DIR.glob("*.tailnet.dev.yaml"))


def helm(cluster: ClusterUnderTest, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    argv = [str(binaries.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}:\n{result.stdout}\n{result.stderr}")
    return result


def exists(cluster: ClusterUnderTest, *args: str) -> bool:
    return bool(kubectl(cluster, "get", *args, "--ignore-not-found", "-o", "name", check=False).strip())


def _adopt_crds(cluster: ClusterUnderTest) -> None:
    """CRDs applied by `kubectl apply -k` before: hand them to the release, as Helm documents."""
    for crd in CRDS:
        if exists(cluster, "crd", crd):
            kubectl(cluster, "label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
            kubectl(cluster, "annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                    f"meta.helm.sh/release-namespace={NAMESPACE}")


def lease_holder(cluster: ClusterUnderTest) -> str | None:
    lease = json.loads(kubectl(cluster, "-n", NAMESPACE, "get", "lease", LEASE, "-o", "json", "--ignore-not-found",
                              check=False) or "{}")
    holder: str | None = (lease.get("spec") or {}).get("holderIdentity")
    return holder


def holder_other_than(cluster: ClusterUnderTest, old: str) -> str | None:
    holder = lease_holder(cluster)
    return holder if holder and holder != old else None


def holder_pod(cluster: ClusterUnderTest, holder: str) -> str:
    """The release's pod whose manager holds the Lease as ``holder`` (``<pod>_<uuid>``)."""
    [pod] = [p["metadata"]["name"] for p in release_pods(cluster) if holder.startswith(f"{p['metadata']['name']}_")]
    return str(pod)


def crash_manager(cluster: ClusterUnderTest, pod: str) -> None:
    """SIGKILL the manager's process: on the local node through containerd; elsewhere (kind)
    the pod is deleted without a grace period, which still delivers a SIGTERM first."""
    node = getattr(cluster, "node", None)
    if node is None:
        kubectl(cluster, "-n", NAMESPACE, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return
    status = get_json(cluster, "-n", NAMESPACE, "pod", pod)["status"]
    [container] = [c for c in status["containerStatuses"] if c["name"] == "manager"]
    node.ctr("tasks", "kill", "--signal", "SIGKILL", container["containerID"].removeprefix("containerd://"))


def release_pods(cluster: ClusterUnderTest) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "-n", NAMESPACE, "pods", "-l",
                                           f"app.kubernetes.io/instance={RELEASE}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


@contextlib.contextmanager
def installed_release(cluster: ClusterUnderTest, image_ref: str) -> Iterator[str]:
    """The chart installed as :data:`RELEASE` with the image ``image_ref``, uninstalled afterwards;
    an operator installed with ``kubectl apply -k`` is scaled to zero meanwhile."""
    scaled = _scale_other_operator_down(cluster)
    # The namespace first, labelled for the restricted level (NOTES.txt): Helm stores the release there.
    major, minor, _ = versions.KUBERNETES.split(".")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": f"v{major}.{minor}"}}}])
    _adopt_crds(cluster)
    repository, tag = image_ref.rsplit(":", 1)
    try:
        helm(cluster, "install", RELEASE, str(render_install.CHART), "--namespace", NAMESPACE,
             "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
             "--set", "admissionPolicy.enabled=false", "--set", "postInstallCheck.enabled=false",
             "--set", f"gateway.namespace={GATEWAY_NAMESPACE}")
        yield RELEASE
    finally:
        subprocess.run([str(binaries.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", "uninstall", RELEASE,
                        "--namespace", NAMESPACE, "--wait", "--timeout=120s", "--ignore-not-found"],
                       capture_output=True, check=False, timeout=180)
        kubectl(cluster, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=120s", check=False)
        if scaled:
            kubectl(cluster, "-n", OPERATOR_NAMESPACE, "scale", "deployment", OPERATOR_DEPLOYMENT,
                    f"--replicas={scaled}", check=False)


def _scale_other_operator_down(cluster: ClusterUnderTest) -> int:
    """Scale an operator installed by `kubectl apply -k` to zero; return its replicas (0 if none)."""
    found = kubectl(cluster, "-n", OPERATOR_NAMESPACE, "get", "deployment", OPERATOR_DEPLOYMENT,
                    "--ignore-not-found", "-o", "json", check=False).strip()
    replicas = int(json.loads(found)["spec"].get("replicas") or 0) if found else 0
    if replicas:
        kubectl(cluster, "-n", OPERATOR_NAMESPACE, "scale", "deployment", OPERATOR_DEPLOYMENT, "--replicas=0")
        wait_until(lambda: not _running(cluster, OPERATOR_NAMESPACE, "tailnet-operator"), timeout=90,
                   what="the kubectl-installed operator to stop")
    return replicas


def _running(cluster: ClusterUnderTest, namespace: str, instance: str) -> bool:
    pods = get_json(cluster, "-n", namespace, "pods", "-l", f"app.kubernetes.io/instance={instance}")
    return bool(pods["items"])


def ready_release_pods(cluster: ClusterUnderTest) -> set[str]:
    return {p["metadata"]["name"] for p in release_pods(cluster) if condition(p, "Ready") == "True"}


def get_tailnet(cluster: ClusterUnderTest, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = get_json(cluster, "tailnets.tailnet.dev", name)
    return obj


def is_reconciled(cluster: ClusterUnderTest, name: str, generation: int) -> bool:
    tailnet = get_tailnet(cluster, name)
    status = tailnet.get("status") or {}
    return status.get("observedGeneration") == generation and condition(tailnet, "Ready") == "True"


def release_diagnostics(cluster: ClusterUnderTest) -> str:
    return "\n".join([kubectl(cluster, "-n", NAMESPACE, "get", "pods,lease", "-o", "wide", check=False),
                      kubectl(cluster, "-n", NAMESPACE, "logs", "-l", f"app.kubernetes.io/instance={RELEASE}",
                              "--tail=30", "--prefix", check=False)])


