"""The host side of the local node: its address, the pod bridge's fence, and every sysctl and
path the node's components change, put back as they were.

Every cluster address lives in 198.19.0.0/16, the upper half of the benchmarking range
198.18.0.0/15 (RFC 2544; site hosts use the lower half). An ``unreachable`` route covers the
whole /16, so a packet to a cluster address that is not on the node's bridge can never take
the machine's default route, and a guard table in nftables drops anything forwarded from a pod
to an address outside 198.18.0.0/15. Pods get no default route at all: their one route is
198.18.0.0/15 through the bridge.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLUSTER_RANGE = "198.19.0.0/16"
NODE_IP = "198.19.0.1"
POD_CIDR = "198.19.64.0/24"
POD_GATEWAY = "198.19.64.1"
SAFE_RANGE = "198.18.0.0/15"
"""The only destinations a pod may reach: cluster addresses and the tests' own hosts."""

NODE_BRIDGE = "tnode0"
"""An empty bridge that carries the node's address (the kernel has no dummy interfaces)."""
POD_BRIDGE = "tcni0"
GUARD_TABLE = "tailnet_node_guard"
TEST_TABLE_PREFIX = "tailnet_test_"
"""Tables with this prefix belong to tests that run beside the node (each deletes its own);
the node neither counts them as its leftovers nor removes them."""
NODE_GID = 64900
"""The group every process of the node runs with (no group uses it), so the guard can tell
their packets apart: a DNS query from any of them is counted and dropped."""

SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.ipv4.conf.all.route_localnet",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    "net.netfilter.nf_conntrack_tcp_be_liberal",
)
"""Host settings the node turns on (forwarding, bridge netfilter) or that kubelet and kube-proxy
are known to change; each is restored at teardown."""

HOST_PATHS = (
    Path("/run/containerd"), Path("/run/nri"), Path("/var/run/nri"), Path("/var/lib/cni"),
    Path("/var/lib/kubelet"), Path("/var/log/containers"), Path("/var/log/pods"),
    Path("/etc/cni"), Path("/opt/cni"),
)
"""Places outside the node's own directory that kubelet, containerd or CNI write to regardless
of their configured roots; whichever of them did not exist before the node is removed after."""


LOCK = Path("/run/tailnet-local-node.lock")
"""Held while a node runs: its addresses are fixed, so a second one waits for the first."""
LOCK_WAIT = 1800.0
"""Seconds a node waits for another run's node to finish before giving up."""

RECORD = Path("/run/tailnet-local-node.json")
"""What the host looked like before the node, kept while it runs, so that a run killed before its
teardown can still be undone (``python -m hack.localenv cleanup``)."""


class HostNetworkError(RuntimeError):
    """The host cannot carry a local node (or another one is running); the message says why."""


def sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls(names: Iterable[str]) -> dict[str, str]:
    """The current value of each setting the kernel has (absent ones are left out)."""
    values: dict[str, str] = {}
    for name in names:
        with contextlib.suppress(OSError):
            values[name] = sysctl_path(name).read_text().strip()
    return values


def write_sysctl(name: str, value: str) -> None:
    sysctl_path(name).write_text(value + "\n")


def _run(*argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, input=stdin)
    if check and proc.returncode != 0:
        raise HostNetworkError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return _run("ip", "link", "show", name, check=False).returncode == 0


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (the order to unmount them)."""
    prefix = str(root.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=lambda p: (p.count("/"), p), reverse=True)


def unmount_all(root: Path) -> None:
    for point in mounts_under(root):
        _run("umount", "-l", point, check=False)


def nft_tables() -> set[str]:
    """``family name`` of every nftables table on the host."""
    out = _run("nft", "-j", "list", "tables", check=False).stdout
    if not out:
        return set()
    entries = json.loads(out).get("nftables", [])
    return {f"{e['table']['family']} {e['table']['name']}" for e in entries if "table" in e}


def unreachable_route_present(cidr: str) -> bool:
    out = _run("ip", "-j", "route", "show", "type", "unreachable", check=False).stdout
    return any(r.get("dst") == cidr for r in json.loads(out or "[]"))


def route_get(address: str) -> str:
    """What the kernel would do with a packet to ``address`` from this host (``ip route get``)."""
    proc = _run("ip", "route", "get", address, check=False)
    return (proc.stdout or proc.stderr).strip()


@dataclass
class HostNetwork:
    """The node's address on an empty bridge, the unreachable route, the pod guard, and the
    record of what the host looked like before, so ``restore()`` can put it back."""

    sysctls_before: dict[str, str] = field(default_factory=dict)
    paths_before: set[Path] = field(default_factory=set)
    nft_before: set[str] = field(default_factory=set)
    _up: bool = False
    _lock: int | None = None

    @staticmethod
    def available() -> str | None:
        """None when this host can run a node, else the reason it cannot."""
        if os.geteuid() != 0:
            return "a local node needs root"
        for tool in ("ip", "nft", "iptables", "conntrack", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (hack/prereqs.sh names the packages)"
        if not Path("/proc/sys/net/bridge").exists():
            return "the kernel has no bridge netfilter (net.bridge.bridge-nf-call-iptables)"
        return None

    def setup(self, *, run_id: str = "", workdir: Path | None = None,
              reclaim: Callable[[], list[str]] | None = None) -> HostNetwork:
        """Take the host for a node. A live node holds :data:`LOCK` all along, so a bridge found
        once the lock is ours was left by a run killed before its teardown: ``reclaim`` (the
        node's own cleanup, run under this lock) undoes it first; what it cannot undo, or a
        bridge without ``reclaim``, fails the setup with what is left."""
        reason = self.available()
        if reason is not None:
            raise HostNetworkError(reason)
        self._lock = _acquire(LOCK, LOCK_WAIT)
        if link_exists(NODE_BRIDGE):
            left = reclaim() if reclaim is not None else [f"link {NODE_BRIDGE}"]
            if left:
                os.close(self._lock)
                self._lock = None
                raise HostNetworkError(
                    f"a local node killed before its teardown left {', '.join(left)}; "
                    "run `python -m hack.localenv cleanup` or remove them by hand")
        self.sysctls_before = read_sysctls(SYSCTLS)
        self.paths_before = {p for p in HOST_PATHS if p.exists()}
        self.nft_before = nft_tables()
        self._up = True
        RECORD.write_text(json.dumps({"sysctls": self.sysctls_before, "paths": sorted(map(str, self.paths_before)),
                                      "nft": sorted(self.nft_before), "run": run_id,
                                      "workdir": str(workdir or "")}))
        _run("ip", "link", "add", NODE_BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_IP}/32", "dev", NODE_BRIDGE)
        _run("ip", "link", "set", NODE_BRIDGE, "up")
        _run("ip", "route", "replace", "unreachable", CLUSTER_RANGE)
        write_sysctl("net.ipv4.ip_forward", "1")
        write_sysctl("net.bridge.bridge-nf-call-iptables", "1")
        _run("nft", "-f", "-", stdin=_guard_ruleset())
        return self

    def restore(self) -> list[str]:
        """Undo everything the node did to the host; return what could not be undone."""
        if not self._up:
            return []
        problems: list[str] = []
        for link in (POD_BRIDGE, NODE_BRIDGE):
            if link_exists(link):
                _run("ip", "link", "del", link, check=False)
        _run("ip", "route", "del", "unreachable", CLUSTER_RANGE, check=False)
        for table in self._new_tables():
            family, name = table.split(" ", 1)
            _run("nft", "delete", "table", family, name, check=False)
        for name, value in self.sysctls_before.items():
            with contextlib.suppress(OSError):
                if sysctl_path(name).read_text().strip() != value:
                    write_sysctl(name, value)
        for path in HOST_PATHS:
            if path not in self.paths_before and path.exists():
                unmount_all(path)
                shutil.rmtree(path, ignore_errors=True)
        problems += self.leftovers()
        self._up = False
        RECORD.unlink(missing_ok=True)
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None
        return problems

    @classmethod
    def from_record(cls) -> tuple[HostNetwork, str, Path | None] | None:
        """The record a node that was never torn down left behind, if any: the host as it was,
        the run id its processes carry and its directory."""
        try:
            saved = json.loads(RECORD.read_text())
        except (OSError, ValueError):
            return None
        host = cls(sysctls_before=saved["sysctls"], paths_before={Path(p) for p in saved["paths"]},
                   nft_before=set(saved["nft"]), _up=True)
        return host, saved.get("run", ""), Path(saved["workdir"]) if saved.get("workdir") else None

    def _new_tables(self) -> list[str]:
        """The tables made since the node started, other than the tests' own."""
        return sorted(t for t in nft_tables() - self.nft_before if not t.split(" ", 1)[1].startswith(TEST_TABLE_PREFIX))

    def leftovers(self) -> list[str]:
        """What of the node is still on the host (empty after a clean ``restore()``)."""
        found: list[str] = []
        found += [f"link {link}" for link in (POD_BRIDGE, NODE_BRIDGE) if link_exists(link)]
        if unreachable_route_present(CLUSTER_RANGE):
            found.append(f"route unreachable {CLUSTER_RANGE}")
        found += [f"nft table {t}" for t in self._new_tables()]
        now = read_sysctls(self.sysctls_before)
        found += [f"sysctl {k}={now[k]} (was {v})" for k, v in self.sysctls_before.items() if now.get(k) != v]
        found += [f"host path {p}" for p in HOST_PATHS if p not in self.paths_before and p.exists()]
        return found


def _acquire(path: Path, timeout: float) -> int:
    """An exclusive lock on ``path`` (released when the descriptor closes, or the process dies)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise HostNetworkError(f"another local node held {path} for {timeout:.0f}s") from None
            time.sleep(1)


def _guard_ruleset() -> str:
    """Drop whatever a pod sends through the host to an address outside the safe range (IPv6 too,
    but for link-local and multicast, which stay on the bridge), and any DNS query a node process
    sends at all (cluster names are CoreDNS's, asked from pods)."""
    return f"""
table inet {GUARD_TABLE} {{
  chain forward {{
    type filter hook forward priority -10; policy accept;
    ip saddr {POD_CIDR} ip daddr != {SAFE_RANGE} counter drop comment "pod-escape"
    iifname "{POD_BRIDGE}" ip6 daddr != {{ fe80::/10, ff00::/8 }} counter drop comment "pod-escape"
  }}
  chain output {{
    type filter hook output priority -10; policy accept;
    meta skgid {NODE_GID} udp dport 53 counter drop comment "node-dns"
    meta skgid {NODE_GID} tcp dport 53 counter drop comment "node-dns"
  }}
}}
"""


def guard_counts() -> dict[str, int]:
    """Packets the guard has dropped so far, by rule: ``pod-escape`` and ``node-dns``."""
    out = _run("nft", "-j", "list", "table", "inet", GUARD_TABLE, check=False).stdout
    counts: dict[str, int] = {"pod-escape": 0, "node-dns": 0}
    for entry in json.loads(out or '{"nftables": []}').get("nftables", []):
        rule = entry.get("rule", {})
        for expr in rule.get("expr", []):
            if "counter" in expr and rule.get("comment") in counts:
                counts[rule["comment"]] += int(expr["counter"]["packets"])
    return counts


def cgroup_dirs(name: str, controllers: Sequence[Path] | None = None) -> list[Path]:
    """``name`` under every cgroup hierarchy that has it (kubelet's ``kubepods`` tree)."""
    roots = controllers if controllers is not None else [p for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()]
    return [root / name for root in roots if (root / name).is_dir()]


def remove_cgroup_tree(path: Path, timeout: float = 10.0) -> bool:
    """Kill what still runs in a cgroup tree, then rmdir it deepest first; True when it is gone."""
    dirs = [*sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True), path]
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(pid) for d in dirs for pid in _cgroup_procs(d)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in dirs:
        with contextlib.suppress(OSError):
            child.rmdir()
    return not path.exists()


def _cgroup_procs(directory: Path) -> list[str]:
    try:
        return (directory / "cgroup.procs").read_text().split()
    except OSError:
        return []
