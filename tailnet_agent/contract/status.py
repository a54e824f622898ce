"""The agent's ``GET /status`` document: what the agent sees, as the operator reads it.

The operator's Egress reconciler refines a target's ``state`` with Headscale's data (``NoRoute``
becomes NotAdvertised, NotApproved or NoGrant); its Ingress reconciler turns each expose's
``listening``, ``reachable`` and hosts into conditions. An egress agent answers
:class:`EgressStatus`, an ingress agent :class:`IngressStatus`; times are ISO 8601 in UTC with a
``Z``. The agent builds exactly these shapes; the operator reads them leniently (every key may be
missing, unknown keys are dropped), since any pod with the agent's labels can answer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, TypedDict

__all__ = [
    "NO_ROUTE",
    "READY",
    "ROUTE_STATES",
    "UNKNOWN",
    "UNRESOLVED",
    "EgressStatus",
    "ExposeEntry",
    "FileEntry",
    "HostEntry",
    "IngressStatus",
    "NodeEntry",
    "TargetEntry",
    "iso",
]

READY: Final = "Ready"
"""A peer in the netmap carries a route to the target (or is the target)."""
NO_ROUTE: Final = "NoRoute"
"""The target resolves, but no peer in the netmap carries a route to it."""
UNRESOLVED: Final = "Unresolved"
"""The target's name does not resolve with the tailnet's DNS."""
UNKNOWN: Final = "Unknown"
"""No netmap yet, or the name has not been looked up yet."""
ROUTE_STATES: Final = (READY, NO_ROUTE, UNRESOLVED, UNKNOWN)


class NodeEntry(TypedDict):
    """``node``: the agent's own node."""

    id: str | None
    """Headscale's node id as its API spells it; None before the first netmap."""
    name: str
    """The MagicDNS name without the trailing dot; the hostname before the first netmap."""
    addresses: list[str]


class TargetEntry(TypedDict):
    """One element of ``targets`` (egress); keys are spelled as on the wire (camelCase)."""

    name: str
    address: str
    ports: list[int]
    state: str
    """One of :data:`ROUTE_STATES`."""
    router: str | None
    """The MagicDNS name of the peer carrying the route."""
    routerId: str | None
    message: str
    reachable: bool | None
    """The last probe connected; None before the first probe."""
    latencyMs: float | None
    checkedAt: str | None


class FileEntry(TypedDict):
    """``targetsFile`` / ``exposesFile``: the followed file."""

    error: str | None
    """Why the file on disk is not in force; None when it is."""
    loadedAt: str | None
    """When the list in force was read."""


class HostEntry(TypedDict):
    """One virtual host of an http expose: its certificate."""

    name: str
    alias: str | None
    error: str | None
    """Why the certificate files do not load; None when they do."""
    notAfter: str | None


class ExposeEntry(TypedDict):
    """One element of ``exposes`` (ingress)."""

    name: str
    port: int
    mode: str
    listening: bool
    message: str | None
    """Why the port is not listening."""
    backend: str
    """``host:port`` of the backend."""
    reachable: bool | None
    latencyMs: float | None
    checkedAt: str | None
    backendError: str | None
    hosts: list[HostEntry]


class EgressStatus(TypedDict):
    """An egress agent's document."""

    node: NodeEntry
    targets: list[TargetEntry]
    targetsFile: FileEntry


class IngressStatus(TypedDict):
    """An ingress agent's document."""

    node: NodeEntry
    exposes: list[ExposeEntry]
    exposesFile: FileEntry


def iso(when: datetime) -> str:
    """A time as the document writes it: ISO 8601 with ``Z`` for UTC."""
    return when.isoformat().replace("+00:00", "Z")
