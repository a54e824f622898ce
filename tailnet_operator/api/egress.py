"""TailnetEgress: one tagged tailnet identity that lets in-cluster consumers reach off-cluster targets."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, model_validator

from tailnet_operator.api.common import (
    Address,
    ApiModel,
    Conditions,
    DNS1035Label,
    DNSLabel,
    DNSName,
    Generation,
    IPAddress,
    ObjectMeta,
    Port,
    Quantity,
    Tag,
    TailnetRef,
    Timestamp,
    cel,
    duplicates,
    validations,
)

PORT_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_REPLICAS = 10
"""Agents of one egress: each is a node on the tailnet and a long poll on Headscale, so more buys
no availability worth that load (a connection uses one agent; two already survive a drain)."""


class TargetPort(ApiModel):
    """A TCP port of a target, exposed with the same number on the target's Service."""

    port: Port = Field(description="Port number on the target and on its Service.")
    protocol: Literal["TCP"] = Field(
        default="TCP",
        description="Transport protocol; the userspace agent forwards TCP only. Defaults to TCP.",
    )
    name: str | None = Field(
        default=None,
        max_length=15,
        pattern=PORT_NAME_PATTERN,
        description="Optional IANA-style name of the Service port, e.g. postgres.",
    )


class EgressTarget(ApiModel):
    """An off-cluster endpoint reached over the tailnet through its own Service."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.ports.all(p, !has(p.name)"
                " || self.ports.exists_one(q, has(q.name) && q.name == p.name))",
                "port names must be unique within a target",
                ".ports",
            )
        )
    )

    name: DNS1035Label = Field(
        description="Name of the target and of its Service: consumers dial <name>.<namespace>.svc:<port>."
    )
    address: Address = Field(
        description=(
            "IP address or DNS name of the target as reachable on the tailnet (e.g. behind a subnet router)."
        )
    )
    ports: list[TargetPort] = Field(
        min_length=1,
        max_length=16,
        description="Ports to forward.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["port"]},
    )
    aliases: list[DNSName] | None = Field(
        default=None,
        max_length=16,
        description=(
            "Real host names consumers may dial instead of the Service name, for far ends that route by "
            "SNI or Host; they resolve to the Service through the Tailnet's DNS hosts file."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if dups := duplicates([p.name for p in self.ports if p.name is not None]):
            raise ValueError(f"ports: port names must be unique within a target: {dups}")
        if dups := duplicates([str(p.port) for p in self.ports]):
            raise ValueError(f"ports: duplicate port {dups}")
        return self


class AgentResources(ApiModel):
    """Compute resources of the agent container."""

    requests: dict[str, Quantity] | None = Field(
        default=None, max_length=8, description="Minimum resources, e.g. cpu: 50m, memory: 64Mi."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, max_length=8, description="Maximum resources, e.g. memory: 128Mi."
    )


class TailnetEgressSpec(ApiModel):
    """Desired state of a TailnetEgress."""

    tailnet_ref: TailnetRef = Field(description="The Tailnet to join.")
    tag: Tag = Field(
        description=(
            "The ACL tag of this egress node; the policy's grants for the tag decide what it may reach."
        )
    )
    consumer_namespaces: list[DNSLabel] = Field(
        min_length=1,
        max_length=64,
        description="Namespaces whose Pods may connect to the target Services (enforced by a NetworkPolicy).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    targets: list[EgressTarget] = Field(
        min_length=1,
        max_length=64,
        description="Off-cluster endpoints to reach; each gets its own Service.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    resources: AgentResources | None = Field(default=None, description="Compute resources of the agent Pod.")
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description=(
            "Number of agent Pods, each its own ephemeral tailnet node with the egress's tag, behind the "
            "same target Services. With 2 or more the agents get a PodDisruptionBudget (at most one "
            "evicted at a time) and are spread over nodes, so a node drain loses nothing; 2 is "
            f"recommended for production. Defaults to 1; at most {MAX_REPLICAS}."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if dups := duplicates([t.name for t in self.targets]):
            raise ValueError(f"targets: duplicate target name {dups}")
        return self


class NodeStatus(ApiModel):
    """The tailnet node that represents this object."""

    id: str | None = Field(default=None, max_length=64, description="Headscale node ID.")
    name: str | None = Field(default=None, max_length=253, description="Node name on the tailnet.")
    addresses: list[IPAddress] | None = Field(
        default=None, max_length=8, description="Tailnet IP addresses of the node."
    )


class PreAuthKeyStatus(ApiModel):
    """The reusable ephemeral pre-auth key the agent registers with (never the key itself)."""

    id: str | None = Field(default=None, max_length=64, description="Headscale ID of the key.")
    prefix: str | None = Field(default=None, max_length=64, description="Masked key, safe to show and log.")
    expires_at: Timestamp | None = Field(default=None, description="When the key expires.")
    next_rotation_at: Timestamp | None = Field(
        default=None, description="When the operator will replace the key (half its lifetime).")


RouteState = Literal["Ready", "NotAdvertised", "NotApproved", "NoGrant", "Unresolved", "Conflict", "Unknown"]


class EgressTargetStatus(ApiModel):
    """Whether one target is reachable, and if not, why."""

    name: str = Field(max_length=63, description="Name of the target.")
    service: str | None = Field(default=None, max_length=253, description="Service consumers dial.")
    route: RouteState = Field(
        default="Unknown",
        description=(
            "Ready; NotAdvertised (no router advertises a route to the address); NotApproved (advertised "
            "but not approved); NoGrant (the policy does not let the tag reach it); Unresolved (a name that does "
            "not resolve on the tailnet); Conflict (the target's Service name is taken); Unknown. "
            "Defaults to Unknown."
        ),
    )
    router: str | None = Field(default=None, max_length=253, description="Node that routes to the address.")
    message: str | None = Field(default=None, max_length=1024, description="Details for people.")
    reachable: bool | None = Field(
        default=None, description="Whether the agent's last TCP probe of the target connected.")
    latency_ms: float | None = Field(
        default=None, ge=0, description="Connect time of the agent's last probe, in milliseconds.")
    checked_at: Timestamp | None = Field(default=None, description="When the agent last probed the target.")


class TailnetEgressStatus(ApiModel):
    """Observed state of a TailnetEgress."""

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(default=None, description="Ready and more specific conditions.")
    node: NodeStatus | None = Field(default=None, description="The agent's tailnet node.")
    pre_auth_key: PreAuthKeyStatus | None = Field(default=None, description="The agent's pre-auth key.")
    targets: list[EgressTargetStatus] | None = Field(
        default=None,
        max_length=64,
        description="Route state of every target.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class TailnetEgress(ApiModel):
    """Lets in-cluster consumers reach off-cluster targets over the tailnet (namespaced)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["TailnetEgress"] = "TailnetEgress"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetEgressSpec
    status: TailnetEgressStatus | None = None
