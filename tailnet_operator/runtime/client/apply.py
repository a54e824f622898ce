"""The Applier: a :class:`~.interfaces.Writer` that writes only what differs.

Every reconciler states the whole desired object and hands it to ``apply``; the applier reads
the cached object and sends the apply only when :func:`~.ssa.needs_apply` says it would change
something (a value differs, or a field this manager owns is no longer sent). So "a reconcile
that finds nothing to change makes zero writes" holds without each reconciler comparing by
hand. A write's answer goes back to the cache (see :meth:`~.cache.SharedCache.observe`), so the
next reconcile compares against it even before its watch event arrives.

A kind the reader does not cache is always written.
"""

from __future__ import annotations

from tailnet_operator.types import JSON

from ..kinds import Resource
from .interfaces import Reader, Writer
from .ssa import needs_apply

__all__ = ["Applier"]


class Applier:
    """Writes through ``writer`` as ``field_manager``, skipping applies that change nothing in ``reader``."""

    def __init__(self, reader: Reader, writer: Writer, *, field_manager: str) -> None:
        self.reader = reader
        self.writer = writer
        self.field_manager = field_manager
        self.skipped = 0
        """Applies found unnecessary (a counter for tests and debugging)."""

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON:
        """Apply ``body`` unless the cached object already is what it asks for; returns the object."""
        manager = field_manager or self.field_manager
        meta = body.get("metadata") or {}
        try:
            current = self.reader.get(resource, str(meta["name"]), meta.get("namespace"))
        except KeyError:
            current = None  # not cached: always write
        if current is not None and not needs_apply(body, current, manager=manager, subresource=subresource or ""):
            self.skipped += 1
            return current
        return await self.writer.apply(resource, body, subresource=subresource, force=force, field_manager=manager)

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        return await self.apply(resource, body, subresource="status", field_manager=field_manager)

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON:
        return await self.writer.delete(resource, name, namespace, uid=uid, resource_version=resource_version,
                                        propagation=propagation)
