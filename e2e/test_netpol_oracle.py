"""hack.netpol: the NetworkPolicy verdicts of cyclonus, which the local cluster cannot enforce.

These cases pin down verdicts whose answer is known from the NetworkPolicy semantics, so that
the oracle itself (the input it is fed, the tables it is read from) is checked before the
operator's generated policies are checked with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hack import binaries
from hack.netpol import CyclonusError, Namespace, Pod, allowed

pytestmark = pytest.mark.integration

NAMESPACES = (
    Namespace("backend"),
    Namespace("frontend", {"team": "frontend"}),
    Namespace("other"),
)
API = Pod("backend", "api", {"app": "api"}, (8080, 9090))
WORKER = Pod("backend", "worker", {"app": "worker"}, (7000,))
WEB = Pod("frontend", "web", {"app": "web"}, (80,))
CLIENT = Pod("other", "client", {"app": "client"})
PODS = (API, WORKER, WEB, CLIENT)


def policy(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


API_FROM_FRONTEND = policy("backend", "api-from-frontend", {
    "podSelector": {"matchLabels": {"app": "api"}},
    "policyTypes": ["Ingress"],
    "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "frontend"}}}],
                 "ports": [{"protocol": "TCP", "port": 8080}]}],
})
DENY_ALL = policy("backend", "deny-all", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})


def every_connection(pods: tuple[Pod, ...]) -> set[tuple[str, str, int]]:
    return {(src.key, dst.key, port) for src in pods for dst in pods for port in dst.ports}


@pytest.fixture(scope="module", autouse=True)
def cyclonus() -> Path:
    """Build cyclonus once (minutes on a fresh machine) before the first verdict is asked for."""
    return binaries.binary("cyclonus")


def test_without_policies_everything_is_allowed() -> None:
    verdicts = allowed([], NAMESPACES, PODS)
    assert set(verdicts) == every_connection(PODS)
    assert all(verdicts.values())


def test_ingress_only_from_labelled_namespaces_on_one_port() -> None:
    verdicts = allowed([API_FROM_FRONTEND], NAMESPACES, PODS)

    assert set(verdicts) == every_connection(PODS)
    assert verdicts[("frontend/web", "backend/api", 8080)] is True
    assert verdicts[("other/client", "backend/api", 8080)] is False
    assert verdicts[("backend/worker", "backend/api", 8080)] is False
    assert verdicts[("frontend/web", "backend/api", 9090)] is False
    # Pods the policy does not select, and egress, stay open.
    assert verdicts[("other/client", "backend/worker", 7000)] is True
    assert verdicts[("backend/api", "frontend/web", 80)] is True
    denied = {c for c, ok in verdicts.items() if not ok}
    assert denied == {(src.key, "backend/api", port) for src in PODS for port in (8080, 9090)} - {
        ("frontend/web", "backend/api", 8080)}


def test_default_deny_all_closes_the_namespace_both_ways() -> None:
    verdicts = allowed([DENY_ALL], NAMESPACES, PODS)

    assert set(verdicts) == every_connection(PODS)
    for (src, dst, _), ok in verdicts.items():
        touches_backend = src.startswith("backend/") or dst.startswith("backend/")
        assert ok is not touches_backend, (src, dst, ok)

    # Policies add up: an allow next to the default deny opens only its own hole, and only
    # for ingress (the source's egress must be allowed too, which it is from frontend).
    both = allowed([DENY_ALL, API_FROM_FRONTEND], NAMESPACES, PODS)
    assert {c for c, ok in both.items() if ok and "backend/api" in c} == {("frontend/web", "backend/api", 8080)}


def test_egress_only_to_one_namespace_or_one_cidr() -> None:
    namespaces = (Namespace("jail"), Namespace("db"), Namespace("ext"))
    app = Pod("jail", "app", {"app": "app"}, (80,))
    peer = Pod("jail", "peer", {"app": "peer"}, (80,))
    pg = Pod("db", "pg", {"app": "pg"}, (5432,), named_ports={"postgres": 5432}, ip="10.1.0.5")
    inside = Pod("ext", "inside", {}, (443, 80), ip="10.9.0.7")
    outside = Pod("ext", "outside", {}, (443,), ip="10.9.1.7")
    pods = (app, peer, pg, inside, outside)
    egress = policy("jail", "egress", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [
            # The API server labels every namespace with its name; the model does too.
            {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "db"}}}],
             "ports": [{"protocol": "TCP", "port": "postgres"}]},
            {"to": [{"ipBlock": {"cidr": "10.9.0.0/24"}}], "ports": [{"protocol": "TCP", "port": 443}]},
        ],
    })

    verdicts = allowed([egress], namespaces, pods)

    assert set(verdicts) == every_connection(pods)
    assert verdicts[("jail/app", "db/pg", 5432)] is True
    assert verdicts[("jail/app", "ext/inside", 443)] is True
    assert verdicts[("jail/app", "ext/inside", 80)] is False
    assert verdicts[("jail/app", "ext/outside", 443)] is False
    assert verdicts[("jail/app", "jail/peer", 80)] is False
    # Egress rules of jail do not restrict what reaches jail.
    assert verdicts[("ext/outside", "jail/app", 80)] is True
    assert verdicts[("db/pg", "ext/outside", 443)] is True
    assert {c for c, ok in verdicts.items() if ok and c[0].startswith("jail/")} == {
        (src, "db/pg", 5432) for src in ("jail/app", "jail/peer")} | {
        (src, "ext/inside", 443) for src in ("jail/app", "jail/peer")}


def test_cyclonus_rejection_carries_its_message() -> None:
    typo = policy("backend", "typo", {"podSelectr": {}})
    with pytest.raises(CyclonusError, match="unknown field"):
        allowed([typo], NAMESPACES, PODS)


def test_model_errors_are_caught_before_cyclonus() -> None:
    with pytest.raises(ValueError, match="not in the model"):
        allowed([], NAMESPACES, (Pod("nowhere", "x", {}, (80,)),))
    with pytest.raises(ValueError, match=r"metadata\.namespace"):
        allowed([{"metadata": {"name": "p"}, "spec": {"podSelector": {}}}], NAMESPACES, PODS)


def test_cyclonus_never_reads_a_kubeconfig(tmp_path: Path) -> None:
    """A kubeconfig that is a FIFO blocks whoever opens it: the run would time out."""
    fifo = tmp_path / "kubeconfig"
    os.mkfifo(fifo)
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    os.mkfifo(home / ".kube" / "config")

    verdicts = allowed([API_FROM_FRONTEND], NAMESPACES, PODS,
                       env={"KUBECONFIG": str(fifo), "HOME": str(home)}, timeout=30)

    assert verdicts[("frontend/web", "backend/api", 8080)] is True
