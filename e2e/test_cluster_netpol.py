"""A NetworkPolicy that admits one namespace, as the cluster stores it: cyclonus (an independent
implementation of the semantics) shows it admits that namespace and refuses another. Where the
cluster enforces NetworkPolicy (kind, under ``make e2e``), real connections prove the same."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.cluster import (
    HTTP_SERVER,
    SLEEPER,
    TestCluster,
    apply,
    exec_python,
    get_json,
    http_get_code,
    namespace,
    python_pod,
    wait_pod_running,
)
from hack import netpol
from hack.localenv import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e]


def admit_namespace(ns: str, team: str) -> dict[str, Any]:
    """Ingress to app=api on 8080 only from namespaces labelled ``team``."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "api-from-team", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": "api"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": team}}}],
                              "ports": [{"protocol": "TCP", "port": 8080}]}]},
    }


def _model(cluster: TestCluster, namespaces: list[str]) -> tuple[list[netpol.Namespace], list[netpol.Pod]]:
    """Namespaces and pods as the cluster has them (labels, addresses, ports)."""
    spaces, pods = [], []
    for ns in namespaces:
        spaces.append(netpol.Namespace(ns, get_json(cluster, "namespace", ns)["metadata"].get("labels", {})))
        for pod in get_json(cluster, "-n", ns, "pods")["items"]:
            ports = tuple(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []))
            pods.append(netpol.Pod(ns, pod["metadata"]["name"], pod["metadata"].get("labels", {}), ports,
                                   ip=pod["status"].get("podIP", "")))
    return spaces, pods


def test_a_policy_admitting_one_namespace_refuses_another(cluster: TestCluster, project_image: Any) -> None:
    with namespace(cluster, "np-api") as api_ns, \
            namespace(cluster, "np-front", labels={"team": "frontend"}) as front_ns, \
            namespace(cluster, "np-other", labels={"team": "other"}) as other_ns:
        apply(cluster, [
            python_pod("api", api_ns, project_image.ref, HTTP_SERVER, labels={"app": "api"}, port=8080),
            python_pod("client", front_ns, project_image.ref, SLEEPER),
            python_pod("client", other_ns, project_image.ref, SLEEPER),
            admit_namespace(api_ns, "frontend"),
        ])
        for ns, pod in ((api_ns, "api"), (front_ns, "client"), (other_ns, "client")):
            wait_pod_running(cluster, ns, pod)

        stored = get_json(cluster, "-n", api_ns, "networkpolicy", "api-from-team")
        spaces, pods = _model(cluster, [api_ns, front_ns, other_ns])
        verdicts = netpol.allowed([stored], spaces, pods)
        api = f"{api_ns}/api"
        assert verdicts[(f"{front_ns}/client", api, 8080)] is True
        assert verdicts[(f"{other_ns}/client", api, 8080)] is False
        # Without the policy both would be admitted: the verdict is the policy's doing.
        assert netpol.allowed([], spaces, pods)[(f"{other_ns}/client", api, 8080)] is True

        if not cluster.enforces_network_policy:
            return
        ip = get_json(cluster, "-n", api_ns, "pod", "api")["status"]["podIP"]
        url = f"http://{ip}:8080/"
        wait_until(lambda: exec_python(cluster, front_ns, "client", http_get_code(url)), timeout=60,
                   what="the admitted namespace to connect")
        refused = exec_python(cluster, other_ns, "client", f"""
try:
{_indent(http_get_code(url, timeout=3))}
    print("connected")
except OSError as exc:
    print("refused", exc)
""")
        assert refused.startswith("refused"), refused


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.strip().splitlines())
