"""The NetworkPolicy the Ingress reconciler generates, judged by cyclonus (an independent
implementation of the NetworkPolicy semantics): only the operator's pods, from the operator's
namespace, reach the agent (its health port); no pod reaches its tailnet ports (that traffic
arrives over the tailnet); the agent still reaches its backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack import binaries
from hack.netpol import Namespace, Pod, allowed
from tailnet_agent.contract.endpoints import HEALTH_PORT
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.resources import ingress as build

pytestmark = pytest.mark.integration

OPERATOR_NS, TENANT = "tailnet-system", "shop"
OPERATOR_LABELS = {"app.kubernetes.io/name": "tailnet-operator", "app.kubernetes.io/component": "controller-manager"}
OWNER = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
         "metadata": {"name": "shop", "namespace": TENANT, "uid": "u-1"}}


@pytest.fixture(scope="module", autouse=True)
def cyclonus() -> Path:
    return binaries.binary("cyclonus")


def test_only_the_operator_reaches_the_agent_and_the_agent_reaches_its_backends() -> None:
    ingress = TailnetIngress.model_validate({**OWNER, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop", "hostname": "shop",
        "exposes": [{"name": "db", "port": 5432, "backend": {"service": "postgres", "port": 5432}}]}})
    agent_spec = build.AgentSpec(image="img", control_url="https://hs.test", auth_secret="s",
                                 operator_labels=OPERATOR_LABELS)
    policy = build.network_policy(OWNER, ingress, agent_spec, OPERATOR_NS)
    agent = Pod(TENANT, "agent", build.agent_labels(ingress), (5432, HEALTH_PORT))
    pods = [agent, Pod(TENANT, "postgres", {"app": "postgres"}, (5432,)), Pod(TENANT, "client"),
            Pod("other", "client"), Pod(OPERATOR_NS, "operator", OPERATOR_LABELS),
            Pod("other", "impostor", OPERATOR_LABELS)]
    namespaces = [Namespace(n) for n in (OPERATOR_NS, TENANT, "other")]

    verdicts = allowed([policy], namespaces, pods)

    to_agent = {(src, port): ok for (src, dst, port), ok in verdicts.items() if dst == f"{TENANT}/agent"}
    assert to_agent[(f"{OPERATOR_NS}/operator", HEALTH_PORT)]
    assert not to_agent[("other/impostor", HEALTH_PORT)], "the operator's labels in another namespace"
    for src in (f"{TENANT}/client", "other/client", f"{TENANT}/postgres"):
        assert not to_agent[(src, 5432)] and not to_agent[(src, HEALTH_PORT)]
    assert not to_agent[(f"{OPERATOR_NS}/operator", 5432)]
    assert verdicts[(f"{TENANT}/agent", f"{TENANT}/postgres", 5432)], "the agent reaches its backend"
