"""The operator's finalizer on its CRs (:data:`tailnet_operator.names.FINALIZER`), held by its own
field manager so that no other write of the operator can drop it."""

from __future__ import annotations

from tailnet_operator.names import FINALIZER, FINALIZER_FIELD_MANAGER
from tailnet_operator.runtime import Resource, Writer, add_finalizer, has_finalizer, remove_finalizer
from tailnet_operator.types import JSON

__all__ = ["hold", "holds", "release"]


def holds(obj: JSON) -> bool:
    """Whether ``obj`` carries the operator's finalizer."""
    return has_finalizer(obj, FINALIZER)


async def hold(writer: Writer, resource: Resource, obj: JSON) -> None:
    """Add the finalizer unless ``obj`` has it."""
    if not holds(obj):
        await add_finalizer(writer, resource, obj, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)


async def release(writer: Writer, resource: Resource, obj: JSON) -> None:
    """Remove the finalizer (the object goes once no other finalizer holds it)."""
    await remove_finalizer(writer, resource, obj, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)
