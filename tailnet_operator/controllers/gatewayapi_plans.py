"""A Gateway's translation read from the cache: the routes that name it (by an index), its
class's Tailnet, and the plan :func:`~tailnet_operator.resources.gatewayapi.as_ingress` makes of
them. Shared by the Gateway API's controller (:mod:`.gatewayapi`) and the policy, which owns the
tags of the Gateways it serves."""

from __future__ import annotations

from pydantic import ValidationError

from tailnet_operator import tenancy
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.resources import gatewayapi as gw
from tailnet_operator.runtime import NAMESPACE, SECRET, SERVICE, Reader, Resource
from tailnet_operator.types import JSON

from .kinds import API_GATEWAY, GATEWAY_CLASS, REFERENCE_GRANT, ROUTE_RESOURCES, TAILNET

__all__ = ["PARENT_INDEX", "Plans", "parent_index"]

PARENT_INDEX = "gateway-api-parent"
"""A route's index (every kind of :data:`~.kinds.ROUTE_RESOURCES`): the Gateways
(``namespace/name``) its ``parentRefs`` name."""


def parent_index(route: JSON) -> list[str]:
    """:data:`PARENT_INDEX`: ``namespace/name`` of each Gateway the route's ``parentRefs`` name."""
    namespace = route["metadata"].get("namespace") or ""
    return list(dict.fromkeys(
        f"{ref.get('namespace') or namespace}/{ref.get('name')}"
        for ref in (route.get("spec") or {}).get("parentRefs") or []
        if (ref.get("group", gw.GROUP), ref.get("kind", "Gateway")) == (gw.GROUP, "Gateway") and ref.get("name")))


class Plans:
    """A Gateway's translation (its TailnetIngress shape and what its statuses say), read from the cache."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def routes(self, namespace: str, name: str) -> list[tuple[Resource, JSON]]:
        """The routes (each with its kind, as stored) that name the Gateway."""
        key = (PARENT_INDEX, f"{namespace}/{name}")
        return [(kind, route) for kind in ROUTE_RESOURCES for route in self.reader.list(kind, index=key)]

    def tailnet(self, gateway: JSON) -> str:
        """The Tailnet the Gateway's class names ("" for a Gateway of another class)."""
        return gw.tailnet_of(gateway, self.reader.list(GATEWAY_CLASS)) or ""

    def plan(self, served: gw.ServedGateway) -> gw.GatewayPlan:
        routes = []
        for kind, route in self.routes(served.namespace, served.name):
            try:
                routes.append(gw.RouteObject.model_validate({**route, "kind": kind.kind}))
            except ValidationError:
                continue  # not one kube-apiserver's schema admits: nothing of it is served
        reader = self.reader
        tailnet = self.tailnet({"spec": {"gatewayClassName": served.spec.gateway_class_name}})
        return gw.as_ingress(
            served.gateway, routes, tailnet, tag=served.tag, hostname=served.hostname,
            services=lambda ns, name: reader.get(SERVICE, name, ns),
            certificates=lambda ns, name: gw.certificate_problem(reader.get(SECRET, name, ns)),
            labels=self.labels, shares=self._sharing(tailnet, served),
            granted=lambda fk, fns, tk, tns, tn: gw.reference_granted(reader.list(REFERENCE_GRANT, tns),
                                                                        fk, fns, tk, tns, tn))

    def labels(self, namespace: str) -> dict[str, str] | None:
        """A namespace's labels (None for one not known)."""
        found = self.reader.get(NAMESPACE, namespace)
        return None if found is None else dict(found["metadata"].get("labels") or {})

    def _sharing(self, tailnet: str, served: gw.ServedGateway) -> gw.SharesTag:
        """Whether the Tailnet's tenancy lets a route's namespace use the Gateway's tag."""
        stored = self.reader.get(TAILNET, tailnet) if tailnet else None
        try:
            model = Tailnet.model_validate(stored) if stored is not None else None
        except ValidationError:
            model = None
        if model is None:
            return lambda _: False
        return lambda namespace: tenancy.shares_tag(model, served.namespace, namespace, served.tag)

    def served(self, tailnet: str) -> list[gw.GatewayPlan]:
        """The plans of the Gateways of ``tailnet``'s classes that have something to serve (not
        being deleted): what the policy derives their tags from."""
        classes = self.reader.list(GATEWAY_CLASS)
        plans = []
        for obj in self.reader.list(API_GATEWAY):
            if gw.tailnet_of(obj, classes) != tailnet or obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                plans.append(self.plan(gw.ServedGateway.model_validate(obj)))
            except ValidationError:
                continue
        return [p for p in plans if p.ingress is not None]
