"""Writing status the one way: conditions merged, compared with what is cached, applied if different.

:class:`StatusWriter` builds the status a field manager owns from the fields and conditions a
reconcile decided, merges the conditions into the cached ones (``lastTransitionTime`` moves only
when a condition's status changes; ``observedGeneration`` is the object's generation), and
applies it on the status subresource only when :func:`~tailnet_operator.runtime.needs_apply`
says it would change something: a value differs, or a field this manager owned is no longer
sent. That is the single comparison rule; there is no write when it finds nothing to change.
"""

from __future__ import annotations

from collections.abc import Iterable

from tailnet_operator.runtime import Clock, Resource, Writer, needs_apply
from tailnet_operator.types import JSON

from . import conditions
from .conditions import Cond

__all__ = ["StatusWriter"]


class StatusWriter:
    """Applies status as ``field_manager`` through ``writer``, reading the time from ``clock``."""

    def __init__(self, writer: Writer, clock: Clock, *, field_manager: str) -> None:
        self.writer = writer
        self.clock = clock
        self.field_manager = field_manager

    def desired(self, obj: JSON, conds: Iterable[Cond], fields: JSON | None = None, *,
                keep: Iterable[str] = (), observed_generation: bool = True) -> JSON:
        """The status this manager applies: ``fields``, ``observedGeneration`` (unless told not
        to) and the conditions of ``conds`` plus those of the types in ``keep`` as they are."""
        conds = list(conds)
        generation = int((obj.get("metadata") or {}).get("generation") or 1)
        current = obj.get("status") or {}
        merged = conditions.merge(current.get("conditions"), conds, generation=generation, now=self.clock.utcnow())
        status: JSON = dict(fields or {})
        if observed_generation:
            status["observedGeneration"] = generation
        status["conditions"] = conditions.only(merged, {c.type for c in conds} | set(keep))
        return status

    async def write(self, resource: Resource, obj: JSON, conds: Iterable[Cond], fields: JSON | None = None, *,
                    keep: Iterable[str] = (), observed_generation: bool = True) -> bool:
        """Apply the desired status of ``obj`` (as cached) if it differs; True when it was written."""
        meta = obj.get("metadata") or {}
        identity = {k: meta[k] for k in ("name", "namespace") if meta.get(k)}
        body = {"metadata": identity,
                "status": self.desired(obj, conds, fields, keep=keep, observed_generation=observed_generation)}
        if not needs_apply(body, obj, manager=self.field_manager, subresource="status"):
            return False
        await self.writer.apply_status(resource, body, field_manager=self.field_manager)
        return True
