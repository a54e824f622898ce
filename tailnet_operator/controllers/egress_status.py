"""Per-target route state of a TailnetEgress: the agent's view refined with Headscale's.

The agent (``GET /status`` on its health port) says what its netmap gives it: a route to the
target or not, and whether a probe connected. Headscale says which routers advertise a route to
the address and which of those are approved; the live policy says whether the tag is granted
the address. Together they name the cause a plain proxy leaves silent:

* ``NotAdvertised``: no router advertises a route covering the address;
* ``NotApproved``: a router advertises it, none has it approved;
* ``NoGrant``: routed, but the policy does not let the egress tag reach the address and port;
* ``Ready``: the agent has a route (and its probe, when it made one, connected);
* ``Unknown``: the agent's status could not be read, or the name does not resolve.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog

from tailnet_operator.api.egress import EgressTarget, TailnetEgress
from tailnet_operator.headscale import Node
from tailnet_operator.policy import EgressInput, derive, missing
from tailnet_operator.policy import EgressTarget as PolicyTarget
from tailnet_operator.resources.egress import HEALTH_PORT, agent_name
from tailnet_operator.types import JSON

__all__ = ["AgentStatusReader", "HttpAgentStatus", "TargetState", "classify"]

log = structlog.get_logger("controllers.egress")

TAILNET_RANGES = (ipaddress.ip_network("100.64.0.0/10"), ipaddress.ip_network("fd7a:115c:a1e0::/48"))
"""Tailnet addresses are nodes, not routes: no router is involved in reaching them."""


class AgentStatusReader(Protocol):
    """Reads an agent's ``GET /status`` document for its CR; None when it cannot be read."""

    async def read(self, owner: Any) -> JSON | None: ...


class HttpAgentStatus:
    """Production reader: the agent's status Service, ``<service(owner)>.<ns>.svc`` (by default
    an egress agent's, ``<egress>-egress-agent``)."""

    def __init__(self, timeout: float = 3.0, *, service: Callable[[Any], str] = agent_name) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.service = service

    async def read(self, owner: Any) -> JSON | None:
        url = f"http://{self.service(owner)}.{owner.metadata.namespace}.svc:{HEALTH_PORT}/status"
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as session, session.get(url) as resp:
                if resp.status != 200:
                    return None
                doc: Any = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("agent status not readable", url=url, error=str(exc))
            return None
        return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class TargetState:
    """One ``status.targets`` entry."""

    name: str
    service: str
    route: str
    message: str
    router: str | None = None
    probe: JSON | None = None

    def status(self) -> JSON:
        entry: JSON = {"name": self.name, "service": self.service, "route": self.route, "message": self.message}
        if self.router:
            entry["router"] = self.router
        for key in ("reachable", "latencyMs", "checkedAt"):
            if self.probe and self.probe.get(key) is not None:
                entry[key] = self.probe[key]
        return entry


def _ip(value: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(value))
    except ValueError:
        return None


def _route_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                   nodes: Sequence[Node]) -> tuple[str, str, str | None] | None:
    """(state, message, router) when Headscale shows the address is not routed; None when it is."""
    if any(address in net for net in TAILNET_RANGES):
        return None
    covering = [n for n in nodes if any(address in ipaddress.ip_network(r, strict=False)
                                        for r in n.available_routes)]
    if not covering:
        return ("NotAdvertised", f"no router advertises a route to {address}; advertise it on a subnet router "
                                 "(tailscale set --advertise-routes)", None)
    approved = [n for n in covering if any(address in ipaddress.ip_network(r, strict=False)
                                           for r in n.approved_routes)]
    if not approved:
        return ("NotApproved", f"{covering[0].name} advertises a route to {address} but it is not approved; "
                               "add an autoApprovers entry (or let the operator own the policy)", covering[0].name)
    return None


def _grant_missing(tag: str, target: EgressTarget, address: str, live: str) -> bool:
    derived = derive(egresses=[EgressInput(tag=tag, targets=(
        PolicyTarget(address=address, ports=tuple(p.port for p in target.ports)),))])
    return bool(missing(live or None, derived).grants)


def _agent_entry(agent: JSON | None, name: str) -> JSON | None:
    for entry in (agent or {}).get("targets") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry
    return None


def classify(egress: TailnetEgress, target: EgressTarget, *, agent: JSON | None, nodes: Sequence[Node],
             live_policy: str) -> TargetState:
    """The state of one target from the agent's entry (None: unreadable), the nodes and the policy."""
    service = f"{target.name}.{egress.metadata.namespace}.svc"
    entry = _agent_entry(agent, target.name)
    resolved = _ip(target.address) or _ip((entry or {}).get("address"))
    if resolved is not None:
        if problem := _route_problem(resolved, nodes):
            return TargetState(target.name, service, problem[0], problem[1], problem[2], entry)
        if _grant_missing(egress.spec.tag, target, str(resolved), live_policy):
            return TargetState(target.name, service, "NoGrant",
                               f"the policy does not grant {egress.spec.tag} access to {resolved} on "
                               f"{', '.join(str(p.port) for p in target.ports)}", None, entry)
    return _from_agent(target.name, service, entry, agent is not None, nodes)


def _router_name(entry: JSON, nodes: Sequence[Node]) -> str | None:
    """The router as Headscale names it (as ``NotApproved`` and TailnetSite status do): the agent
    reports its MagicDNS name and ID; the ID picks the node, else the name's first label."""
    router_id, shown = entry.get("routerId"), entry.get("router")
    if router_id is not None:
        for node in nodes:
            if str(node.id) == str(router_id):
                return node.given_name or node.name
    return str(shown).split(".", 1)[0] if shown else None


def _from_agent(name: str, service: str, entry: JSON | None, read: bool,
                nodes: Sequence[Node] = ()) -> TargetState:
    if entry is None:
        why = "the agent does not list the target yet" if read else "the agent's /status could not be read"
        return TargetState(name, service, "Unknown", why)
    state, router = str(entry.get("state") or "Unknown"), _router_name(entry, nodes)
    message = str(entry.get("message") or "")
    if state == "Ready":
        if entry.get("reachable") is False:
            message = message or "routed, but the agent's probe did not connect"
        return TargetState(name, service, "Ready", message or "routed", router, entry)
    if state == "Unresolved":
        return TargetState(name, service, "Unresolved", (
            f"{message or 'the address does not resolve'}: the agent resolves names with the tailnet's DNS "
            "(MagicDNS names, and the nameservers Headscale hands out); check the spelling, or give an IP "
            "address"), router, entry)
    if state == "NoRoute":
        return TargetState(name, service, "NoGrant", message or "the agent's netmap has no route to the target; "
                           "the policy probably does not grant the tag access", router, entry)
    return TargetState(name, service, "Unknown", message or f"the agent reports {state}", router, entry)
