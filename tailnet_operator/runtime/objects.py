"""Helpers on Kubernetes objects: keys and owner references (controller-runtime's
``SetControllerReference``, kopf's ``adopt``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tailnet_operator.types import JSON

__all__ = ["AlreadyOwned", "owner_reference", "set_controller_reference"]


class AlreadyOwned(ValueError):
    """The object already has a different controller owner."""


def _identity(owner: JSON | BaseModel) -> JSON:
    if isinstance(owner, BaseModel):
        owner = owner.model_dump(by_alias=True, mode="json", include={"api_version", "kind", "metadata"})
    meta: dict[str, Any] = owner.get("metadata") or {}
    missing = [f for f, v in (("apiVersion", owner.get("apiVersion")), ("kind", owner.get("kind")),
                              ("metadata.name", meta.get("name")), ("metadata.uid", meta.get("uid"))) if not v]
    if missing:
        raise ValueError(f"an owner needs {', '.join(missing)}: pass the object as read from the API")
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"]}


def owner_reference(owner: JSON | BaseModel, *, controller: bool = True,
                    block_owner_deletion: bool = True) -> JSON:
    """An ownerReference to ``owner`` (a raw object or a parsed model read from the API).

    By default ``owner`` is the controller and blocks foreground deletion, as
    ``SetControllerReference`` does, so the garbage collector deletes the object with its owner.
    """
    ref = _identity(owner)
    if controller:
        ref["controller"] = True
    if block_owner_deletion:
        ref["blockOwnerDeletion"] = True
    return ref


def set_controller_reference(owner: JSON | BaseModel, obj: JSON) -> JSON:
    """``obj`` with ``owner`` as its controller reference (other references kept; returns ``obj``).

    Raises :class:`AlreadyOwned` when ``obj`` already names a different controller.
    """
    ref = owner_reference(owner)
    meta = obj.setdefault("metadata", {})
    refs = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != ref["uid"]]
    other = next((r for r in refs if r.get("controller")), None)
    if other is not None:
        raise AlreadyOwned(f"{meta.get('name')} is already controlled by {other.get('kind')} {other.get('name')}")
    meta["ownerReferences"] = [*refs, ref]
    return obj
