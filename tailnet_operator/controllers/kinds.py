"""Resource descriptors of the project's own kinds, from the API registry."""

from __future__ import annotations

from pydantic import BaseModel

from tailnet_operator.api import BY_KIND
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.site import TailnetSite
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.runtime.kinds import Resource


def _resource(kind: str) -> Resource:
    info = BY_KIND[kind]
    return Resource(info.group, info.version, info.plural, kind, namespaced=info.scope == "Namespaced")


TAILNET = _resource("Tailnet")
TAILNET_EGRESS = _resource("TailnetEgress")
TAILNET_INGRESS = _resource("TailnetIngress")
TAILNET_SITE = _resource("TailnetSite")
TAILNET_GATEWAY = _resource("TailnetGateway")

INGRESS = Resource("networking.k8s.io", "v1", "ingresses", "Ingress")
"""Built-in kinds the IngressClass reads (:mod:`.ingressclass`)."""
INGRESS_CLASS = Resource("networking.k8s.io", "v1", "ingressclasses", "IngressClass", namespaced=False)

GATEWAY_CLASS = Resource("gateway.networking.k8s.io", "v1", "gatewayclasses", "GatewayClass", namespaced=False)
"""The Gateway API's kinds (:mod:`.gatewayapi`): their CRDs are installed apart from the operator's,
so the cache tolerates their absence (:meth:`~tailnet_operator.runtime.SharedCache.tolerate_absent`)."""
API_GATEWAY = Resource("gateway.networking.k8s.io", "v1", "gateways", "Gateway")
HTTP_ROUTE = Resource("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute")
TLS_ROUTE = Resource("gateway.networking.k8s.io", "v1", "tlsroutes", "TLSRoute")
TCP_ROUTE = Resource("gateway.networking.k8s.io", "v1", "tcproutes", "TCPRoute")
"""v1: TLSRoute and TCPRoute are in the standard channel since Gateway API 1.5."""
GRPC_ROUTE = Resource("gateway.networking.k8s.io", "v1", "grpcroutes", "GRPCRoute")
ROUTE_RESOURCES = (HTTP_ROUTE, GRPC_ROUTE, TLS_ROUTE, TCP_ROUTE)
"""The route kinds a tailnet Gateway serves."""
REFERENCE_GRANT = Resource("gateway.networking.k8s.io", "v1beta1", "referencegrants", "ReferenceGrant")
"""v1beta1: served by every Gateway API release since 0.6 (v1 since 1.5)."""
GATEWAY_API_KINDS = (GATEWAY_CLASS, API_GATEWAY, *ROUTE_RESOURCES, REFERENCE_GRANT)

MODELS: dict[type[BaseModel], Resource] = {
    Tailnet: TAILNET,
    TailnetEgress: TAILNET_EGRESS,
    TailnetIngress: TAILNET_INGRESS,
    TailnetSite: TAILNET_SITE,
    TailnetGateway: TAILNET_GATEWAY,
}
"""The project's kinds as the cache reads them (``cache.get(Tailnet, name)``)."""
