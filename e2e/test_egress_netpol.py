"""The NetworkPolicy the Egress reconciler generates, judged by cyclonus (an independent
implementation of the NetworkPolicy semantics): consumers reach the agent's listeners, every
other namespace is denied, and only the operator reaches the health port."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack import binaries
from hack.netpol import Namespace, Pod, allowed
from tailnet_agent.contract.endpoints import HEALTH_PORT
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.resources import egress as build

pytestmark = pytest.mark.integration

OPERATOR_NS = "tailnet-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "tailnet-operator", "app.kubernetes.io/component": "controller-manager"}
OWNER = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
         "metadata": {"name": "db", "namespace": OPERATOR_NS, "uid": "u-1"}}


@pytest.fixture(scope="module", autouse=True)
def cyclonus() -> Path:
    return binaries.binary("cyclonus")


def test_only_consumer_namespaces_reach_the_agent_and_only_the_operator_its_health_port() -> None:
    egress = TailnetEgress.model_validate({**OWNER, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps", "web"],
        "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}, {"port": 443}]}]}})
    ports = build.listen_ports(egress, {})
    agent_spec = build.AgentSpec(image="img", control_url="https://hs.test", auth_secret="s",
                                 operator_labels=OPERATOR_LABELS)
    policy = build.network_policy(OWNER, egress, ports, agent_spec)
    listeners = tuple(sorted(ports.values()))
    agent = Pod(OPERATOR_NS, "agent", build.agent_labels(egress), (*listeners, HEALTH_PORT))
    pods = [agent, Pod("apps", "client"), Pod("web", "client"), Pod("other", "client"),
            Pod(OPERATOR_NS, "operator", OPERATOR_LABELS), Pod(OPERATOR_NS, "stranger")]
    namespaces = [Namespace(n) for n in (OPERATOR_NS, "apps", "web", "other")]

    verdicts = allowed([policy], namespaces, pods)

    to_agent = {(src, port): ok for (src, dst, port), ok in verdicts.items() if dst == f"{OPERATOR_NS}/agent"}
    for port in listeners:
        assert to_agent[("apps/client", port)] and to_agent[("web/client", port)]
        assert not to_agent[("other/client", port)]
        assert not to_agent[(f"{OPERATOR_NS}/stranger", port)]
    assert to_agent[(f"{OPERATOR_NS}/operator", HEALTH_PORT)]
    assert not to_agent[("apps/client", HEALTH_PORT)]
    assert not to_agent[(f"{OPERATOR_NS}/stranger", HEALTH_PORT)]


def test_the_namespace_prometheus_runs_in_reaches_only_the_health_port() -> None:
    egress = TailnetEgress.model_validate({**OWNER, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}})
    ports = build.listen_ports(egress, {})
    agent_spec = build.AgentSpec(image="img", control_url="https://hs.test", auth_secret="s",
                                 operator_labels=OPERATOR_LABELS,
                                 metrics_namespaces={"kubernetes.io/metadata.name": "monitoring"})
    policy = build.network_policy(OWNER, egress, ports, agent_spec)
    listeners = tuple(sorted(ports.values()))
    agent = Pod(OPERATOR_NS, "agent", build.agent_labels(egress), (*listeners, HEALTH_PORT))
    pods = [agent, Pod("monitoring", "prometheus"), Pod("apps", "client"), Pod("other", "client")]
    namespaces = [Namespace(n) for n in (OPERATOR_NS, "monitoring", "apps", "other")]

    verdicts = allowed([policy], namespaces, pods)

    to_agent = {(src, port): ok for (src, dst, port), ok in verdicts.items() if dst == f"{OPERATOR_NS}/agent"}
    assert to_agent[("monitoring/prometheus", HEALTH_PORT)]
    assert not any(to_agent[("monitoring/prometheus", port)] for port in listeners)
    assert not to_agent[("other/client", HEALTH_PORT)]
    assert not to_agent[("apps/client", HEALTH_PORT)]
