"""Resource descriptors of the project's own kinds, from the API registry."""

from __future__ import annotations

from tailnet_operator.api import BY_KIND
from tailnet_operator.runtime.kinds import Resource


def _resource(kind: str) -> Resource:
    info = BY_KIND[kind]
    return Resource(info.group, info.version, info.plural, kind, namespaced=info.scope == "Namespaced")


TAILNET = _resource("Tailnet")
TAILNET_EGRESS = _resource("TailnetEgress")
TAILNET_INGRESS = _resource("TailnetIngress")
TAILNET_SITE = _resource("TailnetSite")
TAILNET_GATEWAY = _resource("TailnetGateway")
