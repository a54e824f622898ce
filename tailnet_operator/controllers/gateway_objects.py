"""The objects of a TailnetGateway in the gateway namespace, applied in the order they depend on
each other: the ConfigMap and CoreDNS first, then, once CoreDNS's Service has its address (one of
the router's routes), the router's identity, its Service and its StatefulSet."""

from __future__ import annotations

from dataclasses import replace

from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.resources import gateway as build
from tailnet_operator.runtime import CONFIG_MAP, SERVICE, Reader, Resource, Writer
from tailnet_operator.runtime.kinds import DEPLOYMENT, ROLE, ROLE_BINDING, SERVICE_ACCOUNT, STATEFUL_SET
from tailnet_operator.types import JSON

from .access import HeadscaleAccess
from .dns import HOSTS_KEY, in_zone, parse_hosts
from .gateway_status import Placed
from .kinds import TAILNET_EGRESS
from .policy import TAILNET_INDEX

__all__ = ["RouterObjects"]


class RouterObjects:
    """Applies a gateway's objects as ``field_manager`` into ``router.namespace``."""

    def __init__(self, reader: Reader, writer: Writer, access: HeadscaleAccess, *, field_manager: str) -> None:
        self.reader, self.writer, self.access = reader, writer, access
        self.field_manager = field_manager

    async def apply(self, gateway: TailnetGateway, tailnet: Tailnet, router: build.Router) -> Placed:
        """Apply the ConfigMap, CoreDNS and the router; the StatefulSet waits for CoreDNS's address,
        which is one of its routes (so its template does not change right after creation)."""
        router = replace(router, ca_bundle=self.access.agent_ca(tailnet))
        await self._put(CONFIG_MAP, build.config_map(gateway, router, self._zone_entries(gateway, tailnet)))
        address = ""
        if gateway.spec.dns is not None:
            await self._put(DEPLOYMENT, build.dns_deployment(gateway, router))
            service = await self._put(SERVICE, build.dns_service(gateway, router))
            address = _cluster_ip(service) or _cluster_ip(
                self.reader.get(SERVICE, build.dns_name(gateway), router.namespace))
            if not address:
                return Placed()
        routes = build.advertised_routes(gateway, self._egress_addresses(tailnet), address)
        router = replace(router, routes=routes)
        sts = build.stateful_set(gateway, router)
        # the pod's identity before the pod: the StatefulSet controller cannot create it without
        await self._put(SERVICE_ACCOUNT, build.router_service_account(gateway, router.namespace))
        await self._put(ROLE, build.router_role(gateway, router.namespace))
        await self._put(ROLE_BINDING, build.router_role_binding(gateway, router.namespace))
        await self._put(SERVICE, build.router_service(gateway, router))
        await self._put(STATEFUL_SET, sts)
        template_hash = sts["spec"]["template"]["metadata"]["annotations"][build.TEMPLATE_HASH_ANNOTATION]
        return Placed(routes, address, template_hash, router=True)

    async def _put(self, resource: Resource, body: JSON) -> JSON:
        return await self.writer.apply(resource, body, field_manager=self.field_manager)

    def _zone_entries(self, gateway: TailnetGateway, tailnet: Tailnet) -> dict[str, str]:
        """The names of the Tailnet's hosts file that are in the gateway's zone."""
        dns, zone = tailnet.spec.dns, gateway.spec.dns
        if dns is None or zone is None:
            return {}
        ref = dns.hosts_config_map
        current = self.reader.get(CONFIG_MAP, ref.name, ref.namespace)
        hosts = parse_hosts(str(((current or {}).get("data") or {}).get(HOSTS_KEY, "")))
        return {name: address for name, address in hosts.items() if in_zone(name, zone.zone)}

    def _egress_addresses(self, tailnet: Tailnet) -> list[str]:
        """Target addresses of the operator namespace's egresses of this Tailnet (names are skipped
        by the route builder)."""
        addresses: list[str] = []
        for obj in self.reader.list(TAILNET_EGRESS, self.access.namespace,
                                    index=(TAILNET_INDEX, str(tailnet.metadata.name))):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                egress = TailnetEgress.model_validate(obj)
            except ValidationError:
                continue
            addresses.extend(str(t.address) for t in egress.spec.targets)
        return addresses


def _cluster_ip(service: JSON | None) -> str:
    ip = str(((service or {}).get("spec") or {}).get("clusterIP") or "")
    return "" if ip in ("", "None") else ip
