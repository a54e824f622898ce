"""What the apiserver needs to know about each kind besides its schema.

The CRD generator, the install helper and the reconcilers all read this table, so names,
scopes and columns are stated once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from tailnet_operator.api.common import GROUP, VERSION, ApiModel
from tailnet_operator.api.egress import TailnetEgress, TailnetEgressSpec, TailnetEgressStatus
from tailnet_operator.api.gateway import TailnetGateway, TailnetGatewaySpec, TailnetGatewayStatus
from tailnet_operator.api.ingress import TailnetIngress, TailnetIngressSpec, TailnetIngressStatus
from tailnet_operator.api.site import TailnetSite, TailnetSiteSpec, TailnetSiteStatus
from tailnet_operator.api.tailnet import Tailnet, TailnetSpec, TailnetStatus

CATEGORIES = ["tailnet-all"]
"""`kubectl get tailnet-all` lists every object of the operator's kinds (a category named like a kind would
shadow it: kubectl expands categories first)."""


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry of ``kubectl get``."""

    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"] = "string"
    description: str = ""
    priority: int = 0

    def to_crd(self) -> dict[str, object]:
        """The CRD form; keys in a fixed order for stable YAML."""
        out: dict[str, object] = {"name": self.name, "type": self.type}
        if self.description:
            out["description"] = self.description
        out["jsonPath"] = self.json_path
        if self.priority:
            out["priority"] = self.priority
        return out


def _condition(cond: str, field_name: str) -> str:
    return f'.status.conditions[?(@.type=="{cond}")].{field_name}'


READY = PrinterColumn("Ready", _condition("Ready", "status"), description="Summary condition.")
REASON = PrinterColumn("Reason", _condition("Ready", "reason"), description="Why Ready has its status.")
AGE = PrinterColumn("Age", ".metadata.creationTimestamp", "date")
MESSAGE = PrinterColumn("Message", _condition("Ready", "message"), description="Details.", priority=1)


@dataclass(frozen=True)
class Kind:
    """One custom resource kind of the ``tailnet.dev`` group."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    scope: Literal["Cluster", "Namespaced"]
    model: type[ApiModel]
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[PrinterColumn, ...]
    group: str = GROUP
    version: str = VERSION
    categories: tuple[str, ...] = field(default=tuple(CATEGORIES))

    @property
    def crd_name(self) -> str:
        """``<plural>.<group>``, the CRD's metadata.name."""
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def namespaced(self) -> bool:
        return self.scope == "Namespaced"


def _columns(*domain: PrinterColumn) -> tuple[PrinterColumn, ...]:
    return (READY, REASON, *domain, AGE, MESSAGE)


KINDS: tuple[Kind, ...] = (
    Kind(
        kind="Tailnet",
        plural="tailnets",
        singular="tailnet",
        short_names=("tnet",),
        scope="Cluster",
        model=Tailnet,
        spec=TailnetSpec,
        status=TailnetStatus,
        columns=_columns(
            PrinterColumn("Server", ".spec.loginURL", description="Headscale login URL."),
            PrinterColumn("Version", ".status.serverVersion", description="Headscale version."),
            PrinterColumn("KeyExpires", ".status.apiKey.expiresAt", "string", "Working API key expiry (UTC)."),
        ),
    ),
    Kind(
        kind="TailnetEgress",
        plural="tailnetegresses",
        singular="tailnetegress",
        short_names=("tne",),
        scope="Namespaced",
        model=TailnetEgress,
        spec=TailnetEgressSpec,
        status=TailnetEgressStatus,
        columns=_columns(
            PrinterColumn("Tag", ".spec.tag", description="ACL tag of the node."),
            PrinterColumn("Node", ".status.node.name", description="Tailnet node name."),
        ),
    ),
    Kind(
        kind="TailnetIngress",
        plural="tailnetingresses",
        singular="tailnetingress",
        short_names=("tni",),
        scope="Namespaced",
        model=TailnetIngress,
        spec=TailnetIngressSpec,
        status=TailnetIngressStatus,
        columns=_columns(
            PrinterColumn("Tag", ".spec.tag", description="ACL tag of the node."),
            PrinterColumn("DNSName", ".status.magicDNSName", description="MagicDNS name of the node."),
        ),
    ),
    Kind(
        kind="TailnetSite",
        plural="tailnetsites",
        singular="tailnetsite",
        short_names=("tns",),
        scope="Cluster",
        model=TailnetSite,
        spec=TailnetSiteSpec,
        status=TailnetSiteStatus,
        columns=_columns(
            PrinterColumn("Routes", ".spec.routes", description="Site networks."),
            PrinterColumn("RouterTag", ".spec.routerTag", description="Tag of the routers."),
            PrinterColumn("Approved", _condition("Approved", "status"), description="Routes approved."),
        ),
    ),
    Kind(
        kind="TailnetGateway",
        plural="tailnetgateways",
        singular="tailnetgateway",
        short_names=("tngw",),
        scope="Cluster",
        model=TailnetGateway,
        spec=TailnetGatewaySpec,
        status=TailnetGatewayStatus,
        columns=_columns(
            PrinterColumn("Tag", ".spec.tag", description="ACL tag of the router."),
            PrinterColumn("Node", ".status.receipts.nodeId", description="Headscale node ID of the router."),
            PrinterColumn("Suspended", ".spec.suspend", "boolean", "Whether creation is held back."),
        ),
    ),
)

BY_KIND: dict[str, Kind] = {k.kind: k for k in KINDS}


def kind_of(kind: str) -> Kind:
    """The registry entry of ``kind``, e.g. ``TailnetEgress``."""
    try:
        return BY_KIND[kind]
    except KeyError:
        raise KeyError(f"unknown kind {kind!r}; known: {sorted(BY_KIND)}") from None
