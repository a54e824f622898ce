"""Pure builders of the objects the operator owns: desired state in, manifest dict out."""

from __future__ import annotations

from typing import Any

from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL

__all__ = ["controller_reference", "http_probe", "owned_metadata", "restricted_pod_security_context",
           "restricted_security_context"]


def controller_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference that makes ``owner`` the controller (garbage collection follows it)."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def owned_metadata(owner: dict[str, Any], *, name: str, namespace: str, tailnet: str,
                   annotations: dict[str, str] | None = None,
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
    """metadata for an object a reconciler owns: labels (``labels`` added to the common ones),
    ``owner`` as controller and optional annotations."""
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace,
        "labels": {**MANAGED_BY, **(labels or {}), TAILNET_LABEL: tailnet},
        "ownerReferences": [controller_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def restricted_security_context(uid: int) -> dict[str, Any]:
    """A container that meets the ``restricted`` Pod Security level: non-root, no capabilities,
    no privilege escalation, read-only root filesystem, the runtime's default seccomp profile."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_pod_security_context(uid: int) -> dict[str, Any]:
    """The pod-level half of :func:`restricted_security_context`."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def http_probe(path: str, port: int, period: int) -> dict[str, Any]:
    """An HTTP GET probe with the project's timeouts."""
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": 3}
