"""Hosts that stand for a remote site's LAN, each in a network namespace of its own.

A host is a namespace joined to the root namespace by a veth pair on a /24 from the
benchmarking range 198.18.0.0/15 (RFC 2544), so no test ever addresses a real network.
Processes started "on" the host run inside the namespace with ``ip netns exec``.

Only processes of the router's user (``ROUTER_UID``) can reach the site from the root
namespace: the route to the /24 lives in a routing table of its own, selected by a uid rule.
Everything else, including tailscaled nodes that are not the site's router, must cross the
tailnet to get there, as they would to a real branch office.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ._process import ManagedProcess

_counter = itertools.count(1)

ROUTER_UID = 65534
"""The user subnet-router processes run as (``nobody``); the only one routed to site LANs."""


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
        self._table = str(10000 + subnet_octet)
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
        # Everyone else gets "unreachable", never the default route out of this machine.
        _ip("route", "replace", "unreachable", self.subnet)
        _ip("route", "add", self.subnet, "dev", self._veth_root, "src", self.gateway, "table", self._table)
        _ip("rule", "add", "uidrange", f"{ROUTER_UID}-{ROUTER_UID}", "lookup", self._table,
            "priority", self._table)
        # Replies to the router's address pass the reverse-path check through the same table.
        _ip("rule", "add", "from", self.gateway, "lookup", self._table, "priority", self._table)
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

    def serve_http(self, port: int = 8080) -> ManagedProcess:
        """An HTTP server on the host's address that answers ``hello from ADDRESS:PORT path P``."""
        return self.serve(f"http-{port}", Path(__file__).with_name("httpecho.py"), port)

    def serve_echo(self, port: int) -> ManagedProcess:
        """A TCP echo server on the host's address: echoes until EOF, then half-closes."""
        return self.serve(f"echo-{port}", Path(__file__).with_name("tcpecho.py"), port)

    def serve(self, name: str, script: Path, port: int) -> ManagedProcess:
        """``python3 SCRIPT ADDRESS PORT [serve]`` on the host, once it prints ``listening``."""
        from ._process import wait_until

        proc = self.run(name, [sys.executable, "-u", str(script), self.address, str(port)])

        def listening() -> bool:
            proc.check_running()
            return "listening" in proc.log_tail()

        wait_until(listening, timeout=10, what=f"{name} on {self.address}:{port}")
        return proc

    def destroy(self) -> None:
        for proc in self._processes:
            proc.stop()
        if self._created:
            for _ in range(2):
                subprocess.run(["ip", "rule", "del", "priority", self._table], capture_output=True)
            subprocess.run(["ip", "route", "del", "unreachable", self.subnet], capture_output=True)
            subprocess.run(["ip", "route", "flush", "table", self._table], capture_output=True)
            subprocess.run(["ip", "link", "del", self._veth_root], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._created = False
