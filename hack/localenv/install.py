"""Install the operator into a cluster exactly as a user does: ``kubectl apply -k`` over
``manifests/``, with only the image named by a kustomization of one's own."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from .node import deployment_available, kubectl

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "tailnet-system"
OPERATOR_DEPLOYMENT = "tailnet-operator"


INSTALLED_IMAGE = "localhost/tailnet-operator"
"""The image ``manifests/kustomization.yaml`` installs (its ``images:`` entry); an overlay renames that."""


def install_overlay(directory: Path, image_ref: str) -> Path:
    """A kustomization over ``manifests/`` that sets the image, as a user's own overlay would."""
    repository, tag = image_ref.rsplit(":", 1)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes bases by relative path only.
        "resources": [os.path.relpath(REPO / "manifests", directory)],
        "images": [{"name": INSTALLED_IMAGE, "newName": repository, "newTag": tag}],
    }))
    return directory


def install_operator(kubeconfig: Path, overlay: Path) -> None:
    """Server-side apply (the CRDs are too large for the client-side annotation), taking over
    the fields another manager set: CRDs kept by an uninstalled Helm release (helm.sh/resource-
    policy: keep) still carry its labels, owned by the manager ``helm``."""
    kubectl(kubeconfig, "apply", "--server-side", "--force-conflicts", "--field-manager=tailnet-install",
            "-k", str(overlay))


def operator_available(kubeconfig: Path) -> bool:
    return deployment_available(kubeconfig, OPERATOR_NAMESPACE, OPERATOR_DEPLOYMENT)
