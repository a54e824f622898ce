"""Fetched objects for the CLI's tests: a healthy TailnetEgress and its chain (Tailnet, agent pod,
Headscale nodes and policy), each builder taking the changes a test breaks it with."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tailnet_operator.cli.facts import Facts, HeadscaleView
from tailnet_operator.headscale import Node

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TAG = "tag:egress-db"
GOOD_POLICY = ('{"tagOwners": {"tag:egress-db": [], "tag:router": []}, '
               '"grants": [{"src": ["tag:egress-db"], "dst": ["198.18.1.0/24"], "ip": ["5432"]}]}')


def iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def egress(**status: Any) -> dict[str, Any]:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": "db", "namespace": "tailnet-system"},
            "spec": {"tailnetRef": {"name": "home"}, "tag": TAG, "consumerNamespaces": ["apps"],
                     "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "ok"}],
                       "node": {"id": "9", "name": "db-tailnet-system"},
                       "preAuthKey": {"prefix": "abcd****", "expiresAt": iso(NOW + timedelta(hours=20)),
                                      "nextRotationAt": iso(NOW + timedelta(hours=8))},
                       **status}}


def tailnet(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "tailnet.dev/v1alpha1", "kind": "Tailnet", "metadata": {"name": "home"},
        "spec": {"apiURL": "https://headscale.example:8443", "loginURL": "https://headscale.example:8443"},
        "status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "Connected", "message": "v0.29.2"},
            {"type": "Reachable", "status": "True", "reason": "Connected", "message": ""},
            {"type": "KeyValid", "status": "True", "reason": "KeyValid", "message": ""}],
            "serverVersion": "v0.29.2",
            "apiKey": {"prefix": "wk12", "expiresAt": iso(NOW + timedelta(days=20))}}}
    obj["status"].update(changes)
    return obj


def pod(ready: bool = True, waiting: str = "") -> dict[str, Any]:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"kind": "Pod", "metadata": {"name": "db-egress-agent-5c2a", "namespace": "tailnet-system"},
            "status": {"phase": "Running" if ready else "Pending", "podIP": "198.19.64.9",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "agent", "state": state, "restartCount": 0 if ready else 4}]}}


def node(node_id: str = "9", *, tags: tuple[str, ...] = (TAG,), online: bool = True,
         advertised: tuple[str, ...] = (), approved: tuple[str, ...] = (), name: str = "db-tailnet-system") -> Node:
    return Node.from_json({"id": node_id, "name": name, "givenName": name, "tags": list(tags), "online": online,
                           "ipAddresses": [f"100.64.0.{node_id}"], "availableRoutes": list(advertised),
                           "approvedRoutes": list(approved), "lastSeen": iso(NOW - timedelta(seconds=30))})


ROUTER = node("3", tags=("tag:router",), advertised=("198.18.1.0/24",), approved=("198.18.1.0/24",),
              name="branch-router")


def view(*nodes: Node, policy: str = GOOD_POLICY) -> HeadscaleView:
    return HeadscaleView(nodes=nodes or (node(), ROUTER), policy=policy, version="v0.29.2")


def facts(**changes: Any) -> Facts:
    base: dict[str, Any] = {"now": NOW, "obj": egress(), "tailnet": tailnet(), "pods": (pod(),), "headscale": view()}
    base.update(changes)
    return Facts(**base)
