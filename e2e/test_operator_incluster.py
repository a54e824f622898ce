"""The operator as its users deploy it: ``kubectl apply -k manifests/`` with the project's image,
running in a pod under the ``restricted`` Pod Security level, holding the Lease and reconciling
a Tailnet against a real Headscale that the pod reaches over the pod network."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from e2e.cluster import ClusterUnderTest, apply_tailnet, condition, get_json, kubectl, python_pod
from hack.localenv import Headscale, wait_until
from hack.localenv.node import kubectl as run_kubectl

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e]

def test_the_operator_pod_is_admitted_under_restricted_and_holds_the_lease(
        cluster: ClusterUnderTest, installed_operator: str) -> None:
    labels = get_json(cluster, "namespace", installed_operator)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"

    pods = get_json(cluster, "-n", installed_operator, "pods", "-l", "app.kubernetes.io/name=tailnet-operator")
    names = {p["metadata"]["name"] for p in pods["items"] if condition(p, "Ready") == "True"}
    assert names, "a Ready operator pod"

    def holder() -> str | None:
        lease = get_json(cluster, "-n", installed_operator, "lease", "tailnet-operator")
        holder: str | None = lease["spec"].get("holderIdentity")
        return holder

    identity = wait_until(holder, timeout=60, what="the operator to hold its Lease")
    assert any(identity.startswith(name) for name in names), (identity, names)

    # The level is enforced, not only labelled: a pod that runs as root is refused.
    offender = python_pod("root-pod", installed_operator, "tailnet-operator", "")
    offender["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    refused = run_kubectl(cluster.kubeconfig, "apply", "--server-side", "--field-manager=e2e", "-f", "-",
                          stdin=yaml.safe_dump(offender), check=False)
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:' in refused.stderr, refused.stderr


def test_the_operator_in_the_cluster_reconciles_a_tailnet_to_ready(
        cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale) -> None:
    name, secret = apply_tailnet(cluster, cluster_headscale, installed_operator, "incluster")
    try:
        def ready() -> dict[str, Any] | None:
            tailnet = get_json(cluster, "tailnets.tailnet.dev", name)
            return tailnet if condition(tailnet, "Ready") == "True" else None

        try:
            tailnet = wait_until(ready, timeout=120, what=f"Tailnet {name} Ready")
        except TimeoutError as exc:
            status = get_json(cluster, "tailnets.tailnet.dev", name).get("status")
            logs = kubectl(cluster, "-n", installed_operator, "logs", "deployment/tailnet-operator", "--tail=40",
                           check=False)
            raise AssertionError(f"{exc}\nstatus: {status}\noperator logs:\n{logs}") from exc
        assert tailnet["status"]["conditions"]
        keys = cluster_headscale.api("GET", "/api/v1/apikey")["apiKeys"]
        assert len(keys) >= 2, "the operator minted its own working key from the bootstrap key"
    finally:
        kubectl(cluster, "delete", "tailnets.tailnet.dev", name, "--wait=true", "--timeout=60s", check=False)
        kubectl(cluster, "-n", installed_operator, "delete", "secret", secret, check=False)
