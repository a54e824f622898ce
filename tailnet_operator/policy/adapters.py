"""CRD objects -> the plain inputs of :func:`~tailnet_operator.policy.derive.derive`.

Kept apart so the policy logic does not depend on the API models. Which objects to pass is the
caller's business: only those of one Tailnet, and only TailnetSites that are not Blocked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.site import TailnetSite
from tailnet_operator.policy.derive import (
    DEFAULT_TAG_OWNERS,
    Derived,
    EgressInput,
    EgressTarget,
    GatewayInput,
    IngressInput,
    SiteInput,
    derive,
)


def _source(kind: str, namespace: str | None, name: str | None) -> str:
    """``Kind namespace/name`` (``Kind name`` for a cluster-scoped object): what the marker
    comment on a rendered entry names."""
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name or ''}"


def egress_input(obj: TailnetEgress) -> EgressInput:
    return EgressInput(
        tag=obj.spec.tag,
        targets=tuple(
            EgressTarget(address=t.address, ports=tuple(p.port for p in t.ports)) for t in obj.spec.targets
        ),
        source=_source("TailnetEgress", obj.metadata.namespace, obj.metadata.name),
    )


def ingress_input(obj: TailnetIngress, *, holds_address: bool = True) -> IngressInput:
    """``holds_address``: whether the ingress holds its shared address (only the holder's tag is
    approved for it: :func:`tailnet_operator.tenancy.shared_address_holders`)."""
    shared = obj.spec.shared_address if holds_address else None
    return IngressInput(tag=obj.spec.tag, ports=tuple(sorted({e.port for e in obj.spec.exposes})),
                        shared_address=shared,
                        source=_source("TailnetIngress", obj.metadata.namespace, obj.metadata.name))


def site_input(obj: TailnetSite) -> SiteInput:
    return SiteInput(name=obj.metadata.name or "", router_tag=obj.spec.router_tag, routes=tuple(obj.spec.routes),
                     source=_source("TailnetSite", obj.metadata.namespace, obj.metadata.name))


def gateway_input(obj: TailnetGateway) -> GatewayInput:
    """Only the LoadBalancer range is approved for the gateway itself; site LANs go through TailnetSites."""
    lb_range = obj.spec.advertise_load_balancer_range
    return GatewayInput(tag=obj.spec.tag, routes=(lb_range,) if lb_range is not None else (),
                        source=_source("TailnetGateway", obj.metadata.namespace, obj.metadata.name))


def derive_from_objects(
    *,
    egresses: Iterable[TailnetEgress] = (),
    ingresses: Iterable[TailnetIngress] = (),
    sites: Iterable[TailnetSite] = (),
    gateways: Iterable[TailnetGateway] = (),
    owners: Sequence[str] = DEFAULT_TAG_OWNERS,
    shared_address_holders: Iterable[TailnetIngress] | None = None,
) -> Derived:
    """:func:`derive` straight from CRD objects (sites must already exclude Blocked ones); an
    ingress's shared address is approved only when it is among ``shared_address_holders`` (None:
    every ingress holds its own)."""
    holders = None if shared_address_holders is None else {id(i) for i in shared_address_holders}
    return derive(
        egresses=map(egress_input, egresses),
        ingresses=(ingress_input(i, holds_address=holders is None or id(i) in holders) for i in ingresses),
        sites=map(site_input, sites),
        gateways=map(gateway_input, gateways),
        owners=owners,
    )
