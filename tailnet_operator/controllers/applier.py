"""Apply a CR's desired objects and prune the ones it owns that are no longer desired.

A builder returns the complete set of objects a CR should have (:class:`Desired`); the applier
server-side applies them in order and deletes, in each pruned kind and namespace, the objects the
CR owns (an ownerReference with its uid) whose names are not in the set. Objects marked
``optional`` (a kind that may not be installed, such as cert-manager's Certificate) do not stop
the others: their refusals are returned by name for the status to report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from tailnet_operator.runtime import Reader, Resource, Writer
from tailnet_operator.runtime.errors import APIError, NotFound
from tailnet_operator.types import JSON

__all__ = ["Applied", "Applier", "Desired", "Want", "owned_by"]

log = structlog.get_logger("controllers.applier")


@dataclass(frozen=True)
class Want:
    """One desired object; ``optional``: its refusal is reported, not raised."""

    resource: Resource
    body: JSON
    optional: bool = False

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclass(frozen=True)
class Desired:
    """The objects a CR should have, in the order they are applied, and where leftovers are pruned."""

    wants: tuple[Want, ...]
    prune: tuple[tuple[Resource, str], ...] = ()
    """(kind, namespace) pairs in which objects the CR owns but no longer wants are deleted."""

    @classmethod
    def of(cls, *wants: Want | tuple[Resource, JSON], prune: Iterable[tuple[Resource, str]] = ()) -> Desired:
        return cls(tuple(w if isinstance(w, Want) else Want(*w) for w in wants), tuple(prune))


@dataclass
class Applied:
    """What the API server stored, by (kind, name); what it refused among the optional objects."""

    stored: dict[tuple[str, str], JSON] = field(default_factory=dict)
    refused: dict[tuple[str, str], APIError] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)

    def get(self, resource: Resource, name: str) -> JSON | None:
        return self.stored.get((resource.kind, name))


def owned_by(obj: JSON, uid: str) -> bool:
    """Whether ``obj`` has an ownerReference to the object with ``uid``."""
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


class Applier:
    """Applies as ``field_manager``; reads what to prune from ``reader`` (the cache)."""

    def __init__(self, reader: Reader, writer: Writer, *, field_manager: str) -> None:
        self.reader = reader
        self.writer = writer
        self.field_manager = field_manager

    async def apply(self, owner: JSON, desired: Desired) -> Applied:
        applied = Applied()
        for want in desired.wants:
            try:
                stored = await self.writer.apply(want.resource, want.body, field_manager=self.field_manager)
            except APIError as exc:
                if not want.optional:
                    raise
                applied.refused[(want.resource.kind, want.name)] = exc
                continue
            applied.stored[(want.resource.kind, want.name)] = stored
        applied.pruned = await self._prune(owner, desired)
        return applied

    async def _prune(self, owner: JSON, desired: Desired) -> list[str]:
        uid = str(owner["metadata"]["uid"])
        wanted = {(w.resource.kind, w.body["metadata"].get("namespace"), w.name) for w in desired.wants}
        gone = []
        for resource, namespace in desired.prune:
            for obj in self.reader.list(resource, namespace):
                meta = obj["metadata"]
                if not owned_by(obj, uid) or (resource.kind, meta.get("namespace"), meta["name"]) in wanted:
                    continue
                try:
                    await self.writer.delete(resource, meta["name"], meta.get("namespace"), uid=meta.get("uid"))
                except NotFound:
                    continue
                gone.append(f"{resource.kind} {meta['name']}")
                log.info("pruned an object no longer desired", owner=owner["metadata"]["name"],
                         kind=resource.kind, name=meta["name"])
        return gone
