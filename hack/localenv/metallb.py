"""MetalLB's controller against a control plane: the LoadBalancer IP allocator of the local node.

Only the controller runs (``go.universe.tf/metallb/controller``, see :mod:`hack.binaries`): it
gives each Service of type LoadBalancer an address of an ``IPAddressPool`` and writes it to the
Service's status, and kube-proxy then routes that address to the Service's endpoints on the node.
No speaker announces the addresses (there is no L2 segment or BGP peer to announce them to): a
TailnetGateway advertises the pool's range on the tailnet instead. The webhook is disabled, so
pools are not validated by MetalLB; the CRDs are the module's ``config/crd/bases``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hack import binaries, versions

from ._process import ManagedProcess, free_port

__all__ = ["NAMESPACE", "MetalLB", "address_pool", "crd_bodies"]

MODULE = "go.universe.tf/metallb"
NAMESPACE = "metallb-system"
"""Where the controller reads its pools (``--namespace``)."""


def crd_bodies() -> list[dict[str, Any]]:
    """MetalLB's CRDs of the pinned version."""
    bodies = []
    for path in sorted((binaries.module_dir(MODULE, versions.METALLB) / "config" / "crd" / "bases").glob("*.yaml")):
        bodies += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return bodies


def address_pool(name: str, cidr: str) -> dict[str, Any]:
    """An ``IPAddressPool`` handing out the addresses of ``cidr``."""
    return {"apiVersion": "metallb.io/v1beta1", "kind": "IPAddressPool",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {"addresses": [cidr]}}


class MetalLB:
    """MetalLB's controller for one kube-apiserver (``kubeconfig``); pools live in :data:`NAMESPACE`."""

    def __init__(self, kubeconfig: Path, *, log_dir: Path, run_id: str) -> None:
        self.process = ManagedProcess(
            "metallb-controller",
            [binaries.binary("metallb-controller"), f"--kubeconfig={kubeconfig}", f"--namespace={NAMESPACE}",
             "--webhook-mode=disabled", "--disable-cert-rotation", f"--port={free_port()}"],
            log_dir=log_dir, run_id=run_id)

    def start(self) -> MetalLB:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()
