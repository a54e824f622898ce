"""cert-manager against a control plane: its CRDs, its certificates and issuer controllers and its
ingress-shim.

The controllers are the project's test-only build (``hack/certmanager/main.go``, see
:mod:`hack.binaries`) of cert-manager's registered controllers; they only talk to kube-apiserver,
so no node is needed. The CRDs come from the same module version's ``deploy/crds``. There is no
webhook: objects are neither defaulted nor validated by cert-manager, which the tests do not need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hack import binaries, versions

from ._process import ManagedProcess

__all__ = ["CertManager", "crd_bodies"]

MODULE = "github.com/cert-manager/cert-manager"


def crd_bodies() -> list[dict[str, Any]]:
    """cert-manager's CRDs of the pinned version (``deploy/crds`` of its module)."""
    bodies = []
    for path in sorted((binaries.module_dir(MODULE, versions.CERT_MANAGER) / "deploy" / "crds").glob("*.yaml")):
        bodies += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return bodies


class CertManager:
    """cert-manager's controllers for one kube-apiserver (``kubeconfig``); ClusterIssuers read
    their Secrets from ``cluster_namespace``."""

    def __init__(self, kubeconfig: Path, *, cluster_namespace: str, log_dir: Path, run_id: str) -> None:
        self.kubeconfig = kubeconfig
        self.cluster_namespace = cluster_namespace
        self.process = ManagedProcess(
            "cert-manager-controller",
            [binaries.binary("cert-manager-controller"), f"--kubeconfig={kubeconfig}",
             f"--cluster-resource-namespace={cluster_namespace}"],
            log_dir=log_dir, run_id=run_id)

    def start(self) -> CertManager:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()
