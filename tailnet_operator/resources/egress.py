"""Pure builders of what one TailnetEgress owns: desired state in, manifest dicts out.

The agent Deployment's pod template depends only on what needs a new process (image, control
URL, hostname, resources, whether a CA is set); the targets live in a mounted ConfigMap the
agent reloads, so adding, changing or removing a target never restarts the pod.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.contract.targets import PortMapping, Target, parse_targets
from tailnet_agent.contract.targets import targets_document as agent_targets_document
from tailnet_operator import names
from tailnet_operator.api.egress import TailnetEgress

from . import agent as pod
from .agent import CA_FILE, CONFIG_DIR, AgentSpec

__all__ = [
    "CONFIG_DIR",
    "FIRST_LISTEN_PORT",
    "AgentSpec",
    "agent_labels",
    "agent_name",
    "agent_service",
    "config_map",
    "config_map_name",
    "deployment",
    "disruption_budget",
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

FIRST_LISTEN_PORT = 10000
"""Listen ports are handed out from here, so two targets on the same port never collide."""
TARGETS_FILE = "targets.json"


def _name(egress: TailnetEgress) -> str:
    return str(egress.metadata.name)


def _namespace(egress: TailnetEgress) -> str:
    return str(egress.metadata.namespace)


def agent_labels(egress: TailnetEgress) -> dict[str, str]:
    """The agent pod's labels: what its Service(s) and NetworkPolicy select."""
    return pod.labels("egress", _name(egress))


def owned_metadata(owner: Obj, egress: TailnetEgress, name: str) -> Obj:
    """metadata of an object the egress owns: its labels and the CR as controller."""
    return pod.owned_metadata(owner, name=name, labels=agent_labels(egress), tailnet=egress.spec.tailnet_ref.name)


def agent_name(egress: TailnetEgress) -> str:
    return names.agent_name("TailnetEgress", _name(egress))


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
        targets = parse_targets(text) if isinstance(text, str) and text else ()
    except ConfigError:
        return {}
    return {(t.name, p.port): p.listen for t in targets for p in t.ports}


def targets_document(egress: TailnetEgress, ports: ListenPorts) -> str:
    """The agent's targets file (:mod:`tailnet_agent.contract.targets`), stable for equal input."""
    return agent_targets_document(
        Target(name=t.name, address=str(t.address),
               ports=tuple(PortMapping(port=p.port, listen=ports[(t.name, p.port)]) for p in t.ports))
        for t in egress.spec.targets)


# -- objects --------------------------------------------------------------------------------------


def config_map(owner: Obj, egress: TailnetEgress, ports: ListenPorts, ca_bundle: str | None) -> Obj:
    data = {TARGETS_FILE: targets_document(egress, ports)}
    if ca_bundle:
        data[CA_FILE] = ca_bundle
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": owned_metadata(owner, egress, config_map_name(egress)),
            "data": data}


def _env(egress: TailnetEgress, agent: AgentSpec) -> list[Obj]:
    return [*pod.base_env(agent, mode=env_names.EGRESS, hostname=f"{_name(egress)}-{_namespace(egress)}"),
            {"name": env_names.TARGETS_FILE, "value": f"{CONFIG_DIR}/{TARGETS_FILE}"},
            *pod.common_env(agent)]


def deployment(owner: Obj, egress: TailnetEgress, agent: AgentSpec) -> Obj:
    """``spec.replicas`` agent pods (spread over nodes when more than one); the ConfigMap and
    Secret are mounted as directories so updates reach them."""
    replicas = egress.spec.replicas
    return pod.deployment(owned_metadata(owner, egress, agent_name(egress)), agent_labels(egress), agent,
                          env=_env(egress, agent), config_map=config_map_name(egress),
                          resource_spec=egress.spec.resources, tag=egress.spec.tag, replicas=replicas)


def disruption_budget(owner: Obj, egress: TailnetEgress) -> Obj | None:
    """:func:`.agent.pod_disruption_budget` for ``spec.replicas``."""
    return pod.pod_disruption_budget(owned_metadata(owner, egress, agent_name(egress)), agent_labels(egress),
                                     egress.spec.replicas)


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
    return pod.status_service(owned_metadata(owner, egress, agent_name(egress)), agent_labels(egress))


def network_policy(owner: Obj, egress: TailnetEgress, ports: ListenPorts, agent: AgentSpec) -> Obj:
    """Only pods of ``consumerNamespaces`` reach the listeners; only the operator the health port."""
    consumers = sorted(egress.spec.consumer_namespaces)
    rules: list[Obj] = [{
        "from": [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": consumers}]}}],
        "ports": [{"protocol": "TCP", "port": port} for port in sorted(set(ports.values()))],
    }]
    rules.extend(pod.health_network_policy_rule(agent))
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(owner, egress, agent_name(egress)),
            "spec": {"podSelector": {"matchLabels": agent_labels(egress)}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def target_names(egress: TailnetEgress) -> Iterable[str]:
    return (t.name for t in egress.spec.targets)
