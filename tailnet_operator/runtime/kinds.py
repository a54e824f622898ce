"""Resource descriptors: where a kind lives in the API and how its paths are built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote


@dataclass(frozen=True)
class Resource:
    """A (group, version, plural) with its kind and scope.

    ``group`` is ``""`` for the core API. Hashable, so it keys the shared cache.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def typed(self, obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` with this kind's ``apiVersion`` and ``kind`` where it has none: kube-apiserver
        leaves them out of the items of a built-in kind's list, and an object is an owner and an
        Event's subject by its kind (client-go's informers set them the same way)."""
        if "kind" in obj and "apiVersion" in obj:
            return obj
        return {"apiVersion": self.api_version, "kind": self.kind, **obj}

    @property
    def base(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        """The URL path of the collection, or of one object (and its subresource)."""
        parts = [self.base]
        if self.namespaced and namespace:
            parts += ["namespaces", quote(namespace, safe="")]
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name, safe=""))
            if subresource:
                parts.append(subresource)
        return "/".join(parts)

    def __str__(self) -> str:
        return f"{self.plural}.{self.group or 'core'}/{self.version}"


CONFIG_MAP = Resource("", "v1", "configmaps", "ConfigMap")
SECRET = Resource("", "v1", "secrets", "Secret")
SERVICE = Resource("", "v1", "services", "Service")
NAMESPACE = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
EVENT = Resource("events.k8s.io", "v1", "events", "Event")
LEASE = Resource("coordination.k8s.io", "v1", "leases", "Lease")
DEPLOYMENT = Resource("apps", "v1", "deployments", "Deployment")
STATEFUL_SET = Resource("apps", "v1", "statefulsets", "StatefulSet")
POD = Resource("", "v1", "pods", "Pod")
SERVICE_ACCOUNT = Resource("", "v1", "serviceaccounts", "ServiceAccount")
ROLE = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDING = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
NETWORK_POLICY = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
POD_DISRUPTION_BUDGET = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
CERTIFICATE = Resource("cert-manager.io", "v1", "certificates", "Certificate")
"""cert-manager's Certificate: its CRDs may be absent, so it is written, never watched."""
CUSTOM_RESOURCE_DEFINITION = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                                      "CustomResourceDefinition", namespaced=False)
