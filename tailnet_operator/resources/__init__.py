"""Pure builders of the objects the operator owns: desired state in, manifest dict out."""

from __future__ import annotations

from typing import Any

MANAGED_BY = {"app.kubernetes.io/managed-by": "tailnet-operator"}


def controller_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference that makes ``owner`` the controller (garbage collection follows it)."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def owned_metadata(owner: dict[str, Any], *, name: str, namespace: str, tailnet: str,
                   annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """metadata for an object a Tailnet's reconciler owns: labels, owner and optional annotations."""
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace,
        "labels": {**MANAGED_BY, "tailnet.dev/tailnet": tailnet},
        "ownerReferences": [controller_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta
