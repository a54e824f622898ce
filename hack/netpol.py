"""Which connections a set of NetworkPolicies allows, computed by cyclonus, offline.

The local test cluster cannot enforce NetworkPolicy (its kernel lacks the nftables ``queue``
expression), so the tests check the policies the operator generates against an independent
implementation of the NetworkPolicy semantics instead: cyclonus
(``github.com/mattfenwick/cyclonus``), given the policies and a model of namespaces and pods,
simulates every TCP connection between the pods and reports whether ingress and egress rules
both let it through. Nothing here talks to a cluster: cyclonus gets its inputs from files and a
``HOME`` and ``KUBECONFIG`` that do not exist.

cyclonus has no machine-readable output; ``analyze --mode probe`` prints, per probed port, an
Ingress, an Egress and a Combined table (rows: source pods, columns: destination pods, in the
same sorted order). Only the Combined tables are read, and their shape is checked strictly so
that a change in cyclonus' output fails loudly instead of yielding a wrong answer.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hack import binaries

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAMESPACE_NAME = re.compile(rf"{_DNS_LABEL}")
_POD_NAME = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_AUTO_IPS = ipaddress.ip_network("198.18.0.0/15")
"""Addresses for pods given none: the benchmarking range, which no realistic ipBlock names
except ``0.0.0.0/0`` (cyclonus matches ipBlocks against pod addresses, so every pod needs one)."""
_NAME_LABEL = "kubernetes.io/metadata.name"
_CELL = {".": True, "X": False}
_NOT_SERVED = "N"


class CyclonusError(RuntimeError):
    """cyclonus failed or printed something this module cannot read; the message carries its output."""


@dataclass(frozen=True)
class Namespace:
    """A namespace of the model; it also gets ``kubernetes.io/metadata.name``, as the API server adds it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Pod:
    """A pod of the model: it serves ``ports`` (TCP) and can be the source of any connection."""

    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()
    named_ports: Mapping[str, int] = field(default_factory=dict)
    """Container port names (name -> port, each in ``ports``), for policies that name ports."""
    ip: str = ""
    """The pod's address, which ipBlock peers match; one from 198.18.0.0/15 when empty."""

    @property
    def key(self) -> str:
        """``namespace/name``, the form of the keys of :func:`allowed`."""
        return f"{self.namespace}/{self.name}"


Connection = tuple[str, str, int]
"""(``ns/source-pod``, ``ns/destination-pod``, TCP port)."""


def allowed(
    policies: Sequence[Mapping[str, Any]],
    namespaces: Sequence[Namespace],
    pods: Sequence[Pod],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> dict[Connection, bool]:
    """Whether each TCP connection from a pod to a port another (or the same) pod serves is allowed.

    Every policy must name its namespace (``metadata.namespace``): cyclonus reads them from
    files, where no namespace defaults. ``env`` adds to cyclonus' environment (the tests use it
    to prove cyclonus never reads a kubeconfig). Raises :class:`CyclonusError` when cyclonus
    rejects the input, and ``ValueError`` for a model it could not represent faithfully.
    """
    _check_model(policies, namespaces, pods)
    ports = sorted({port for pod in pods for port in pod.ports})
    with tempfile.TemporaryDirectory(prefix="netpol-") as tmp:
        work = Path(tmp)
        policy_dir = work / "policies"
        policy_dir.mkdir()
        for index, policy in enumerate(policies):
            (policy_dir / f"{index:04d}.json").write_text(json.dumps(dict(policy)))
        model = work / "model.json"
        model.write_text(json.dumps(_probe_model(namespaces, pods, ports)))
        argv = [
            str(binaries.binary("cyclonus")), "analyze", "--verbosity", "warn", "--mode", "probe",
            "--policy-path", str(policy_dir), "--probe-path", str(model),
        ]
        offline = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        offline.update(HOME=str(work / "home"), KUBECONFIG=str(work / "no-kubeconfig"))
        try:
            proc = subprocess.run(argv, cwd=work, env={**offline, **(env or {})}, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise CyclonusError(f"cyclonus did not finish within {timeout}s: {exc.stderr!r}") from exc
    if proc.returncode != 0:
        raise CyclonusError(f"cyclonus exited with {proc.returncode}:\n{proc.stderr.strip()}")
    return _read_results(proc.stdout, pods, ports)


def _check_model(policies: Sequence[Mapping[str, Any]], namespaces: Sequence[Namespace],
                 pods: Sequence[Pod]) -> None:
    """Reject what cyclonus would misread: names that break its tables, unknown namespaces, duplicates."""
    known = {ns.name for ns in namespaces}
    if len(known) != len(namespaces):
        raise ValueError("duplicate namespace names")
    for ns in namespaces:
        if not _NAMESPACE_NAME.fullmatch(ns.name) or len(ns.name) > 63:
            raise ValueError(f"invalid namespace name {ns.name!r}")
    if len({pod.key for pod in pods}) != len(pods):
        raise ValueError("duplicate pods")
    addresses: set[str] = set()
    for pod in pods:
        if pod.namespace not in known:
            raise ValueError(f"pod {pod.key}: namespace {pod.namespace!r} is not in the model")
        if not _POD_NAME.fullmatch(pod.name) or len(pod.name) > 253:
            raise ValueError(f"invalid pod name {pod.name!r}")
        if len(set(pod.ports)) != len(pod.ports) or not all(1 <= p <= 65535 for p in pod.ports):
            raise ValueError(f"pod {pod.key}: ports must be distinct, in 1-65535: {pod.ports}")
        if not set(pod.named_ports.values()) <= set(pod.ports) or \
                len(set(pod.named_ports.values())) != len(pod.named_ports):
            raise ValueError(f"pod {pod.key}: each named port must be one of its ports, named once")
        if pod.ip:
            ipaddress.ip_address(pod.ip)
            if pod.ip in addresses:
                raise ValueError(f"pod {pod.key}: address {pod.ip} is used twice")
            addresses.add(pod.ip)
    for policy in policies:
        metadata = policy.get("metadata") or {}
        if not metadata.get("namespace") or metadata["namespace"] not in known:
            raise ValueError(f"policy {metadata.get('name')!r}: metadata.namespace must name a namespace of the model")


def _probe_model(namespaces: Sequence[Namespace], pods: Sequence[Pod], ports: Sequence[int]) -> dict[str, Any]:
    """cyclonus' ``SyntheticProbeConnectivityConfig``: the resources, and one TCP probe per port."""
    taken = {pod.ip for pod in pods if pod.ip}
    free: Iterator[str] = (str(ip) for ip in _AUTO_IPS.hosts() if str(ip) not in taken)
    model_pods = []
    for pod in pods:
        names = {port: name for name, port in pod.named_ports.items()}
        containers = [{"Name": f"tcp-{port}", "Port": port, "Protocol": "TCP", "PortName": names.get(port, "")}
                      for port in pod.ports]
        if not containers:
            # cyclonus sends from a pod's first container; an SCTP one is never probed (probes are TCP).
            containers = [{"Name": "client", "Port": 1, "Protocol": "SCTP", "PortName": ""}]
        model_pods.append({"Namespace": pod.namespace, "Name": pod.name, "Labels": dict(pod.labels),
                           "IP": pod.ip or next(free), "Containers": containers})
    return {
        "Resources": {
            "Namespaces": {ns.name: {_NAME_LABEL: ns.name, **ns.labels} for ns in namespaces},
            "Pods": model_pods,
        },
        "Probes": [{"Protocol": "TCP", "Port": port} for port in ports],
    }


def _read_results(stdout: str, pods: Sequence[Pod], ports: Sequence[int]) -> dict[Connection, bool]:
    """The verdicts of the Combined table of each probe, in probe order (a last one, for pods
    read from a cluster, is always empty here and ignored)."""
    tables = _combined_tables(stdout)
    if len(tables) != len(ports) + 1:
        raise CyclonusError(f"expected {len(ports) + 1} Combined tables, found {len(tables)}:\n{stdout}")
    order = sorted(pod.key for pod in pods)
    serves = {pod.key: set(pod.ports) for pod in pods}
    results: dict[Connection, bool] = {}
    for port, rows in zip(ports, tables, strict=False):
        if [row[0] for row in rows] != order or any(len(row) != len(order) + 1 for row in rows):
            raise CyclonusError(f"unexpected Combined table for port {port}, want rows {order}:\n{stdout}")
        for row in rows:
            for destination, cell in zip(order, row[1:], strict=True):
                if port not in serves[destination]:
                    if cell != _NOT_SERVED:
                        raise CyclonusError(f"{row[0]} -> {destination}:{port} is {cell!r}, expected 'N'")
                elif cell in _CELL:
                    results[(row[0], destination, port)] = _CELL[cell]
                else:
                    raise CyclonusError(f"{row[0]} -> {destination}:{port}: unknown verdict {cell!r}")
    return results


def _combined_tables(stdout: str) -> list[list[list[str]]]:
    """The body rows of every table printed under a ``Combined:`` line, as lists of cells.

    A table is ``+---`` borders around a header (which may wrap over several lines, and whose
    names cyclonus upper-cases, so it is not read) and the body; rows never wrap, because pod
    keys contain no spaces.
    """
    lines = stdout.splitlines()
    tables: list[list[list[str]]] = []
    for start, line in enumerate(lines):
        if line != "Combined:":
            continue
        borders = 0
        rows: list[list[str]] = []
        for text in lines[start + 1:]:
            if text.startswith("+"):
                borders += 1
                if borders == 3:
                    break
            elif text.startswith("|") and text.endswith("|"):
                if borders == 2:
                    rows.append([cell.strip() for cell in text[1:-1].split("|")])
            else:
                break
        if borders != 3:
            raise CyclonusError(f"unreadable Combined table at line {start + 1}:\n{stdout}")
        tables.append(rows)
    return tables
