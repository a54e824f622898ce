"""Hosts that stand for a remote site's LAN, each in a network namespace of its own.

A host is a namespace joined to the root namespace by a veth pair on a /24 from the
benchmarking range 198.18.0.0/15 (RFC 2544), so no test ever addresses a real network.
Processes started "on" the host run inside the namespace with ``ip netns exec``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._process import ManagedProcess

_counter = itertools.count(1)


def netns_available() -> str | None:
    """None when namespaces can be created here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "iproute2 (the `ip` command) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SiteHost:
    """One namespace with one address, reachable from the root namespace through a veth pair."""

    def __init__(self, *, log_dir: Path, run_id: str) -> None:
        index = next(_counter)
        subnet_octet = (os.getpid() + index) % 250 + 1
        self.name = f"tnl{os.getpid() % 10000}-{index}"
        self.subnet = f"198.18.{subnet_octet}.0/24"
        self.gateway = f"198.18.{subnet_octet}.1"
        self.address = f"198.18.{subnet_octet}.2"
        self._veth_root = f"tr{os.getpid() % 10000}x{index}"
        self._veth_host = f"th{os.getpid() % 10000}x{index}"
        self._log_dir = log_dir
        self._run_id = run_id
        self._processes: list[ManagedProcess] = []
        self._created = False

    def create(self) -> SiteHost:
        _ip("netns", "add", self.name)
        self._created = True
        _ip("link", "add", self._veth_root, "type", "veth", "peer", "name", self._veth_host)
        _ip("link", "set", self._veth_host, "netns", self.name)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self._veth_root)
        _ip("link", "set", self._veth_root, "up")
        _ip("-n", self.name, "addr", "add", f"{self.address}/24", "dev", self._veth_host)
        _ip("-n", self.name, "link", "set", self._veth_host, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        _ip("-n", self.name, "route", "add", "default", "via", self.gateway)
        return self

    def run(self, name: str, argv: Sequence[str]) -> ManagedProcess:
        """Start a process inside the namespace; it is stopped with the host."""
        proc = ManagedProcess(f"{self.name}-{name}", ["ip", "netns", "exec", self.name, *argv],
                              log_dir=self._log_dir, run_id=self._run_id)
        proc.start()
        self._processes.append(proc)
        return proc

    def destroy(self) -> None:
        for proc in self._processes:
            proc.stop()
        if self._created:
            subprocess.run(["ip", "link", "del", self._veth_root], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._created = False
