"""The ``tailnet.dev/v1alpha1`` API: pydantic models that are the source of truth for the CRDs.

``hack/codegen.py`` turns these models into ``manifests/crd``; the reconcilers parse objects
with the same models, so the schema the apiserver enforces and the one the operator reads agree.
"""

from tailnet_operator.api.common import API_VERSION, GROUP, VERSION, Condition
from tailnet_operator.api.egress import TailnetEgress, TailnetEgressSpec, TailnetEgressStatus
from tailnet_operator.api.gateway import TailnetGateway, TailnetGatewaySpec, TailnetGatewayStatus
from tailnet_operator.api.ingress import TailnetIngress, TailnetIngressSpec, TailnetIngressStatus
from tailnet_operator.api.registry import BY_KIND, KINDS, Kind, PrinterColumn, kind_of
from tailnet_operator.api.site import TailnetSite, TailnetSiteSpec, TailnetSiteStatus
from tailnet_operator.api.tailnet import Tailnet, TailnetSpec, TailnetStatus

__all__ = [
    "API_VERSION",
    "BY_KIND",
    "GROUP",
    "KINDS",
    "VERSION",
    "Condition",
    "Kind",
    "PrinterColumn",
    "Tailnet",
    "TailnetEgress",
    "TailnetEgressSpec",
    "TailnetEgressStatus",
    "TailnetGateway",
    "TailnetGatewaySpec",
    "TailnetGatewayStatus",
    "TailnetIngress",
    "TailnetIngressSpec",
    "TailnetIngressStatus",
    "TailnetSite",
    "TailnetSiteSpec",
    "TailnetSiteStatus",
    "TailnetSpec",
    "TailnetStatus",
    "kind_of",
]
