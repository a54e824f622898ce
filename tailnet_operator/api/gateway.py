"""TailnetGateway: this cluster's subnet router and split-DNS resolver as one resource."""

from __future__ import annotations

import ipaddress
from typing import Literal, Self

from pydantic import ConfigDict, Field, model_validator

from tailnet_operator.api.common import (
    CIDR,
    ApiModel,
    BoundedString,
    Conditions,
    DNSName,
    Generation,
    Image,
    ObjectMeta,
    Tag,
    TailnetRef,
    Timestamp,
    cel,
    validations,
)

_IMMUTABLE_IDENTITY = "is immutable: the gateway never re-registers its node; create a new TailnetGateway"


class GatewayDNS(ApiModel):
    """The CoreDNS that serves the Tailnet's hosts file as the authoritative zone."""

    zone: DNSName = Field(description="The zone to serve, e.g. tailnet.example.internal.")
    image: Image = Field(description="CoreDNS image, e.g. registry.k8s.io/coredns/coredns:v1.12.1.")


class TailnetGatewaySpec(ApiModel):
    """Desired state of a TailnetGateway."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.advertiseLoadBalancerRange) || !has(self.siteRoutes)"
                " || !isCIDR(self.advertiseLoadBalancerRange) || self.siteRoutes.all(r, !isCIDR(r)"
                " || (!cidr(r).containsCIDR(cidr(self.advertiseLoadBalancerRange))"
                " && !cidr(self.advertiseLoadBalancerRange).containsCIDR(cidr(r))))",
                "advertiseLoadBalancerRange must not overlap siteRoutes",
                ".advertiseLoadBalancerRange",
            ),
        )
    )

    tailnet_ref: TailnetRef = Field(
        description="The Tailnet to join. Immutable.",
        json_schema_extra=validations(cel("self == oldSelf", f"tailnetRef {_IMMUTABLE_IDENTITY}")),
    )
    tag: Tag = Field(
        description="The ACL tag of the router node. Immutable.",
        json_schema_extra=validations(cel("self == oldSelf", f"tag {_IMMUTABLE_IDENTITY}")),
    )
    site_routes: list[CIDR] | None = Field(
        default=None,
        max_length=32,
        description="The site LAN networks the router advertises.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    advertise_load_balancer_range: CIDR | None = Field(
        default=None,
        description="The cluster's tailnet LoadBalancer range to advertise as well, e.g. 10.250.0.0/24.",
    )
    image: Image | None = Field(
        default=None,
        description=(
            "Deprecated and ignored: the router runs the image the operator is configured with "
            "(chart value gateway.router.image), never one a TailnetGateway names. While it is set, "
            "the condition ImageIgnored says so. It goes in the next API version."
        ),
    )
    dns: GatewayDNS | None = Field(
        default=None, description="Run a CoreDNS for the Tailnet's zone next to the router."
    )
    suspend: bool = Field(
        default=True,
        description=(
            "While true nothing is created; set it to false to create the router once. Defaults to true."
        ),
    )
    deletion_policy: Literal["Retain", "Delete"] = Field(
        default="Retain",
        description=(
            "Retain leaves the router Pod, its state Secret and its node when the object is deleted; "
            "Delete removes them. Defaults to Retain."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.advertise_load_balancer_range is not None and self.site_routes:
            lb = ipaddress.ip_network(self.advertise_load_balancer_range)
            for route in self.site_routes:
                if ipaddress.ip_network(route).overlaps(lb):
                    raise ValueError("advertiseLoadBalancerRange: must not overlap siteRoutes")
        return self


class Receipts(ApiModel):
    """The identity the gateway created, pinned once and never rewritten."""

    model_config = ConfigDict(
        json_schema_extra=validations(cel("self == oldSelf", "receipts are written once"))
    )

    node_id: str = Field(max_length=64, description="Headscale ID of the router node.")
    node_key: str = Field(max_length=128, description="Node key of the router node.")
    created_at: Timestamp = Field(description="When the router was created.")
    state_secret: str | None = Field(
        default=None, max_length=253, description="Name of the Secret holding the router's state."
    )


class GatewayRoutes(ApiModel):
    """The router node's routes as Headscale shows them."""

    advertised: list[BoundedString] | None = Field(
        default=None, max_length=256, description="Routes the node advertises."
    )
    approved: list[BoundedString] | None = Field(
        default=None, max_length=256, description="Routes approved for the node."
    )


class GatewayDNSStatus(ApiModel):
    """Where the zone is served."""

    zone: str | None = Field(default=None, max_length=253, description="The zone CoreDNS serves.")
    server_address: str | None = Field(
        default=None, max_length=64,
        description="The address of the gateway's CoreDNS (its Service's ClusterIP, advertised by the router "
                    "as a /32): the nameserver Headscale's split DNS must send the zone to.",
    )


class TailnetGatewayStatus(ApiModel):
    """Observed state of a TailnetGateway."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("!has(oldSelf.receipts) || has(self.receipts)", "receipts cannot be removed", ".receipts")
        )
    )

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(default=None, description="Ready and more specific conditions.")
    receipts: Receipts | None = Field(
        default=None, description="The router identity created by the operator; written once."
    )
    routes: GatewayRoutes | None = Field(default=None, description="The router node's routes in Headscale.")
    dns: GatewayDNSStatus | None = Field(default=None, description="The CoreDNS of spec.dns, once it has an address.")


class TailnetGateway(ApiModel):
    """The cluster's subnet router and split-DNS resolver (cluster-scoped)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["TailnetGateway"] = "TailnetGateway"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetGatewaySpec
    status: TailnetGatewayStatus | None = None
