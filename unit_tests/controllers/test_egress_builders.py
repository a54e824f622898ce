"""The pure builders of an egress's objects: the agent pod passes Pod Security `restricted`,
listen ports are stable across target changes, the targets file is deterministic, and the pod
template does not depend on the targets."""

from __future__ import annotations

import json
from typing import Any

from tailnet_agent.contract.endpoints import HEALTH_PORT, READYZ_PATH
from tailnet_agent.contract.targets import parse_targets
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.resources import agent as agent_builders
from tailnet_operator.resources import egress as build

OWNER = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
         "metadata": {"name": "db", "namespace": "tailnet-system", "uid": "u-1"}}
AGENT = build.AgentSpec(image="img:1", control_url="https://hs.test", auth_secret="db-auth-key",
                        ca_bundle="-----BEGIN CERTIFICATE-----\n", operator_labels={"app": "op"})


def egress(targets: list[dict[str, Any]], **spec: Any) -> TailnetEgress:
    return TailnetEgress.model_validate({**OWNER, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps", "web"],
        "targets": targets, **spec}})


LEDGER = {"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}, {"port": 443, "name": "https"}]}
BILLING = {"name": "billing", "address": "billing.tailnet.example.internal", "ports": [{"port": 443}]}


def test_the_agent_pod_passes_the_restricted_pod_security_standard() -> None:
    spec = build.deployment(OWNER, egress([LEDGER]), AGENT)["spec"]["template"]["spec"]
    [container] = spec["containers"]
    sc, pod_sc = container["securityContext"], spec["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and "add" not in sc["capabilities"]
    assert sc["runAsNonRoot"] is True and pod_sc["runAsNonRoot"] is True
    assert sc["seccompProfile"]["type"] == pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert {k for v in spec["volumes"] for k in v if k != "name"} <= {"configMap", "secret", "emptyDir"}
    assert spec["automountServiceAccountToken"] is False
    assert len(spec["containers"]) == 1 and not spec.get("initContainers"), "no sidecar"


def test_the_agent_container_gets_its_mode_url_files_probes_and_metrics_port() -> None:
    container = build.deployment(OWNER, egress([LEDGER], resources={"limits": {"memory": "96Mi"}}),
                                 AGENT)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["AGENT_MODE"] == "egress" and env["TAILNET_CONTROL_URL"] == "https://hs.test"
    assert env["TAILNET_TARGETS_FILE"].startswith(build.CONFIG_DIR)
    assert env["TAILNET_CA_BUNDLE"].startswith(build.CONFIG_DIR) and env["TAILNET_AUTH_KEY_FILE"]
    assert env["TAILNET_HOSTNAME"] == "db-tailnet-system"
    assert container["image"] == "img:1" and container["resources"] == {"limits": {"memory": "96Mi"}}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": HEALTH_PORT}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": HEALTH_PORT}
    assert container["ports"] == [{"name": "metrics", "containerPort": HEALTH_PORT, "protocol": "TCP"}]
    assert all("subPath" not in m for m in container["volumeMounts"]), "subPath mounts never update"


def test_the_pod_template_does_not_depend_on_the_targets() -> None:
    one = build.deployment(OWNER, egress([LEDGER]), AGENT)
    other = build.deployment(OWNER, egress([BILLING, LEDGER]), AGENT)
    assert one == other


def test_a_new_tag_changes_the_pod_template_so_the_agent_registers_again() -> None:
    """A pod reads its pre-auth key once and keeps its node: without a template change, a retagged
    egress kept its agent on the old tag (found by hack/chaos.py: a node with the tag of no CR)."""
    before = build.deployment(OWNER, egress([LEDGER]), AGENT)["spec"]["template"]
    after = build.deployment(OWNER, egress([LEDGER], tag="tag:egress-db2"), AGENT)["spec"]["template"]
    assert before["metadata"]["annotations"] == {"tailnet.dev/tag": "tag:egress-db"}
    assert after["metadata"]["annotations"] == {"tailnet.dev/tag": "tag:egress-db2"}
    assert before["metadata"]["labels"] == after["metadata"]["labels"]


def test_listen_ports_stay_put_when_other_targets_come_and_go() -> None:
    first = build.listen_ports(egress([LEDGER]), {})
    assert first == {("ledger", 5432): 10000, ("ledger", 443): 10001}
    second = build.listen_ports(egress([BILLING, LEDGER]), first)
    assert second[("ledger", 5432)] == 10000 and second[("ledger", 443)] == 10001
    assert second[("billing", 443)] == 10002
    third = build.listen_ports(egress([BILLING]), second)
    assert third == {("billing", 443): 10002}


def test_the_targets_file_is_deterministic_and_what_the_agent_parses() -> None:
    e = egress([LEDGER, BILLING])
    ports = build.listen_ports(e, {})
    cm = build.config_map(OWNER, e, ports, "ca")
    assert cm == build.config_map(OWNER, e, dict(reversed(list(ports.items()))), "ca")
    parsed = parse_targets(cm["data"]["targets.json"])
    assert [(t.name, t.address, [(p.port, p.listen) for p in t.ports]) for t in parsed] == [
        ("ledger", "198.18.1.10", [(5432, 10000), (443, 10001)]),
        ("billing", "billing.tailnet.example.internal", [(443, 10002)])]
    assert build.previous_listen_ports(cm) == ports
    assert build.previous_listen_ports({"data": {"targets.json": "not json"}}) == {}


def test_a_target_service_exposes_the_targets_ports_on_the_agents_listeners() -> None:
    e = egress([LEDGER])
    svc = build.target_service(OWNER, e, "ledger", build.listen_ports(e, {}))
    assert svc["metadata"]["name"] == "ledger" and svc["metadata"]["namespace"] == "tailnet-system"
    assert svc["spec"]["selector"] == build.agent_labels(e) and svc["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("tcp-5432", 5432, 10000), ("https", 443, 10001)]
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert json.dumps(svc)  # plain JSON, ready to apply


def test_a_rollout_surges_and_a_stopping_agent_waits_for_its_endpoint_to_go_then_drains() -> None:
    """Issue 24: the new pod is ready before the old one stops; the old one keeps serving through
    a preStop ``sleep`` (no shell in the image) and has the grace to drain after it."""
    deployment = build.deployment(OWNER, egress([LEDGER]), AGENT)
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": agent_builders.PRE_STOP_SECONDS}}}
    assert "exec" not in container["lifecycle"]["preStop"]
    assert pod["terminationGracePeriodSeconds"] > agent_builders.PRE_STOP_SECONDS + agent_builders.DRAIN_SECONDS
    assert container["readinessProbe"]["httpGet"] == {"path": READYZ_PATH, "port": HEALTH_PORT}
    assert "topologySpreadConstraints" not in pod, "one replica: nothing to spread"
