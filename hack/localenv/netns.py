"""Hosts that stand for a remote site's LAN, each in a network namespace of its own.

A host is a namespace joined to the root namespace by a veth pair on a /24 from the
benchmarking range 198.18.0.0/15 (RFC 2544), so no test ever addresses a real network.
Processes started "on" the host run inside the namespace with ``ip netns exec``.

Only processes of the router's user (``ROUTER_UID``) can reach the site from the root
namespace: the route to the /24 lives in a routing table of its own, selected by a uid rule.
Everything else, including tailscaled nodes that are not the site's router, must cross the
tailnet to get there, as they would to a real branch office. A host made ``reachable`` stands for
a machine of a tailnet user instead: the main table routes to it, so that it reaches the node
address (Headscale, the apiserver) and gets the answers.

Each namespace has a ``resolv.conf`` of its own that names no server (``ip netns exec`` puts
``/etc/netns/<name>/resolv.conf`` in place), so nothing run there looks a name up outside the
machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._process import ManagedProcess

_counter = itertools.count(1)

SITE_SUBNETS = 250
"""Site hosts take 198.18.1.0/24 to 198.18.250.0/24, one each."""
_LOCK = Path("/run/lock/tailnet-site-hosts.lock")

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


@contextlib.contextmanager
def _subnets_locked() -> Iterator[None]:
    """Hold the host-wide lock under which a site host claims its /24: test processes that run
    side by side (``hack.suite``) must never pick the same one."""
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _claimed_octets() -> set[int]:
    """Third octets of the 198.18.X.0/24 subnets that have a route in the main table."""
    out = subprocess.run(["ip", "-j", "route", "show", "root", "198.18.0.0/16"],
                         capture_output=True, text=True, check=True).stdout
    claimed = set()
    for route in json.loads(out or "[]"):
        parts = str(route.get("dst", "")).split(".")
        if len(parts) == 4 and parts[3] == "0/24":
            claimed.add(int(parts[2]))
    return claimed


def _free_octet(first: int) -> int:
    """The first unclaimed site subnet from ``first`` on, wrapping around."""
    claimed = _claimed_octets()
    for step in range(SITE_SUBNETS):
        octet = (first - 1 + step) % SITE_SUBNETS + 1
        if octet not in claimed:
            return octet
    raise RuntimeError(f"all {SITE_SUBNETS} site subnets in 198.18.0.0/16 are in use")


class SiteHost:
    """One namespace with one address, reachable from the root namespace through a veth pair."""

    def __init__(self, *, log_dir: Path, run_id: str, reachable: bool = False) -> None:
        index = next(_counter)
        self.reachable = reachable
        self._first_octet = (os.getpid() + index) % SITE_SUBNETS + 1
        self.name = f"tnl{os.getpid() % 10000}-{index}"
        self._veth_root = f"tr{os.getpid() % 10000}x{index}"
        self._veth_host = f"th{os.getpid() % 10000}x{index}"
        self.subnet = self.gateway = self.address = self._table = ""
        self._log_dir = log_dir
        self._run_id = run_id
        self._processes: list[ManagedProcess] = []
        self._created = False

    def create(self) -> SiteHost:
        with _subnets_locked():
            octet = _free_octet(self._first_octet)
            self.subnet = f"198.18.{octet}.0/24"
            self.gateway = f"198.18.{octet}.1"
            self.address = f"198.18.{octet}.2"
            self._table = str(10000 + octet)
            # Everyone else gets "unreachable", never the default route out of this machine; the
            # route is also the subnet's claim, seen by every other test process on this host.
            _ip("route", "add", "unreachable", self.subnet)
            self._created = True
        _ip("netns", "add", self.name)
        self._resolv_conf.parent.mkdir(parents=True, exist_ok=True)
        self._resolv_conf.write_text("# no server: nothing here looks a name up outside this machine\n")
        _ip("link", "add", self._veth_root, "type", "veth", "peer", "name", self._veth_host)
        _ip("link", "set", self._veth_host, "netns", self.name)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self._veth_root)
        _ip("link", "set", self._veth_root, "up")
        _ip("route", "add", self.subnet, "dev", self._veth_root, "src", self.gateway, "table", self._table)
        if self.reachable:  # the claim stays a route of the main table, now to the host
            _ip("route", "replace", self.subnet, "dev", self._veth_root, "src", self.gateway)
        _ip("rule", "add", "uidrange", f"{ROUTER_UID}-{ROUTER_UID}", "lookup", self._table,
            "priority", self._table)
        # Replies to the router's address pass the reverse-path check through the same table.
        _ip("rule", "add", "from", self.gateway, "lookup", self._table, "priority", self._table)
        _ip("-n", self.name, "addr", "add", f"{self.address}/24", "dev", self._veth_host)
        _ip("-n", self.name, "link", "set", self._veth_host, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        _ip("-n", self.name, "route", "add", "default", "via", self.gateway)
        return self

    @property
    def _resolv_conf(self) -> Path:
        return Path("/etc/netns") / self.name / "resolv.conf"

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
            subprocess.run(["ip", "route", "del", self.subnet], capture_output=True)
            subprocess.run(["ip", "route", "flush", "table", self._table], capture_output=True)
            subprocess.run(["ip", "link", "del", self._veth_root], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            shutil.rmtree(self._resolv_conf.parent, ignore_errors=True)
            self._created = False
