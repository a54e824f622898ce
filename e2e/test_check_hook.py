"""The chart's post-install hook on the local node: ``helm install`` waits for the Job that runs
``tailnet-operator check --wait``, which passes once the CRDs are served and a replica leads; its
report is in the Job's log. Then ``kubectl tailnet check`` from this machine (the same program
outside the cluster) gives the same verdict, and ``status`` reads a Tailnet reconciled in-cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ClusterUnderTest, apply, apply_tailnet, get_json, kubectl
from hack import binaries, render_install, versions
from hack.crds import CRD_DIR
from hack.localenv import Headscale, wait_until
from hack.localenv.install import OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

RELEASE = "check-e2e"
NAMESPACE = "tailnet-check"
GATEWAY_NAMESPACE = "tailnet-check-gateway"
"""Not the static install's ``tailnet-gateway``, which an earlier test may have made: Helm does not
take over objects it did not make."""
REPO = Path(__file__).resolve().parent.parent


def _helm(cluster: ClusterUnderTest, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    argv = [str(binaries.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def installed(cluster: ClusterUnderTest, project_image: Any) -> Iterator[subprocess.CompletedProcess[str]]:
    found = kubectl(cluster, "-n", OPERATOR_NAMESPACE, "get", "deployment", OPERATOR_DEPLOYMENT,
                    "--ignore-not-found", "-o", "json", check=False).strip()
    scaled = int(json.loads(found)["spec"].get("replicas") or 0) if found else 0
    if scaled:  # one operator at a time reconciles the cluster-scoped Tailnets
        kubectl(cluster, "-n", OPERATOR_NAMESPACE, "scale", "deployment", OPERATOR_DEPLOYMENT, "--replicas=0")
    major, minor, _ = versions.KUBERNETES.split(".")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": f"v{major}.{minor}"}}}])
    for crd in sorted(p.name.removesuffix(".yaml") for p in CRD_DIR.glob("*.tailnet.dev.yaml")):
        if kubectl(cluster, "get", "crd", crd, "--ignore-not-found", "-o", "name", check=False).strip():
            kubectl(cluster, "label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
            kubectl(cluster, "annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                    f"meta.helm.sh/release-namespace={NAMESPACE}")
    repository, tag = project_image.ref.rsplit(":", 1)
    try:
        # no --wait: the hook itself waits (check --wait) for the operator to be Ready and lead
        yield _helm(cluster, "install", RELEASE, str(render_install.CHART), "--namespace", NAMESPACE,
                    "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                    "--set", "admissionPolicy.enabled=false", "--set", "postInstallCheck.timeoutSeconds=240",
                    "--set", f"gateway.namespace={GATEWAY_NAMESPACE}",
                    "--timeout=360s")
    finally:
        _helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s",
              "--ignore-not-found", timeout=180)
        kubectl(cluster, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=120s", check=False)
        if scaled:
            kubectl(cluster, "-n", OPERATOR_NAMESPACE, "scale", "deployment", OPERATOR_DEPLOYMENT,
                    f"--replicas={scaled}", check=False)


def test_helm_install_waits_for_the_check_job_and_it_passes(
        cluster: ClusterUnderTest, installed: subprocess.CompletedProcess[str]) -> None:
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # the hook's resources are gone after success (hook-succeeded); the operator leads
    assert not kubectl(cluster, "-n", NAMESPACE, "get", "job", f"{RELEASE}-tailnet-operator-check",
                       "--ignore-not-found", "-o", "name", check=False).strip()
    lease = get_json(cluster, "-n", NAMESPACE, "lease", "tailnet-operator")
    assert lease["spec"]["holderIdentity"]


def test_the_cli_from_outside_agrees_and_reads_a_tailnet_reconciled_in_cluster(
        cluster: ClusterUnderTest, installed: subprocess.CompletedProcess[str], cluster_headscale: Headscale) -> None:
    assert installed.returncode == 0, installed.stderr

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tailnet_operator", *args, f"--kubeconfig={cluster.kubeconfig}",
                               f"--operator-namespace={NAMESPACE}"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=False)

    result = cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[  ok] operator Deployment {RELEASE}-tailnet-operator" in result.stdout
    assert "[  ok] leader" in result.stdout
    name, _ = apply_tailnet(cluster, cluster_headscale, NAMESPACE, "check-e2e")
    try:
        def reconciled() -> subprocess.CompletedProcess[str] | None:
            done = cli("status", f"tailnet/{name}")
            return done if done.returncode == 0 else None

        status = wait_until(reconciled, timeout=120, what=f"Tailnet {name} healthy per the CLI")
        assert "working key" in status.stdout and "version v0.29.2" in status.stdout
        result = cli("check")
        assert result.returncode == 0, result.stdout
        assert f"[  ok] Tailnet {name}: Headscale v0.29.2" in result.stdout
    finally:
        kubectl(cluster, "delete", "tailnets.tailnet.dev", name, "--wait=true", "--timeout=60s", check=False)
