"""The chart on the local node: ``helm install`` gives an Available operator with 2 replicas of
which one holds the Lease; killing the leader, the standby takes over and reconciles a Tailnet
change within lease duration + renew deadline + a few seconds; ``helm uninstall`` leaves the
CRDs and does not hang on a Tailnet's finalizer.

The release (e2e/helm_release.py) is ``helm-e2e`` in its own namespace. An operator installed
with ``kubectl apply -k`` by another test is scaled to zero meanwhile, so that only one operator
reconciles the Tailnets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import ClusterUnderTest, apply_tailnet, get_json, kubectl, wait_available
from e2e.helm_release import (
    CRDS,
    DEPLOYMENT,
    LEASE,
    NAMESPACE,
    RELEASE,
    crash_manager,
    exists,
    get_tailnet,
    helm,
    holder_other_than,
    holder_pod,
    installed_release,
    is_reconciled,
    lease_holder,
    ready_release_pods,
    release_diagnostics,
)
from hack.localenv import Headscale, wait_until
from tailnet_operator.runtime.leaderelection import LeaderElectionConfig

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e]

@pytest.fixture(scope="module")
def release(cluster: ClusterUnderTest, project_image: Any) -> Iterator[str]:
    with installed_release(cluster, project_image.ref) as name:
        yield name


def test_helm_install_runs_two_replicas_one_leading(cluster: ClusterUnderTest, release: str) -> None:
    try:
        wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=180)
        wait_until(lambda: len(ready_release_pods(cluster)) == 2, timeout=120, what="both replicas Ready")
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}\n{release_diagnostics(cluster)}") from exc
    deployment = get_json(cluster, "-n", NAMESPACE, "deployment", DEPLOYMENT)
    assert deployment["spec"]["replicas"] == deployment["status"]["readyReplicas"] == 2
    holder = wait_until(lambda: lease_holder(cluster), timeout=60, what="a replica to hold the Lease")
    ready = ready_release_pods(cluster)
    assert [p for p in ready if holder.startswith(f"{p}_")], (holder, ready)
    pdb = get_json(cluster, "-n", NAMESPACE, "pdb", DEPLOYMENT)
    wait_until(lambda: get_json(cluster, "-n", NAMESPACE, "pdb", DEPLOYMENT)["status"].get("disruptionsAllowed") == 1,
               timeout=60, what="the PodDisruptionBudget to allow one disruption")
    assert pdb["spec"]["minAvailable"] == 1


def test_killing_the_leader_the_standby_takes_over_and_reconciles(
        cluster: ClusterUnderTest, release: str, cluster_headscale: Headscale) -> None:
    wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=180)
    wait_until(lambda: len(ready_release_pods(cluster)) == 2, timeout=120, what="both replicas Ready")
    name, secret = apply_tailnet(cluster, cluster_headscale, NAMESPACE, "helm-failover")
    try:
        try:
            wait_until(lambda: is_reconciled(cluster, name, get_tailnet(cluster, name)["metadata"]["generation"]),
                       timeout=120, what=f"Tailnet {name} Ready")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{release_diagnostics(cluster)}") from exc
        holder = wait_until(lambda: lease_holder(cluster), timeout=30, what="the Lease holder")
        leader = holder_pod(cluster, holder)
        [standby] = [p for p in ready_release_pods(cluster) if p != leader]
        lease_before = get_json(cluster, "-n", NAMESPACE, "lease", LEASE)["spec"]

        # A crash, not a graceful stop: SIGKILL, so the Lease is not released and must expire.
        killed = time.monotonic()
        crash_manager(cluster, leader)
        kubectl(cluster, "patch", "tailnets.tailnet.dev", name, "--type=merge",
                "-p", json.dumps({"spec": {"apiKeyLifetime": "3h"}}))
        generation = get_tailnet(cluster, name)["metadata"]["generation"]
        config = LeaderElectionConfig()
        bound = config.lease_duration + config.renew_deadline + 5
        try:
            new_holder = str(wait_until(lambda: holder_other_than(cluster, holder), timeout=bound,
                                        what="the standby to take the Lease"))
            took_over = time.monotonic() - killed
            wait_until(lambda: is_reconciled(cluster, name, generation), timeout=bound, what="the change reconciled")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{release_diagnostics(cluster)}") from exc
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
        wait_until(lambda: get_tailnet(cluster, name)["metadata"].get("finalizers"), timeout=120,
                   what="the operator to put its finalizer on the Tailnet")
        started = time.monotonic()
        helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s", timeout=150)
        assert time.monotonic() - started < 120
        assert not exists(cluster, "-n", NAMESPACE, "deployment", DEPLOYMENT)
        for crd in CRDS:
            assert exists(cluster, "crd", crd), f"helm uninstall deleted CRD {crd}"
        assert get_tailnet(cluster, name)["metadata"]["finalizers"], "the Tailnet stays, with its finalizer"
    finally:
        # No operator is left to remove the finalizer: the user's step after an uninstall.
        kubectl(cluster, "patch", "tailnets.tailnet.dev", name, "--type=merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False)
        kubectl(cluster, "delete", "tailnets.tailnet.dev", name, "--ignore-not-found", "--timeout=60s", check=False)
