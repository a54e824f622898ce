"""A NetworkPolicy that admits one namespace, as the cluster stores it: cyclonus (an independent
implementation of the semantics) shows it admits that namespace and refuses another. Where the
cluster enforces NetworkPolicy (kind, under ``make e2e``), real connections prove the same; the
local node has no NetworkPolicy implementation, so there that test skips (by design) with its
reason."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import (
    HTTP_SERVER,
    SLEEPER,
    ClusterUnderTest,
    apply,
    exec_python,
    get_json,
    http_get_code,
    namespace,
    python_pod,
    wait_pod_running,
)
from e2e.skips import skip_by_design
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


def _model(cluster: ClusterUnderTest, namespaces: list[str]) -> tuple[list[netpol.Namespace], list[netpol.Pod]]:
    """Namespaces and pods as the cluster has them (labels, addresses, ports)."""
    spaces, pods = [], []
    for ns in namespaces:
        spaces.append(netpol.Namespace(ns, get_json(cluster, "namespace", ns)["metadata"].get("labels", {})))
        for pod in get_json(cluster, "-n", ns, "pods")["items"]:
            ports = tuple(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []))
            pods.append(netpol.Pod(ns, pod["metadata"]["name"], pod["metadata"].get("labels", {}), ports,
                                   ip=pod["status"].get("podIP", "")))
    return spaces, pods


@contextlib.contextmanager
def _policy_and_pods(cluster: ClusterUnderTest, image: str) -> Iterator[tuple[str, str, str]]:
    """The API pod (with the policy admitting ``team=frontend``) and a client in an admitted and
    in another namespace, all running: the namespaces (api, admitted, other)."""
    with namespace(cluster, "np-api") as api_ns, \
            namespace(cluster, "np-front", labels={"team": "frontend"}) as front_ns, \
            namespace(cluster, "np-other", labels={"team": "other"}) as other_ns:
        apply(cluster, [
            python_pod("api", api_ns, image, HTTP_SERVER, labels={"app": "api"}, port=8080),
            python_pod("client", front_ns, image, SLEEPER),
            python_pod("client", other_ns, image, SLEEPER),
            admit_namespace(api_ns, "frontend"),
        ])
        for ns, pod in ((api_ns, "api"), (front_ns, "client"), (other_ns, "client")):
            wait_pod_running(cluster, ns, pod)
        yield api_ns, front_ns, other_ns


def test_a_policy_admitting_one_namespace_refuses_another(cluster: ClusterUnderTest, project_image: Any) -> None:
    with _policy_and_pods(cluster, project_image.ref) as (api_ns, front_ns, other_ns):
        stored = get_json(cluster, "-n", api_ns, "networkpolicy", "api-from-team")
        spaces, pods = _model(cluster, [api_ns, front_ns, other_ns])
        verdicts = netpol.allowed([stored], spaces, pods)
        api = f"{api_ns}/api"
        assert verdicts[(f"{front_ns}/client", api, 8080)] is True
        assert verdicts[(f"{other_ns}/client", api, 8080)] is False
        # Without the policy both would be admitted: the verdict is the policy's doing.
        assert netpol.allowed([], spaces, pods)[(f"{other_ns}/client", api, 8080)] is True


def test_the_cluster_refuses_the_namespace_the_policy_does_not_admit(cluster: ClusterUnderTest,
                                                                     project_image: Any) -> None:
    if not cluster.enforces_network_policy:
        skip_by_design(f"{type(cluster).__name__} does not enforce NetworkPolicy (the local node has no "
                       "NetworkPolicy implementation); the policy's verdicts are checked by cyclonus above")
    with _policy_and_pods(cluster, project_image.ref) as (api_ns, front_ns, other_ns):
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
