"""Egress replicas against kube-apiserver (its defaulting, its PodDisruptionBudget validation and its
garbage collector) and Headscale, the operator running from source; no node, so no agent pod runs.

Issue 24: an egress gets one agent by default; with ``spec.replicas: 2`` its Deployment runs two,
spread over nodes, behind a PodDisruptionBudget that lets a drain evict one at a time; back to 1
the budget is pruned.
"""

from __future__ import annotations

import pytest

from e2e.cluster import OPEN_BASE
from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.controllers.policy import POLICY_KEY
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, DEPLOYMENT, POD_DISRUPTION_BUDGET, Resource

from .operator import create_bootstrap_secret, running_operator, tailnet_object
from .polling import eventually

pytestmark = pytest.mark.integration

TAG = "tag:egress-replicas"


def egress_object(name: str, namespace: str, tailnet: str) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": TAG, "consumerNamespaces": ["apps"],
                     "targets": [{"name": "replicas-db", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}}


async def _get(admin: Client, resource: Resource, name: str, namespace: str) -> JSON | None:
    try:
        return await admin.get(resource, name, namespace)
    except NotFound:
        return None


async def test_two_replicas_get_a_disruption_budget_and_spread_and_back_to_one_lose_the_budget(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
) -> None:
    namespace, tailnet = operator_namespace, f"{operator_namespace}-tn"
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                   "data": {POLICY_KEY: OPEN_BASE}})
    policy = {"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": POLICY_KEY}, "mode": "Apply"}
    stored = await admin.create(TAILNET_EGRESS, egress_object("db", namespace, tailnet), namespace)
    assert stored["spec"]["replicas"] == 1, "the API server defaults spec.replicas to 1"
    try:
        async with running_operator(control_plane.kubeconfig, namespace):
            await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy=policy))

            async def deployment_with(replicas: int) -> JSON | None:
                found = await _get(admin, DEPLOYMENT, "db-egress-agent", namespace)
                return found if found and found["spec"]["replicas"] == replicas else None

            one = await eventually(lambda: deployment_with(1), timeout=90, what="the agent Deployment, 1 replica")
            assert one["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
            assert one["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
            assert await _get(admin, POD_DISRUPTION_BUDGET, "db-egress-agent", namespace) is None

            await admin.merge_patch(TAILNET_EGRESS, "db", {"spec": {"replicas": 2}}, namespace)
            two = await eventually(lambda: deployment_with(2), timeout=60, what="the agent Deployment, 2 replicas")
            [spread] = two["spec"]["template"]["spec"]["topologySpreadConstraints"]
            assert spread["topologyKey"] == "kubernetes.io/hostname"
            assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
            budget = await eventually(lambda: _get(admin, POD_DISRUPTION_BUDGET, "db-egress-agent", namespace),
                                      timeout=60, what="the agents' PodDisruptionBudget")
            assert budget["spec"]["maxUnavailable"] == 1
            assert budget["spec"]["selector"] == two["spec"]["selector"]
            assert budget["metadata"]["ownerReferences"][0]["uid"] == stored["metadata"]["uid"]

            await admin.merge_patch(TAILNET_EGRESS, "db", {"spec": {"replicas": 1}}, namespace)
            await eventually(lambda: deployment_with(1), timeout=60, what="the agent Deployment back to 1 replica")

            async def budget_gone() -> bool:
                return await _get(admin, POD_DISRUPTION_BUDGET, "db-egress-agent", namespace) is None

            await eventually(budget_gone, timeout=60, what="the PodDisruptionBudget pruned at 1 replica")
    finally:
        await admin.merge_patch(TAILNET_EGRESS, "db", {"metadata": {"finalizers": None}}, namespace)
        await admin.delete(TAILNET_EGRESS, "db", namespace)
