"""The chart on the local node: ``helm install`` gives an Available operator with 2 replicas of
which one holds the Lease; killing the leader, the standby takes over and reconciles a Tailnet
change within lease duration + renew deadline + a few seconds; ``helm uninstall`` leaves the
CRDs and does not hang on a Tailnet's finalizer.

The release is ``helm-e2e`` in its own namespace, without the admission policy (it names one
operator namespace cluster-wide), without the post-install check hook (e2e/test_check_hook.py
tests it; here it would add minutes to an install that helm gets 240 s for, and it fails on any
Tailnet another test left behind whose Headscale is gone) and with its own gateway namespace. An operator installed with
``kubectl apply -k`` by another test is scaled to zero meanwhile, so that only one operator
reconciles the Tailnets.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import ClusterUnderTest, apply, apply_tailnet, condition, get_json, kubectl, wait_available
from hack import binaries, render_install, versions
from hack.crds import CRD_DIR
from hack.localenv import Headscale, wait_until
from hack.localenv.install import OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE
from tailnet_operator.runtime.leaderelection import LeaderElectionConfig

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e]

RELEASE = "helm-e2e"
NAMESPACE = "tailnet-helm"
GATEWAY_NAMESPACE = "tailnet-helm-gateway"
"""Not the static install's ``tailnet-gateway``: Helm does not take over objects it did not make."""
DEPLOYMENT = f"{RELEASE}-tailnet-operator"
LEASE = "tailnet-operator"
CRDS = sorted(p.name.removesuffix(".yaml") for p in CRD_DIR.glob("*.tailnet.dev.yaml"))


def _helm(cluster: ClusterUnderTest, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    argv = [str(binaries.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}:\n{result.stdout}\n{result.stderr}"
    return result


def _exists(cluster: ClusterUnderTest, *args: str) -> bool:
    return bool(kubectl(cluster, "get", *args, "--ignore-not-found", "-o", "name", check=False).strip())


def _adopt_crds(cluster: ClusterUnderTest) -> None:
    """CRDs applied by `kubectl apply -k` before: hand them to the release, as Helm documents."""
    for crd in CRDS:
        if _exists(cluster, "crd", crd):
            kubectl(cluster, "label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
            kubectl(cluster, "annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                    f"meta.helm.sh/release-namespace={NAMESPACE}")


def _lease_holder(cluster: ClusterUnderTest) -> str | None:
    lease = json.loads(kubectl(cluster, "-n", NAMESPACE, "get", "lease", LEASE, "-o", "json", "--ignore-not-found",
                              check=False) or "{}")
    holder: str | None = (lease.get("spec") or {}).get("holderIdentity")
    return holder


def _new_holder(cluster: ClusterUnderTest, old: str) -> str | None:
    holder = _lease_holder(cluster)
    return holder if holder and holder != old else None


def _crash(cluster: ClusterUnderTest, pod: str) -> None:
    """SIGKILL the manager's process: on the local node through containerd; elsewhere (kind)
    the pod is deleted without a grace period, which still delivers a SIGTERM first."""
    node = getattr(cluster, "node", None)
    if node is None:
        kubectl(cluster, "-n", NAMESPACE, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return
    status = get_json(cluster, "-n", NAMESPACE, "pod", pod)["status"]
    [container] = [c for c in status["containerStatuses"] if c["name"] == "manager"]
    node.ctr("tasks", "kill", "--signal", "SIGKILL", container["containerID"].removeprefix("containerd://"))


def _pods(cluster: ClusterUnderTest) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "-n", NAMESPACE, "pods", "-l",
                                           f"app.kubernetes.io/instance={RELEASE}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def release(cluster: ClusterUnderTest, project_image: Any) -> Iterator[str]:
    scaled = _scale_other_operator_down(cluster)
    # The namespace first, labelled for the restricted level (NOTES.txt): Helm stores the release there.
    major, minor, _ = versions.KUBERNETES.split(".")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": f"v{major}.{minor}"}}}])
    _adopt_crds(cluster)
    repository, tag = project_image.ref.rsplit(":", 1)
    try:
        _helm(cluster, "install", RELEASE, str(render_install.CHART), "--namespace", NAMESPACE,
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


def _ready_pods(cluster: ClusterUnderTest) -> set[str]:
    return {p["metadata"]["name"] for p in _pods(cluster) if condition(p, "Ready") == "True"}


def _tailnet(cluster: ClusterUnderTest, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = get_json(cluster, "tailnets.tailnet.dev", name)
    return obj


def _reconciled(cluster: ClusterUnderTest, name: str, generation: int) -> bool:
    tailnet = _tailnet(cluster, name)
    status = tailnet.get("status") or {}
    return status.get("observedGeneration") == generation and condition(tailnet, "Ready") == "True"


def _diagnostics(cluster: ClusterUnderTest) -> str:
    return "\n".join([kubectl(cluster, "-n", NAMESPACE, "get", "pods,lease", "-o", "wide", check=False),
                      kubectl(cluster, "-n", NAMESPACE, "logs", "-l", f"app.kubernetes.io/instance={RELEASE}",
                              "--tail=30", "--prefix", check=False)])


def test_helm_install_runs_two_replicas_one_leading(cluster: ClusterUnderTest, release: str) -> None:
    try:
        wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=180)
        wait_until(lambda: len(_ready_pods(cluster)) == 2, timeout=120, what="both replicas Ready")
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}\n{_diagnostics(cluster)}") from exc
    deployment = get_json(cluster, "-n", NAMESPACE, "deployment", DEPLOYMENT)
    assert deployment["spec"]["replicas"] == deployment["status"]["readyReplicas"] == 2
    holder = wait_until(lambda: _lease_holder(cluster), timeout=60, what="a replica to hold the Lease")
    ready = _ready_pods(cluster)
    assert [p for p in ready if holder.startswith(f"{p}_")], (holder, ready)
    pdb = get_json(cluster, "-n", NAMESPACE, "pdb", DEPLOYMENT)
    wait_until(lambda: get_json(cluster, "-n", NAMESPACE, "pdb", DEPLOYMENT)["status"].get("disruptionsAllowed") == 1,
               timeout=60, what="the PodDisruptionBudget to allow one disruption")
    assert pdb["spec"]["minAvailable"] == 1


def test_killing_the_leader_the_standby_takes_over_and_reconciles(
        cluster: ClusterUnderTest, release: str, cluster_headscale: Headscale) -> None:
    wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=180)
    wait_until(lambda: len(_ready_pods(cluster)) == 2, timeout=120, what="both replicas Ready")
    name, secret = apply_tailnet(cluster, cluster_headscale, NAMESPACE, "helm-failover")
    try:
        try:
            wait_until(lambda: _reconciled(cluster, name, _tailnet(cluster, name)["metadata"]["generation"]),
                       timeout=120, what=f"Tailnet {name} Ready")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{_diagnostics(cluster)}") from exc
        holder = wait_until(lambda: _lease_holder(cluster), timeout=30, what="the Lease holder")
        [leader] = [p["metadata"]["name"] for p in _pods(cluster) if holder.startswith(f"{p['metadata']['name']}_")]
        [standby] = [p for p in _ready_pods(cluster) if p != leader]
        lease_before = get_json(cluster, "-n", NAMESPACE, "lease", LEASE)["spec"]

        # A crash, not a graceful stop: SIGKILL, so the Lease is not released and must expire.
        killed = time.monotonic()
        _crash(cluster, leader)
        kubectl(cluster, "patch", "tailnets.tailnet.dev", name, "--type=merge",
                "-p", json.dumps({"spec": {"apiKeyLifetime": "3h"}}))
        generation = _tailnet(cluster, name)["metadata"]["generation"]
        config = LeaderElectionConfig()
        bound = config.lease_duration + config.renew_deadline + 5
        try:
            new_holder = str(wait_until(lambda: _new_holder(cluster, holder), timeout=bound,
                                        what="the standby to take the Lease"))
            took_over = time.monotonic() - killed
            wait_until(lambda: _reconciled(cluster, name, generation), timeout=bound, what="the change reconciled")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{_diagnostics(cluster)}") from exc
        reconciled = time.monotonic() - killed
        # A new process leads: the standby, or the crashed pod's restarted container if it comes
        # back before the Lease expires and wins the race for it. Either is a failover.
        assert new_holder != holder
        assert new_holder.startswith((f"{standby}_", f"{leader}_")), (new_holder, standby, leader)
        lease_after = get_json(cluster, "-n", NAMESPACE, "lease", LEASE)["spec"]
        assert lease_after.get("leaseTransitions", 0) > lease_before.get("leaseTransitions", 0)
        print(f"failover: Lease taken {took_over:.1f}s and the change reconciled {reconciled:.1f}s after the kill "
              f"(bound {bound:.0f}s)")
        assert reconciled < bound
    finally:
        kubectl(cluster, "delete", "tailnets.tailnet.dev", name, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "-n", NAMESPACE, "delete", "secret", secret, check=False)


def test_helm_uninstall_keeps_the_crds_and_does_not_hang_on_a_finalizer(
        cluster: ClusterUnderTest, release: str, cluster_headscale: Headscale) -> None:
    wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=180)
    name, _ = apply_tailnet(cluster, cluster_headscale, NAMESPACE, "helm-uninstall")
    try:
        wait_until(lambda: _tailnet(cluster, name)["metadata"].get("finalizers"), timeout=120,
                   what="the operator to put its finalizer on the Tailnet")
        started = time.monotonic()
        _helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s", timeout=150)
        assert time.monotonic() - started < 120
        assert not _exists(cluster, "-n", NAMESPACE, "deployment", DEPLOYMENT)
        for crd in CRDS:
            assert _exists(cluster, "crd", crd), f"helm uninstall deleted CRD {crd}"
        assert _tailnet(cluster, name)["metadata"]["finalizers"], "the Tailnet stays, with its finalizer"
    finally:
        # No operator is left to remove the finalizer: the user's step after an uninstall.
        kubectl(cluster, "patch", "tailnets.tailnet.dev", name, "--type=merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False)
        kubectl(cluster, "delete", "tailnets.tailnet.dev", name, "--ignore-not-found", "--timeout=60s", check=False)
