"""The kind cluster of `make e2e`: created from our node image on our dockerd's ``kind`` network,
then given the host routes to its pods and the cluster DNS the tests expect (the local node's
CoreDNS: the ``hosts`` plugin over ``kube-system/tailnet-hosts``, no ``forward``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from hack import binaries, image, versions
from hack.localenv._process import wait_until
from hack.localenv.node import coredns_manifests as local_coredns

from . import docker, nodeimage, plan

READY_TIMEOUT = 300.0


def kind(*args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(binaries.binary("kind")), *args], env=docker.environment(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"kind {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(binaries.binary("kubectl")), f"--kubeconfig={kubeconfig}", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def exists(name: str = plan.CLUSTER_NAME) -> bool:
    return name in kind("get", "clusters", check=False).stdout.split()


def node_ips(name: str = plan.CLUSTER_NAME) -> dict[str, str]:
    """Node container -> its address on the kind network."""
    names = kind("get", "nodes", "--name", name).stdout.split()
    fmt = "{{.Name}} {{(index .NetworkSettings.Networks \"" + plan.NETWORK + "\").IPAddress}}"
    out = docker.docker("inspect", "--format", fmt, *names).stdout
    return {line.split()[0].lstrip("/"): line.split()[1] for line in out.splitlines() if line.strip()}


def create(kubeconfig: Path, workdir: Path, name: str = plan.CLUSTER_NAME) -> float:
    """Create the cluster (node image built unless cached); return the seconds ``kind create`` took."""
    node = nodeimage.ensure_node_image()
    config = plan.kind_config(node.ref, etcd=versions.ETCD)
    config["name"] = name
    path = workdir / "kind-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    kind("create", "cluster", "--name", name, "--config", str(path), "--kubeconfig", str(kubeconfig),
         "--wait", "0s", "--retain")
    return time.monotonic() - started


def wire(kubeconfig: Path, name: str = plan.CLUSTER_NAME) -> None:
    """Host routes to the nodes' pods, then the cluster DNS."""
    docker.add_routes(list(node_ips(name).values()))
    docs = plan.coredns_manifests(local_coredns(image.coredns_image().ref))
    kubectl(kubeconfig, "apply", "--server-side", "--field-manager=tailnet-kind", "-f", "-",
            stdin=yaml.safe_dump_all(docs))


def wait_ready(kubeconfig: Path, nodes: int = plan.WORKERS + 1) -> None:
    """Every node Ready, every kube-system pod Ready, CoreDNS Available."""
    def nodes_ready() -> bool:
        items = json.loads(kubectl(kubeconfig, "get", "nodes", "-o", "json").stdout)["items"]
        ready = [n for n in items if _condition(n, "Ready") == "True"]
        return len(ready) == nodes

    wait_until(nodes_ready, timeout=READY_TIMEOUT, what=f"{nodes} kind nodes Ready")

    def system_ready() -> bool:
        items = json.loads(kubectl(kubeconfig, "-n", "kube-system", "get", "pods", "-o", "json").stdout)["items"]
        return bool(items) and all(_condition(p, "Ready") == "True" for p in items)

    wait_until(system_ready, timeout=READY_TIMEOUT, what="kube-system pods Ready")


def _condition(obj: dict[str, Any], kind_: str) -> str | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind_:
            return str(cond["status"])
    return None


def delete(name: str = plan.CLUSTER_NAME) -> None:
    if docker.daemon_pid() is not None and exists(name):
        kind("delete", "cluster", "--name", name)


def logs(workdir: Path, name: str = plan.CLUSTER_NAME) -> None:
    """kind's logs of every node (journal, containers) for a failed run."""
    kind("export", "logs", str(workdir / "kind-logs"), "--name", name, check=False)
