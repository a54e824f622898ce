"""Adding and removing a controller's finalizer with server-side apply.

`metadata.finalizers` is a set under SSA, and each field manager owns its own entries. Applying
`[finalizer]` makes the manager own that entry (other managers' entries are untouched); applying
`[]` from the same manager drops exactly that entry, and the apiserver deletes an object that is
being deleted once the set is empty. No read-modify-write, so no conflicts with other writers.

Two rules keep this safe:

* **A dedicated field manager** (`field_manager`, never a controller's main one; it must stay the
  same across releases, or the old manager's entry is never removed). An apply body declares *everything*
  its manager wants to own; a finalizer-only body sent as the operator's main manager would
  remove every other field that manager applied to the object (its data, labels, spec).
* **`metadata.uid` as a precondition.** Apply on the main resource upserts: without the uid, a
  removal racing with the object's deletion would create a fresh, empty object. With it, the
  apiserver answers 409 (object gone) or 422 (a new object with the same name); both raise.
"""

from __future__ import annotations

from tailnet_operator.types import JSON

from ..client.interfaces import Writer
from ..kinds import Resource

__all__ = [
    "add_finalizer",
    "finalizer_apply_body",
    "has_finalizer",
    "remove_finalizer",
]




def has_finalizer(obj: JSON, finalizer: str) -> bool:
    """Whether `finalizer` is in `obj`'s metadata.finalizers (any manager's)."""
    return finalizer in (obj.get("metadata", {}).get("finalizers") or [])


async def add_finalizer(client: Writer, resource: Resource, obj: JSON, finalizer: str, *,
                        field_manager: str) -> JSON:
    """Make `field_manager` own `finalizer` on `obj`; returns the object the apiserver stored.

    Raises `Conflict`/`Invalid` (see the module doc) when `obj` no longer exists as that uid. The
    apiserver refuses to add a finalizer that is not already there once deletion has started.
    """
    return await _apply_finalizers(client, resource, obj, [finalizer], field_manager)


async def remove_finalizer(client: Writer, resource: Resource, obj: JSON, finalizer: str, *,
                           field_manager: str) -> JSON:
    """Drop the entry `field_manager` owns; returns the stored object (maybe already deleting).

    `finalizer` is only checked against what `obj` carries, to skip a pointless write: the set
    this manager owns becomes empty. Raises like `add_finalizer` when the object is gone.
    """
    if not has_finalizer(obj, finalizer):
        return obj
    return await _apply_finalizers(client, resource, obj, [], field_manager)


def finalizer_apply_body(resource: Resource, obj: JSON, finalizers: list[str]) -> JSON:
    """The SSA body that owns exactly `finalizers` on `obj`, guarded by its uid (pure)."""
    meta = obj["metadata"]
    metadata: JSON = {"name": meta["name"], "uid": meta["uid"], "finalizers": finalizers}
    if resource.namespaced:
        metadata["namespace"] = meta["namespace"]
    return {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": metadata}


async def _apply_finalizers(client: Writer, resource: Resource, obj: JSON, finalizers: list[str],
                            field_manager: str) -> JSON:
    return await client.apply(resource, finalizer_apply_body(resource, obj, finalizers), field_manager=field_manager)
