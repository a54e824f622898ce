"""TailnetSite: a remote network reached through tagged subnet routers."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from tailnet_operator.api.common import (
    ApiModel,
    BoundedString,
    Conditions,
    Generation,
    ObjectMeta,
    Tag,
    TailnetRef,
    cel,
    check_cidr,
    cidr_json_schema,
    validations,
)


def _check_not_default(value: str) -> str:
    if ipaddress.ip_network(value).prefixlen == 0:
        raise ValueError("a default route is an exit node, not a site")
    return value


SiteRoute = Annotated[
    str,
    AfterValidator(check_cidr),
    AfterValidator(_check_not_default),
    cidr_json_schema(
        cel("!isCIDR(self) || cidr(self).prefixLength() > 0", "a default route is an exit node, not a site")
    ),
]
"""A site network: a CIDR that is not a default route."""

_ROUTES_OVERLAP_RULE = cel(
    "self.all(a, self.all(b, a == b || !isCIDR(a) || !isCIDR(b) || !cidr(a).containsCIDR(cidr(b))))",
    "routes must not overlap one another",
)


class TailnetSiteSpec(ApiModel):
    """Desired state of a TailnetSite."""

    tailnet_ref: TailnetRef = Field(description="The Tailnet whose policy owns this site.")
    routes: list[SiteRoute] = Field(
        min_length=1,
        max_length=32,
        description=(
            "Networks behind the site's routers: a branch /24, a management range, a single host as /32. "
            "They must not overlap the Tailnet's reservedNetworks or an older site."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set", **validations(_ROUTES_OVERLAP_RULE)},
    )
    router_tag: Tag = Field(
        description=(
            "Tag of the subnet routers that may advertise the routes, in this or another cluster; the "
            "operator renders them as autoApprovers."
        )
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        nets = [ipaddress.ip_network(r) for r in self.routes]
        for a in nets:
            for b in nets:
                if a != b and a.version == b.version and b.subnet_of(a):  # type: ignore[arg-type]
                    raise ValueError("routes: routes must not overlap one another")
        return self


class RouterStatus(ApiModel):
    """A node carrying the router tag and what it advertises."""

    node: str = Field(max_length=253, description="Node name.")
    id: str | None = Field(default=None, max_length=64, description="Headscale node ID.")
    advertised: list[BoundedString] | None = Field(
        default=None, max_length=64, description="Site routes the node advertises."
    )
    approved: list[BoundedString] | None = Field(
        default=None, max_length=64, description="Site routes approved for the node."
    )


class TailnetSiteStatus(ApiModel):
    """Observed state of a TailnetSite."""

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(
        default=None, description="Advertised, Approved, Blocked and the summary Ready."
    )
    routers: list[RouterStatus] | None = Field(
        default=None,
        max_length=64,
        description="Routers seen with the router tag.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["node"]},
    )
    blocked_by: str | None = Field(
        default=None,
        max_length=1024,
        description="The reserved network or older TailnetSite the routes overlap, when blocked.",
    )


class TailnetSite(ApiModel):
    """A remote network behind tagged subnet routers (cluster-scoped)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["TailnetSite"] = "TailnetSite"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetSiteSpec
    status: TailnetSiteStatus | None = None
