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

:class:`HttpAgentStatus` reads ``/status`` for egress and ingress agents alike, bounded in size
and time and checked against :class:`AgentStatusDocument` (whatever a pod answers).

An egress with several replicas has several nodes; its status Service answers from one of them.
That is enough: the route states come from Headscale and the policy, which see one tag and so
the same routes for every replica; only ``status.node`` and a target's probe are that one agent's.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from tailnet_agent.contract import status as agent_status
from tailnet_agent.contract.endpoints import HEALTH_PORT, STATUS_PATH
from tailnet_operator.api.egress import EgressTarget, TailnetEgress
from tailnet_operator.headscale import Node
from tailnet_operator.policy import EgressInput, derive, missing
from tailnet_operator.policy import EgressTarget as PolicyTarget
from tailnet_operator.resources.egress import agent_name
from tailnet_operator.types import JSON

__all__ = ["STATUS_MAX_BYTES", "STATUS_TIME_LIMIT", "AgentStatusDocument", "AgentStatusReader", "HttpAgentStatus",
           "StatusUnavailable", "TargetState", "classify", "parse_status"]

log = structlog.get_logger("controllers.egress")

TAILNET_RANGES = (ipaddress.ip_network("100.64.0.0/10"), ipaddress.ip_network("fd7a:115c:a1e0::/48"))
"""Tailnet addresses are nodes, not routes: no router is involved in reaching them."""


class AgentStatusReader(Protocol):
    """Reads an agent's ``GET /status`` document for its CR; None when it cannot be read."""

    async def read(self, owner: Any) -> JSON | None: ...


STATUS_MAX_BYTES = 1 << 20
"""The largest ``/status`` body the operator reads (an agent's is about 500 bytes per target or
expose; 1 MiB holds some two thousand)."""
STATUS_TIME_LIMIT = 3.0
"""Seconds for the whole read: connecting, the response head and the body."""
HEAD_FIELDS, HEAD_FIELD_BYTES = 32, 8190
"""The response head: at most 32 header fields of at most 8190 bytes each (the status line too)."""


class StatusUnavailable(Exception):
    """The agent's ``/status`` could not be read; ``reason`` says why. ``routine`` marks what an
    agent that is starting or gone looks like (no connection, no answer, an error status), as
    opposed to an answer that is not a status document."""

    def __init__(self, reason: str, *, routine: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.routine = routine


class _Part(BaseModel):
    """Strict JSON types (no ``"1"`` for 1, no NaN); keys the model does not name are accepted and
    left out of what the reconcilers get. Each model reads one shape of
    :mod:`tailnet_agent.contract.status` with every key optional (unit_tests/test_agent_contract.py
    checks that the keys are the contract's)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, alias_generator=to_camel,
                              frozen=True)


class AgentNode(_Part):
    id: str | None = None
    name: str | None = None
    addresses: list[str] = []


class AgentTarget(_Part):
    name: str
    address: str | None = None
    ports: list[int] = []
    state: str | None = None
    router: str | None = None
    router_id: str | None = None
    message: str | None = None
    reachable: bool | None = None
    latency_ms: float | None = None
    checked_at: str | None = None


class AgentHost(_Part):
    name: str
    alias: str | None = None
    not_after: str | None = None
    error: str | None = None


class AgentExpose(_Part):
    name: str
    port: int | None = None
    mode: str | None = None
    listening: bool | None = None
    message: str | None = None
    backend: str | None = None
    reachable: bool | None = None
    latency_ms: float | None = None
    checked_at: str | None = None
    backend_error: str | None = None
    hosts: list[AgentHost] = []


class AgentFile(_Part):
    error: str | None = None
    loaded_at: str | None = None


class AgentStatusDocument(_Part):
    """The agent's ``/status`` (:mod:`tailnet_agent.contract.status`): ``targets`` and ``targetsFile`` from
    an egress agent, ``exposes`` and ``exposesFile`` from an ingress agent."""

    node: AgentNode | None = None
    targets: list[AgentTarget] | None = None
    targets_file: AgentFile | None = None
    exposes: list[AgentExpose] | None = None
    exposes_file: AgentFile | None = None


def parse_status(body: bytes) -> JSON:
    """The document in ``body`` as the reconcilers read it (only the keys it sent that the schema
    names); StatusUnavailable when it is not JSON or not of that shape."""
    try:
        document = AgentStatusDocument.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        if first["type"] == "json_invalid":
            raise StatusUnavailable(f"the body is not JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise StatusUnavailable("the body is not a JSON object") from None
        where = ".".join(str(part) for part in first["loc"])
        raise StatusUnavailable(f"the body is not a /status document: {where}: {first['msg']}{more}") from None
    return document.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n and not n % (1 << 20) else f"{n} bytes"


class HttpAgentStatus:
    """Production reader: the agent's status Service, ``<service(owner)>.<ns>.svc`` (by default
    an egress agent's, ``<egress>-egress-agent``), or ``url(owner)`` when given.

    Any pod carrying the agent's labels answers behind that Service, so nothing in the answer is
    taken on trust: the read ends after ``timeout`` seconds, holds at most ``max_bytes`` of body
    (a larger ``Content-Length`` is refused unread) and a bounded head (:data:`HEAD_FIELDS`),
    asks for and accepts only an uncompressed body, follows no redirect, and the body must parse
    as :class:`AgentStatusDocument`. Each
    failure is logged with its reason and read as None, "agent status unavailable", which the
    reconcilers show as Unknown (a target's or expose's state, ``AgentStatusUnknown``).
    """

    def __init__(self, timeout: float = STATUS_TIME_LIMIT, *, service: Callable[[Any], str] = agent_name,
                 url: Callable[[Any], str] | None = None, max_bytes: int = STATUS_MAX_BYTES) -> None:
        self.timeout = timeout
        self.service = service
        self.max_bytes = max_bytes
        self._url = url

    def status_url(self, owner: Any) -> str:
        if self._url is not None:
            return self._url(owner)
        return f"http://{self.service(owner)}.{owner.metadata.namespace}.svc:{HEALTH_PORT}{STATUS_PATH}"

    async def read(self, owner: Any) -> JSON | None:
        url = self.status_url(owner)
        try:
            return await self.fetch(url)
        except StatusUnavailable as exc:
            (log.debug if exc.routine else log.warning)("agent status unavailable", url=url, reason=exc.reason)
            return None

    async def fetch(self, url: str) -> JSON:
        """The document at ``url``; StatusUnavailable with the reason when there is none."""
        answered = False
        try:
            async with asyncio.timeout(self.timeout), aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.timeout), auto_decompress=False,
                    max_line_size=HEAD_FIELD_BYTES, max_field_size=HEAD_FIELD_BYTES,
                    max_headers=HEAD_FIELDS) as session, \
                    session.get(url, allow_redirects=False, headers={"Accept-Encoding": "identity"}) as resp:
                answered = True
                body = await self._body(resp)
        except TimeoutError:
            if answered:
                raise StatusUnavailable(f"the body did not arrive within {self.timeout:g} s") from None
            raise StatusUnavailable(f"no answer within {self.timeout:g} s", routine=True) from None
        except aiohttp.ClientResponseError as exc:  # a response aiohttp would not parse
            raise StatusUnavailable(f"not a valid HTTP response: {exc.message}") from None
        except aiohttp.ClientError as exc:
            raise StatusUnavailable(f"cannot be asked: {str(exc) or type(exc).__name__}", routine=True) from None
        return parse_status(body)

    async def _body(self, resp: aiohttp.ClientResponse) -> bytes:
        if resp.status != 200:
            raise StatusUnavailable(f"HTTP {resp.status} {resp.reason or ''}".rstrip(), routine=True)
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise StatusUnavailable(f"the body is compressed ({encoding}); only an uncompressed one is read")
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            raise StatusUnavailable(f"the body ({resp.content_length} bytes) is larger than {_size(self.max_bytes)}")
        body = bytearray()
        while chunk := await resp.content.read(self.max_bytes + 1 - len(body)):
            body += chunk
            if len(body) > self.max_bytes:
                raise StatusUnavailable(f"the body is larger than {_size(self.max_bytes)}")
        return bytes(body)


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
    state, router = str(entry.get("state") or agent_status.UNKNOWN), _router_name(entry, nodes)
    message = str(entry.get("message") or "")
    if state == agent_status.READY:
        if entry.get("reachable") is False:
            message = message or "routed, but the agent's probe did not connect"
        return TargetState(name, service, "Ready", message or "routed", router, entry)
    if state == agent_status.UNRESOLVED:
        return TargetState(name, service, "Unresolved", (
            f"{message or 'the address does not resolve'}: the agent resolves names with the tailnet's DNS "
            "(MagicDNS names, and the nameservers Headscale hands out); check the spelling, or give an IP "
            "address"), router, entry)
    if state == agent_status.NO_ROUTE:
        return TargetState(name, service, "NoGrant", message or "the agent's netmap has no route to the target; "
                           "the policy probably does not grant the tag access", router, entry)
    return TargetState(name, service, "Unknown", message or f"the agent reports {state}", router, entry)
