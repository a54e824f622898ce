"""Pure builders of what one TailnetEgress owns: desired state in, manifest dicts out.

The agent Deployment's pod template depends only on what needs a new process (image, control
URL, hostname, resources, whether a CA is set); the targets live in a mounted ConfigMap the
agent reloads, so adding, changing or removing a target never restarts the pod.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tailnet_operator.api.egress import TailnetEgress

from . import MANAGED_BY, controller_reference

__all__ = [
    "CONFIG_DIR",
    "FIRST_LISTEN_PORT",
    "HEALTH_PORT",
    "AgentSpec",
    "agent_labels",
    "agent_name",
    "agent_service",
    "config_map",
    "config_map_name",
    "deployment",
    "listen_ports",
    "network_policy",
    "owned_metadata",
    "previous_listen_ports",
    "target_names",
    "target_service",
    "targets_document",
]

Obj = dict[str, Any]
ListenPorts = dict[tuple[str, int], int]
"""(target name, target port) -> the agent's local listen port (the Service's targetPort)."""

HEALTH_PORT = 9002
"""/healthz, /readyz, /status and /metrics of the agent."""
FIRST_LISTEN_PORT = 10000
"""Listen ports are handed out from here, so two targets on the same port never collide."""
CONFIG_DIR = "/etc/tailnet-agent/config"
AUTH_DIR = "/etc/tailnet-agent/auth"
TARGETS_FILE = "targets.json"
CA_FILE = "ca.crt"
AGENT_UID = 65532
DEFAULT_RESOURCES: Obj = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


@dataclass(frozen=True)
class AgentSpec:
    """Everything the agent's Deployment depends on besides the CR."""

    image: str
    control_url: str
    auth_secret: str
    ca_bundle: str | None = None
    operator_labels: dict[str, str] = field(default_factory=dict)
    """Labels of the operator's pods, admitted to the agent's health port (it reads /status)."""
    metrics_namespaces: dict[str, str] = field(default_factory=dict)
    """Labels of the namespaces whose pods (Prometheus) may scrape the health port's /metrics."""


def _name(egress: TailnetEgress) -> str:
    return str(egress.metadata.name)


def _namespace(egress: TailnetEgress) -> str:
    return str(egress.metadata.namespace)


def agent_labels(egress: TailnetEgress) -> dict[str, str]:
    """The agent pod's labels: what its Services and NetworkPolicy select."""
    return {"app.kubernetes.io/name": "tailnet-agent", "app.kubernetes.io/instance": _name(egress),
            "app.kubernetes.io/component": "egress", "tailnet.dev/egress": _name(egress)}


def owned_metadata(owner: Obj, egress: TailnetEgress, name: str) -> Obj:
    """metadata of an object the egress owns: its labels and the CR as controller."""
    return {"name": name, "namespace": _namespace(egress),
            "labels": {**MANAGED_BY, **agent_labels(egress), "tailnet.dev/tailnet": egress.spec.tailnet_ref.name},
            "ownerReferences": [controller_reference(owner)]}


def agent_name(egress: TailnetEgress) -> str:
    return f"{_name(egress)}-egress-agent"


def config_map_name(egress: TailnetEgress) -> str:
    return f"{_name(egress)}-egress-config"


# -- listen ports ---------------------------------------------------------------------------------


def listen_ports(egress: TailnetEgress, previous: ListenPorts) -> ListenPorts:
    """A listen port per (target, port): kept from ``previous`` while the pair exists, new pairs
    take the lowest free port, so a change to one target never moves another's listener."""
    pairs = [(t.name, p.port) for t in egress.spec.targets for p in t.ports]
    kept = {pair: previous[pair] for pair in pairs if pair in previous}
    used = set(kept.values())
    candidate = FIRST_LISTEN_PORT
    for pair in pairs:
        if pair in kept:
            continue
        while candidate in used:
            candidate += 1
        kept[pair] = candidate
        used.add(candidate)
    return kept


def previous_listen_ports(config: Obj | None) -> ListenPorts:
    """The assignment in the ConfigMap as it is now (empty when it is missing or unreadable)."""
    text = ((config or {}).get("data") or {}).get(TARGETS_FILE)
    try:
        doc = json.loads(text) if text else []
        return {(str(t["name"]), int(p["port"])): int(p["listen"]) for t in doc for p in t["ports"]}
    except (ValueError, KeyError, TypeError):
        return {}


def targets_document(egress: TailnetEgress, ports: ListenPorts) -> str:
    """The agent's targets file (tailnet_agent.config), stable for equal input."""
    doc = [{"name": t.name, "address": str(t.address),
            "ports": [{"port": p.port, "listen": ports[(t.name, p.port)]} for p in t.ports]}
           for t in egress.spec.targets]
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


# -- objects --------------------------------------------------------------------------------------


def config_map(owner: Obj, egress: TailnetEgress, ports: ListenPorts, ca_bundle: str | None) -> Obj:
    data = {TARGETS_FILE: targets_document(egress, ports)}
    if ca_bundle:
        data[CA_FILE] = ca_bundle
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": owned_metadata(owner, egress, config_map_name(egress)),
            "data": data}


def _env(egress: TailnetEgress, agent: AgentSpec) -> list[Obj]:
    env = [{"name": "AGENT_MODE", "value": "egress"},
           {"name": "TAILNET_CONTROL_URL", "value": agent.control_url},
           {"name": "TAILNET_HOSTNAME", "value": f"{_name(egress)}-{_namespace(egress)}"},
           {"name": "TAILNET_AUTH_KEY_FILE", "value": f"{AUTH_DIR}/authKey"},
           {"name": "TAILNET_TARGETS_FILE", "value": f"{CONFIG_DIR}/{TARGETS_FILE}"},
           {"name": "TAILNET_HEALTH_ADDRESS", "value": f"0.0.0.0:{HEALTH_PORT}"},
           {"name": "TAILNET_LOG_FORMAT", "value": "json"}]
    if agent.ca_bundle:
        env.append({"name": "TAILNET_CA_BUNDLE", "value": f"{CONFIG_DIR}/{CA_FILE}"})
    return env


def _resources(egress: TailnetEgress) -> Obj:
    spec = egress.spec.resources
    if spec is None or not (spec.requests or spec.limits):
        return DEFAULT_RESOURCES
    out: Obj = {}
    if spec.requests:
        out["requests"] = {k: str(v) for k, v in spec.requests.items()}
    if spec.limits:
        out["limits"] = {k: str(v) for k, v in spec.limits.items()}
    return out


def _probe(path: str, period: int) -> Obj:
    return {"httpGet": {"path": path, "port": HEALTH_PORT}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": 3}


def _container(egress: TailnetEgress, agent: AgentSpec) -> Obj:
    return {
        "name": "agent", "image": agent.image, "imagePullPolicy": "IfNotPresent", "command": ["/tailnet-agent"],
        "env": _env(egress, agent),
        "ports": [{"name": "metrics", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        "livenessProbe": _probe("/healthz", 20), "readinessProbe": _probe("/readyz", 5),
        "resources": _resources(egress),
        "securityContext": {"runAsNonRoot": True, "runAsUser": AGENT_UID, "runAsGroup": AGENT_UID,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def deployment(owner: Obj, egress: TailnetEgress, agent: AgentSpec) -> Obj:
    """One agent pod; the ConfigMap and Secret are mounted as directories so updates reach it."""
    labels = agent_labels(egress)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": owned_metadata(owner, egress, agent_name(egress)),
        "spec": {
            "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "automountServiceAccountToken": False, "enableServiceLinks": False,
                "securityContext": {"runAsNonRoot": True, "runAsUser": AGENT_UID, "runAsGroup": AGENT_UID,
                                    "fsGroup": AGENT_UID, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [_container(egress, agent)],
                "volumes": [{"name": "config", "configMap": {"name": config_map_name(egress)}},
                            {"name": "auth", "secret": {"secretName": agent.auth_secret}},
                            {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
            }},
        },
    }


def target_service(owner: Obj, egress: TailnetEgress, target_name: str, ports: ListenPorts) -> Obj:
    """``<target>.<namespace>.svc``: the target's ports, each to the agent's listener for it."""
    target = next(t for t in egress.spec.targets if t.name == target_name)
    service_ports = [{"name": p.name or f"tcp-{p.port}", "port": p.port, "protocol": "TCP",
                      "targetPort": ports[(target.name, p.port)]} for p in target.ports]
    meta = owned_metadata(owner, egress, target.name)
    meta["labels"]["tailnet.dev/target"] = target.name
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": agent_labels(egress), "ports": service_ports}}


def agent_service(owner: Obj, egress: TailnetEgress) -> Obj:
    """The agent's health port as a Service: the operator reads /status there, Prometheus /metrics."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": owned_metadata(owner, egress, agent_name(egress)),
            "spec": {"type": "ClusterIP", "selector": agent_labels(egress),
                     "ports": [{"name": "metrics", "port": HEALTH_PORT, "protocol": "TCP",
                                "targetPort": HEALTH_PORT}]}}


def network_policy(owner: Obj, egress: TailnetEgress, ports: ListenPorts, agent: AgentSpec) -> Obj:
    """Only pods of ``consumerNamespaces`` reach the listeners; only the operator the health port."""
    consumers = sorted(egress.spec.consumer_namespaces)
    rules: list[Obj] = [{
        "from": [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": consumers}]}}],
        "ports": [{"protocol": "TCP", "port": port} for port in sorted(set(ports.values()))],
    }]
    if agent.operator_labels:
        rules.append({"from": [{"podSelector": {"matchLabels": agent.operator_labels}}],
                      "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]})
    if agent.metrics_namespaces:
        rules.append({"from": [{"namespaceSelector": {"matchLabels": dict(agent.metrics_namespaces)}}],
                      "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(owner, egress, agent_name(egress)),
            "spec": {"podSelector": {"matchLabels": agent_labels(egress)}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def target_names(egress: TailnetEgress) -> Iterable[str]:
    return (t.name for t in egress.spec.targets)
