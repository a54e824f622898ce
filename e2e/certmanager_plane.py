"""A control plane with cert-manager: its CRDs, its controllers (the certificates and issuer
controllers and the ingress-shim) and a CA ClusterIssuer, for the tests of what cert-manager
issues for an ingress.

The plane is a control plane of its own: the shared one must stay without cert-manager's CRDs,
whose absence other tests rely on (``CertManagerNotInstalled``).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hack.crds import install_crds
from hack.localenv import CertManager, ControlPlane, Environment
from hack.localenv._pki import CertificateAuthority
from hack.localenv.certmanager import crd_bodies
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.kinds import SECRET
from tailnet_operator.runtime.kinds import Resource as KubeResource

from .operator import get_or_none

__all__ = ["CLUSTER_ISSUER", "ISSUER", "CertManagerPlane", "ca_cluster_issuer", "issued", "plane_with_cert_manager"]

CLUSTER_ISSUER = KubeResource("cert-manager.io", "v1", "clusterissuers", "ClusterIssuer", namespaced=False)
ISSUER = "e2e-ca"
"""The CA ClusterIssuer's name (its CA Secret's too, in the ``cert-manager`` namespace)."""


@dataclass
class CertManagerPlane:
    plane: ControlPlane
    manager: CertManager


@contextlib.contextmanager
def plane_with_cert_manager(environment: Environment) -> Iterator[CertManagerPlane]:
    """A control plane with the project's and cert-manager's CRDs and cert-manager's controllers
    running against it (ClusterIssuers' Secrets in the ``cert-manager`` namespace)."""
    plane = environment.control_plane()
    install_crds(plane.api_client())
    install_crds(plane.api_client(), crd_bodies())
    plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": "cert-manager"}})
    manager = environment.cert_manager(plane.kubeconfig, cluster_namespace="cert-manager")
    try:
        yield CertManagerPlane(plane, manager)
    finally:
        manager.stop()


async def ca_cluster_issuer(admin: Client, directory: Path) -> CertificateAuthority:
    """A CA of the test's own and the ClusterIssuer :data:`ISSUER` that signs with it."""
    ca = CertificateAuthority(directory, "e2e-issuer")
    await admin.apply(SECRET, {"metadata": {"name": ISSUER, "namespace": "cert-manager"},
                               "type": "kubernetes.io/tls",
                               "data": {"tls.crt": base64.b64encode(ca.pem).decode(),
                                        "tls.key": base64.b64encode(ca.key_pem).decode()}})
    await admin.apply(CLUSTER_ISSUER, {"apiVersion": "cert-manager.io/v1", "kind": "ClusterIssuer",
                                       "metadata": {"name": ISSUER}, "spec": {"ca": {"secretName": ISSUER}}})
    return ca


async def issued(admin: Client, name: str, namespace: str) -> JSON | None:
    """The TLS Secret ``name`` once cert-manager has written a certificate into it."""
    secret = await get_or_none(admin, SECRET, name, namespace)
    return secret if secret and (secret.get("data") or {}).get("tls.crt") else None
