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
                   annotations: dict[str, str] | None = None,
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
    """metadata for an object a reconciler owns: labels (``labels`` added to the common ones),
    ``owner`` as controller and optional annotations."""
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace,
        "labels": {**MANAGED_BY, **(labels or {}), "tailnet.dev/tailnet": tailnet},
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
