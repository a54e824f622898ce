"""The local environment: real etcd, kube-apiserver, kube-controller-manager, Headscale and
tailscaled processes on 127.0.0.1, and a real single-node cluster (:mod:`.node`), for the tests
and for ``make run``.

An :class:`Environment` owns one run directory (state, certificates and a ``logs/`` folder)
and every process started through it; ``close()`` stops them all, in reverse order.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ._process import (
    RUN_MARKER,
    EnvironmentStartError,
    ManagedProcess,
    free_port,
    marked_processes,
    wait_until,
)
from .certmanager import CertManager
from .controlplane import ControlPlane
from .headscale import BASE_DOMAIN, Headscale, HeadscaleError
from .metallb import MetalLB
from .netns import ROUTER_UID, SiteHost, netns_available
from .node import Cluster
from .tailnet_guard import TailnetGuard
from .tailscale import TailscaleNode

__all__ = [
    "BASE_DOMAIN",
    "ROUTER_UID",
    "RUN_MARKER",
    "CertManager",
    "Cluster",
    "ControlPlane",
    "Environment",
    "EnvironmentStartError",
    "Headscale",
    "HeadscaleError",
    "ManagedProcess",
    "MetalLB",
    "SiteHost",
    "TailscaleNode",
    "free_port",
    "marked_processes",
    "netns_available",
    "wait_until",
]


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class Environment:
    """Starts components under one run directory and stops every one of them on ``close()``."""

    def __init__(self, root: Path | None = None, *, run_id: str | None = None) -> None:
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.root = root or Path(tempfile.mkdtemp(prefix=f"tailnet-env-{self.run_id}-"))
        self.log_dir = self.root / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # site routers run as another user and read their files here
        self._owned: list[_Stoppable | SiteHost] = []
        self._names = itertools.count(1)
        self._guard: TailnetGuard | None = None

    def control_plane(self) -> ControlPlane:
        index = next(self._names)
        plane = ControlPlane(self._dir(f"controlplane-{index}"), log_dir=self.log_dir / f"controlplane-{index}",
                             run_id=self.run_id)
        self._owned.append(plane)
        return plane.start()

    def headscale(self, name: str | None = None, *, address: str = "127.0.0.1",
                  extra_records: list[dict[str, str]] | None = None, stun_ipv6: bool = False) -> Headscale:
        """A started Headscale; ``address`` is where it listens (the node address for pods);
        ``extra_records`` go to its ``dns.extra_records``; ``stun_ipv6``: its STUN on ``[::1]`` only."""
        name = name or f"headscale-{next(self._names)}"
        server = Headscale(self._dir(name), log_dir=self.log_dir, run_id=self.run_id, name=name,
                           address=address, extra_records=extra_records, stun_ipv6=stun_ipv6)
        self._owned.append(server)
        return server.start()

    def tailscale_node(self, hostname: str, headscale: Headscale, *, authkey: str | None = None,
                       advertise_routes: Sequence[str] = (), accept_routes: bool = False,
                       site_router: bool = False, env: dict[str, str] | None = None,
                       host: SiteHost | None = None) -> TailscaleNode:
        """A started tailscaled; joined to ``headscale`` when an ``authkey`` is given.

        ``site_router=True`` runs it as the user that alone can reach the site hosts' LANs;
        ``env`` adds environment variables (e.g. ``TS_DEBUG_ALWAYS_USE_DERP=true``); ``host`` (one of
        :meth:`site_host` ``(reachable=True)``) runs it there on a TUN device, so that what runs on
        that host reaches tailnet addresses directly (``headscale`` must listen on an address the
        host reaches: not loopback).
        """
        self.guard_tailnet()
        node = TailscaleNode(hostname, self._dir(f"tailscale-{hostname}"), headscale=headscale,
                             log_dir=self.log_dir, run_id=self.run_id,
                             user=ROUTER_UID if site_router else None, env=env,
                             netns=host.name if host is not None else None)
        self._owned.append(node)
        node.start()
        if authkey is not None:
            node.up(authkey, advertise_routes=advertise_routes, accept_routes=accept_routes)
        return node

    def guard_tailnet(self) -> None:
        """Before a tailscaled starts: no tailnet address is dialled through this machine's network
        (:mod:`.tailnet_guard`), until :meth:`close`."""
        if self._guard is None:
            self._guard = TailnetGuard().start()
            self._owned.append(self._guard)

    def cert_manager(self, kubeconfig: Path, *, cluster_namespace: str) -> CertManager:
        """cert-manager's controllers against the apiserver of ``kubeconfig`` (CRDs installed by the caller)."""
        manager = CertManager(kubeconfig, cluster_namespace=cluster_namespace, log_dir=self.log_dir,
                              run_id=self.run_id)
        self._owned.append(manager)
        return manager.start()

    def metallb(self, kubeconfig: Path) -> MetalLB:
        """MetalLB's controller against the apiserver of ``kubeconfig`` (CRDs installed by the caller)."""
        allocator = MetalLB(kubeconfig, log_dir=self.log_dir, run_id=self.run_id)
        self._owned.append(allocator)
        return allocator.start()

    def cluster(self) -> Cluster:
        """A single-node cluster (needs root); one per machine at a time."""
        cluster = Cluster(self._dir("cluster"), log_dir=self.log_dir / "cluster", run_id=self.run_id)
        self._owned.append(cluster)
        return cluster.start()

    def site_host(self, *, reachable: bool = False) -> SiteHost:
        """A host in a network namespace: a remote site's LAN, or with ``reachable`` a machine this
        one routes to (a tailnet user's, for :meth:`tailscale_node`'s ``host``)."""
        host = SiteHost(log_dir=self.log_dir, run_id=self.run_id, reachable=reachable)
        self._owned.append(host)
        return host.create()

    def close(self) -> None:
        while self._owned:
            item = self._owned.pop()
            with contextlib.suppress(Exception):
                if isinstance(item, SiteHost):
                    item.destroy()
                else:
                    item.stop()

    def survivors(self) -> list[tuple[int, str]]:
        """Processes of this run that are still alive (none after ``close()``)."""
        return list(marked_processes(self.run_id))

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_root() -> Path:
    """Where ``make run`` keeps its environment: ``$TAILNET_LOCALENV_DIR`` or ``./_artifacts/localenv``."""
    return Path(os.environ.get("TAILNET_LOCALENV_DIR", "_artifacts/localenv")).resolve()
