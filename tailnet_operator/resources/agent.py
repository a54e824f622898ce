"""What every agent Deployment has in common, whichever CR it serves (TailnetEgress, TailnetIngress).

One agent pod per CR (an egress may ask for more, ``spec.replicas``): one container running
``/tailnet-agent`` in the mode the CR needs, under
Pod Security ``restricted`` (non-root, read-only root filesystem, no capabilities, the runtime's
seccomp profile, no service account token), with probes and a metrics port on its health server,
its pre-auth key mounted from a Secret and everything it reloads mounted as directories (never
``subPath``, whose files never update). The mode's builders add the env and volumes of their own.

Rollouts leave no gap: the Deployment surges (the new pod is ready before the old one is told to
stop), and a stopping pod keeps serving through a ``preStop`` sleep while its endpoint leaves the
Services, then drains within the grace period (docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract.endpoints import HEALTH_PORT, HEALTHZ_PATH, READYZ_PATH
from tailnet_operator.api.egress import AgentResources

from . import http_probe, restricted_pod_security_context, restricted_security_context
from . import owned_metadata as shared_owned_metadata

__all__ = [
    "AGENT_UID",
    "AUTH_DIR",
    "CONFIG_DIR",
    "DEFAULT_RESOURCES",
    "DRAIN_SECONDS",
    "PRE_STOP_SECONDS",
    "ROLLING_UPDATE",
    "TERMINATION_GRACE_SECONDS",
    "AgentSpec",
    "base_env",
    "common_env",
    "deployment",
    "health_network_policy_rule",
    "labels",
    "owned_metadata",
    "pod_disruption_budget",
    "status_service",
    "topology_spread",
]

Obj = dict[str, Any]

CONFIG_DIR = "/etc/tailnet-agent/config"
AUTH_DIR = "/etc/tailnet-agent/auth"
CA_FILE = "ca.crt"
AGENT_UID = 65532
TAG_ANNOTATION = "tailnet.dev/tag"
"""On the agent's pod template: the tag its node registers with. A pod reads its pre-auth key once
and keeps its node, so a new tag must start a new pod; the annotation makes the Deployment roll."""
DEFAULT_RESOURCES: Obj = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}

PRE_STOP_SECONDS = 10
"""How long a terminating agent keeps serving before it gets SIGTERM: the time for the Endpoints
(EndpointSlice) change to reach every kube-proxy (and the Service's clients) so no new connection
is sent to a pod that is about to stop. A ``sleep`` lifecycle action, not a shell: the image has none."""
DRAIN_SECONDS = 30
"""The agent's drain deadline after SIGTERM (``TAILNET_DRAIN_TIMEOUT``, set on every agent): how long
in-flight connections may take to finish before it logs out and exits."""
GRACE_MARGIN_SECONDS = 5
"""Room after the drain for the logout and the process's exit."""
TERMINATION_GRACE_SECONDS = PRE_STOP_SECONDS + DRAIN_SECONDS + GRACE_MARGIN_SECONDS
"""The pod's ``terminationGracePeriodSeconds``: kubelet counts the preStop in it, so it covers the
preStop, the drain and the margin before SIGKILL."""
ROLLING_UPDATE: Obj = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
"""A new agent pod starts, registers and turns ready before an old one is told to stop, so a
rollout of one replica never leaves the Service without a ready endpoint."""


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


def labels(component: str, name: str) -> dict[str, str]:
    """The labels of the agent pod of the ``component`` (egress, ingress) CR ``name``: what its
    Services and NetworkPolicy select."""
    return {"app.kubernetes.io/name": "tailnet-agent", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, f"tailnet.dev/{component}": name}


def owned_metadata(owner: Obj, *, name: str, labels: dict[str, str], tailnet: str) -> Obj:
    """metadata of an object an agent's CR owns, beside the CR: its labels and the CR as controller."""
    return shared_owned_metadata(owner, name=name, namespace=owner["metadata"]["namespace"], tailnet=tailnet,
                                 labels=labels)


def base_env(agent: AgentSpec, *, mode: str, hostname: str) -> list[Obj]:
    """The variables every agent needs (names: :mod:`tailnet_agent.contract.environment`)."""
    env = [{"name": env_names.AGENT_MODE, "value": mode},
           {"name": env_names.CONTROL_URL, "value": agent.control_url},
           {"name": env_names.HOSTNAME, "value": hostname},
           {"name": env_names.AUTH_KEY_FILE, "value": f"{AUTH_DIR}/authKey"}]
    return env


def common_env(agent: AgentSpec) -> list[Obj]:
    """The variables after the mode's own: health address, log format, drain deadline and the CA bundle."""
    env = [{"name": env_names.HEALTH_ADDRESS, "value": f"0.0.0.0:{HEALTH_PORT}"},
           {"name": env_names.LOG_FORMAT, "value": "json"},
           {"name": env_names.DRAIN_TIMEOUT, "value": str(DRAIN_SECONDS)}]
    if agent.ca_bundle:
        env.append({"name": env_names.CA_BUNDLE, "value": f"{CONFIG_DIR}/{CA_FILE}"})
    return env


def resources(spec: AgentResources | None) -> Obj:
    if spec is None or not (spec.requests or spec.limits):
        return DEFAULT_RESOURCES
    out: Obj = {}
    if spec.requests:
        out["requests"] = {k: str(v) for k, v in spec.requests.items()}
    if spec.limits:
        out["limits"] = {k: str(v) for k, v in spec.limits.items()}
    return out


def deployment(metadata: Obj, labels: dict[str, str], agent: AgentSpec, *, env: list[Obj], config_map: str,
               resource_spec: AgentResources | None = None, volumes: list[Obj] | None = None,
               mounts: list[Obj] | None = None, tag: str | None = None, replicas: int = 1) -> Obj:
    """``replicas`` agent pods: the ConfigMap at :data:`CONFIG_DIR`, the key Secret at :data:`AUTH_DIR`,
    a small ``/tmp``, plus ``volumes``/``mounts`` of the mode (all read-only directories); ``tag``
    (the node's) goes in the pod template's :data:`TAG_ANNOTATION`, so a changed tag rolls the pod.

    Rollouts surge (:data:`ROLLING_UPDATE`), a stopping pod first waits :data:`PRE_STOP_SECONDS`
    for endpoint propagation and then drains within :data:`TERMINATION_GRACE_SECONDS`; more than one
    replica asks the scheduler to put them on different nodes (soft: ``ScheduleAnyway``)."""
    container = {
        "name": "agent", "image": agent.image, "imagePullPolicy": "IfNotPresent", "command": ["/tailnet-agent"],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        "livenessProbe": http_probe(HEALTHZ_PATH, HEALTH_PORT, 20),
        "readinessProbe": http_probe(READYZ_PATH, HEALTH_PORT, 5),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "resources": resources(resource_spec),
        "securityContext": restricted_security_context(AGENT_UID),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True},
                         *(mounts or []),
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    template_metadata: Obj = {"labels": labels}
    if tag:
        template_metadata["annotations"] = {TAG_ANNOTATION: tag}
    pod_spec: Obj = {
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": restricted_pod_security_context(AGENT_UID),
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": config_map}},
                    {"name": "auth", "secret": {"secretName": agent.auth_secret}},
                    *(volumes or []),
                    {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
    }
    if replicas > 1:
        pod_spec["topologySpreadConstraints"] = [topology_spread(labels)]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels}, "strategy": ROLLING_UPDATE,
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }


def topology_spread(labels: dict[str, str]) -> Obj:
    """Replicas on different nodes where the scheduler can (a drain then takes one, not all); soft,
    so a one-node cluster still runs them all."""
    return {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(labels)}}


def pod_disruption_budget(metadata: Obj, labels: dict[str, str], replicas: int) -> Obj | None:
    """At most one agent pod evicted at a time (a drain waits for its replacement to be ready); None
    with one replica: a budget of one pod would only block node drains, and a single agent loses its
    connections anyway."""
    if replicas < 2:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(labels)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def status_service(metadata: Obj, labels: dict[str, str]) -> Obj:
    """The agent's health port as a Service: the operator reads /status there, Prometheus /metrics."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"type": "ClusterIP", "selector": labels,
                     "ports": [{"name": "metrics", "port": HEALTH_PORT, "protocol": "TCP",
                                "targetPort": HEALTH_PORT}]}}


def health_network_policy_rule(agent: AgentSpec, operator_namespace: str | None = None) -> list[Obj]:
    """The ingress rules that admit the operator's pods to the health port (none without labels)
    and the pods of the metrics namespaces to its /metrics (none without a selector);
    ``operator_namespace`` when the agent runs in another namespace than the operator."""
    rules: list[Obj] = []
    if agent.operator_labels:
        peer: Obj = {"podSelector": {"matchLabels": agent.operator_labels}}
        if operator_namespace:
            peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}
        rules.append({"from": [peer], "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]})
    if agent.metrics_namespaces:
        rules.append({"from": [{"namespaceSelector": {"matchLabels": dict(agent.metrics_namespaces)}}],
                      "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]})
    return rules
