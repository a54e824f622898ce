"""A TailnetGateway's status, from what its apply placed and what Headscale shows: pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.headscale import Node
from tailnet_operator.resources import gateway as build
from tailnet_operator.types import JSON

from .conditions import Cond

__all__ = ["CONDITION_TYPES", "Placed", "image_ignored", "node_conditions", "restart_condition", "routes_condition",
           "split_dns_condition", "status_fields"]

CONDITION_TYPES = ("ImageIgnored", "Registered", "RestartPending", "RoutesApproved", "SplitDNS", "TagOwned")


@dataclass(frozen=True)
class Placed:
    """What the gateway's apply put in place."""

    routes: tuple[str, ...] = ()
    dns_address: str = ""
    template_hash: str = ""
    router: bool = False
    """False while the StatefulSet waits for the CoreDNS Service's address."""


def node_conditions(node: Node, pod_ref: str) -> list[Cond]:
    """Ready (the node online) and Registered (the receipts' node is in Headscale)."""
    registered = Cond("Registered", "True", "Registered",
                      f"router node {node.id} ({node.name}) is in Headscale with the receipts' identity")
    if node.online:
        ready = Cond("Ready", "True", "Running",
                     f"router node {node.id} is online and advertises {len(node.available_routes)} route(s)")
    else:
        ready = Cond("Ready", "False", "NodeOffline", f"router node {node.id} is offline; see the pod {pod_ref}")
    return [ready, registered]


def restart_condition(pod: JSON | None, namespace: str, gateway: TailnetGateway, placed: Placed) -> Cond:
    """RestartPending: whether the router pod runs the template the StatefulSet now has."""
    name = build.pod_name(gateway)
    ref = f"{namespace}/{name}"
    if pod is None:
        return Cond("RestartPending", "Unknown", "PodNotFound",
                    f"the pod {ref} does not exist (yet); the StatefulSet creates it from the current template")
    running = ((pod["metadata"].get("annotations") or {}).get(build.TEMPLATE_HASH_ANNOTATION) or "")
    if running == placed.template_hash:
        return Cond("RestartPending", "False", "UpToDate", f"the pod {ref} runs the current template")
    return Cond("RestartPending", "True", "TemplateChanged",
                f"the router's template changed (its image, routes or settings); the StatefulSet's update "
                f"strategy is OnDelete, so the pod {ref} keeps the old template until a person deletes it "
                f"(kubectl delete pod -n {namespace} {name}); it comes back as the same node from its "
                "state Secret. The operator never restarts it")


def routes_condition(placed: Placed, node: Node) -> Cond:
    """RoutesApproved: every route the template advertises is advertised by the node and approved."""
    not_advertised = [r for r in placed.routes if r not in node.available_routes]
    not_approved = [r for r in placed.routes if r in node.available_routes and r not in node.approved_routes]
    if not_approved:
        return Cond("RoutesApproved", "False", "NotApproved",
                    f"advertised but approved nowhere: {', '.join(not_approved)}; the policy's autoApprovers "
                    "(see the Tailnet's PolicyApplied) or `headscale nodes approve-routes` approve them")
    if not_advertised:
        return Cond("RoutesApproved", "False", "NotAdvertised",
                    f"in the template but not advertised by the node yet: {', '.join(not_advertised)} "
                    "(a pending restart, see RestartPending)")
    return Cond("RoutesApproved", "True", "Approved", f"all {len(placed.routes)} route(s) advertised and approved")


def split_dns_condition(gateway: TailnetGateway, placed: Placed) -> Cond | None:
    """SplitDNS: what Headscale's configuration must say for tailnet clients to ask this CoreDNS.

    Headscale's DNS settings live in its configuration file, which neither its API nor the operator
    can read or write; so this names the entry to add, as the policy report names what is missing."""
    dns = gateway.spec.dns
    if dns is None:
        return None
    if not placed.dns_address:
        return Cond("SplitDNS", "Unknown", "WaitingForAddress", "the CoreDNS Service has no address yet")
    zone = dns.zone.lower().rstrip(".")
    return Cond("SplitDNS", "Unknown", "HeadscaleConfigRequired",
                f"the operator cannot read or write Headscale's configuration file; for tailnet clients to "
                f"resolve {zone} through this gateway, it must contain:\n"
                f"dns:\n  nameservers:\n    split:\n      {zone}:\n        - {placed.dns_address}\n"
                f"and the route {placed.dns_address}/32 must stay approved on the router (the operator approves "
                "it). `tailscale dns status` on a client shows the split route once Headscale serves it")


def image_ignored(gateway: TailnetGateway, router_image: str) -> Cond | None:
    """ImageIgnored while the deprecated ``spec.image`` is set (absent otherwise)."""
    if not gateway.spec.image:
        return None
    return Cond("ImageIgnored", "True", "Deprecated",
                f"spec.image ({gateway.spec.image}) is deprecated and ignored: the router runs "
                f"{router_image}, the image the operator is configured with "
                "(--gateway-router-image, chart value gateway.router.image); remove spec.image")


def status_fields(gateway: TailnetGateway, node: Node | None, placed: Placed) -> JSON:
    fields: JSON = {}
    if node is not None:
        fields["routes"] = {"advertised": sorted(node.available_routes), "approved": sorted(node.approved_routes)}
    if gateway.spec.dns is not None and placed.dns_address:
        fields["dns"] = {"zone": gateway.spec.dns.zone, "serverAddress": placed.dns_address}
    return fields
