"""The Docker engine `make e2e` runs kind on: a dockerd of its own, started for the run and stopped
by the teardown, with its data under the cache and nothing of the system's defaults (no default
bridge, no iptables, no forwarding, no /etc/docker/daemon.json, no registry).

Also the host side of kind's network: the ``kind`` docker network in 198.19.200.0/24, routes to
each node's pods, ``unreachable`` routes over the rest of the pod and Service ranges, and a guard
table; and the record of host state (sysctls the kubelets change, paths docker creates) that
teardown puts back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hack.binaries import MissingToolError, cache_root
from hack.localenv.hostnet import SYSCTLS

from . import plan

DOCKER_CLI = Path("/usr/bin/docker")
"""Debian's docker.io client, the same release as its daemon (a newer static CLI on PATH would
negotiate down, but kind is tested with matching ones)."""
DOCKERD = Path("/usr/sbin/dockerd")
RUNC = Path("/usr/sbin/runc")
"""Debian's runc, which docker.io depends on."""
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
HOST_PATHS = (Path("/lib/modules"), Path("/etc/docker/key.json"))
"""Host paths the run may create: kind bind-mounts /lib/modules (docker creates a missing source),
dockerd 20.10 writes a trust key."""
EXTRA_SYSCTLS = ("net.ipv4.conf.all.route_localnet", "net.ipv4.conf.all.arp_ignore", "fs.inotify.max_user_watches",
                 "fs.inotify.max_user_instances", "kernel.keys.maxkeys", "kernel.keys.maxbytes")


def docker_root() -> Path:
    return cache_root() / "docker"


def paths() -> plan.DaemonPaths:
    return plan.DaemonPaths(docker_root())


def require_docker() -> None:
    for tool in (DOCKER_CLI, DOCKERD):
        if not tool.is_file():
            raise MissingToolError(f"{tool} is missing: install Debian's docker.io (apt-get install docker.io)")


def shim_dir() -> Path:
    """A directory that puts Debian's docker client first on PATH for kind."""
    directory = docker_root() / "bin"
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "docker"
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        link.symlink_to(DOCKER_CLI)
    return directory


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every docker and kind command: our daemon, our client, our network."""
    env = dict(os.environ if base is None else base)
    env["DOCKER_HOST"] = paths().host
    env["PATH"] = f"{shim_dir()}:{env.get('PATH', '/usr/bin:/bin')}"
    env["KIND_EXPERIMENTAL_DOCKER_NETWORK"] = plan.NETWORK
    env["KIND_EXPERIMENTAL_PROVIDER"] = "docker"
    env.pop("DOCKER_CONTEXT", None)
    env.pop("DOCKER_CONFIG", None)
    return env


def docker(*args: str, check: bool = True, stdin: str | None = None, timeout: float = 600
           ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(DOCKER_CLI), *args], env=environment(), input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def _run(*cmd: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# --- the daemon -------------------------------------------------------------------------------


def daemon_pid() -> int | None:
    """The pid of our dockerd, when its pidfile names a live dockerd."""
    try:
        pid = int(paths().pidfile.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    return pid if comm == "dockerd" else None


def daemon_answers() -> bool:
    return docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0


def start_daemon() -> bool:
    """Start our dockerd unless it runs; return whether this call started it."""
    require_docker()
    if daemon_pid() is not None and daemon_answers():
        return False
    p = paths()
    for directory in (p.root, p.data_root, p.exec_root):
        directory.mkdir(parents=True, exist_ok=True)
    p.config.write_text(json.dumps(plan.daemon_config(p), indent=1) + "\n")
    p.runtime.parent.mkdir(parents=True, exist_ok=True)
    p.runtime.write_text(plan.runtime_wrapper(str(RUNC)))
    p.runtime.chmod(0o755)
    log = p.log.open("ab")
    subprocess.Popen(plan.dockerd_argv(str(DOCKERD), p), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                     env=plan.dockerd_environment(os.environ), start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if daemon_answers():
            return True
        time.sleep(0.5)
    raise RuntimeError(f"dockerd did not answer within {START_TIMEOUT:.0f}s; see {p.log}")


def stop_daemon() -> None:
    """Remove every container and network of our daemon, then stop it and clean its exec root."""
    pid = daemon_pid()
    if pid is not None and daemon_answers():
        ids = docker("ps", "-aq", check=False).stdout.split()
        if ids:
            docker("rm", "-f", "-v", *ids, check=False)
        if docker("network", "inspect", plan.NETWORK, check=False).returncode == 0:
            docker("network", "rm", plan.NETWORK, check=False)
        docker("volume", "prune", "-f", check=False)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            time.sleep(1)
            _alive(pid)
    _kill_strays()
    for mount in reversed(own_mounts()):
        _run("umount", "-l", mount, check=False)
    p = paths()
    shutil.rmtree(p.exec_root, ignore_errors=True)
    p.pidfile.unlink(missing_ok=True)
    p.socket.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs; reaps it when it is our child (``up`` in this process started it)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill_strays() -> None:
    """containerd, shims and docker-proxy processes started by our daemon that outlived it."""
    root = str(docker_root())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in cmdline and int(proc.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def own_mounts() -> list[str]:
    """Mount points under our docker root (overlays, netns files, shm), outermost first."""
    root = str(docker_root())
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target.startswith(root):
            found.append(target)
    return sorted(set(found), key=len)


# --- the host side of kind's network ----------------------------------------------------------


def ensure_network() -> None:
    """The ``kind`` network with our subnet; an existing one of another shape is refused."""
    found = docker("network", "inspect", plan.NETWORK, check=False)
    if found.returncode != 0:
        docker(*plan.network_create_args())
        return
    configs = json.loads(found.stdout)[0].get("IPAM", {}).get("Config") or []
    subnets = [c.get("Subnet") for c in configs]
    if subnets != [plan.NETWORK_SUBNET]:
        raise RuntimeError(f"docker network {plan.NETWORK} has subnets {subnets}, not [{plan.NETWORK_SUBNET}]")


def network_gateway() -> str:
    """The IPv4 gateway of the kind network (the host's address there): the first IPv4 entry of
    its IPAM config, wherever kind lists it."""
    configs = json.loads(docker("network", "inspect", plan.NETWORK).stdout)[0]["IPAM"]["Config"]
    for config in configs:
        if ":" not in config.get("Subnet", ":") and config.get("Gateway"):
            return str(config["Gateway"])
    raise RuntimeError(f"docker network {plan.NETWORK} has no IPv4 gateway: {configs}")


def add_routes(node_ips: Sequence[str]) -> None:
    for route in plan.host_routes(node_ips):
        _run("ip", "route", "replace", *route)


def remove_routes() -> None:
    """Every route into the pod and Service ranges (ours: nothing else uses them)."""
    for cidr in plan.UNREACHABLE:
        for route in _routes(cidr):
            kind = route.get("type", "unicast")
            _run("ip", "route", "del", *([kind] if kind != "unicast" else []), route["dst"], check=False)


def _routes(cidr: str) -> list[dict[str, str]]:
    """Routes of the main table inside ``cidr``, of every type."""
    proc = _run("ip", "-j", "route", "show", "root", cidr)
    routes: list[dict[str, str]] = json.loads(proc.stdout or "[]")
    return routes


def add_guard() -> None:
    _run("nft", "delete", "table", "inet", plan.GUARD_TABLE, check=False)
    _run("nft", "-f", "-", stdin=plan.guard_ruleset())


def remove_guard() -> None:
    _run("nft", "delete", "table", "inet", plan.GUARD_TABLE, check=False)


# --- host state -------------------------------------------------------------------------------


@dataclass
class HostState:
    """What teardown restores: sysctls (the kubelets in the nodes write host-wide ones) and host
    paths that did not exist."""

    sysctls: dict[str, str] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls) -> HostState:
        values = {}
        for name in dict.fromkeys((*SYSCTLS, *EXTRA_SYSCTLS, *plan.KUBELET_TUNABLES)):
            value = _read_sysctl(name)
            if value is not None:
                values[name] = value
        return cls(values, [str(p) for p in HOST_PATHS if not p.exists()])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"sysctls": self.sysctls, "absent": self.absent}, indent=1))

    @classmethod
    def load(cls, path: Path) -> HostState | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls(dict(data["sysctls"]), list(data["absent"]))

    def restore(self) -> list[str]:
        """Remove the host paths the run created; return them, and every sysctl that differs
        from the start of the run, for the report.

        Sysctls are never written back: the nodes do not reach the host's (each binds a file over
        the kubelet's entries), so a difference is someone else's, such as a local node's
        kubelet started meanwhile, which restores its own.
        """
        changed = []
        for name, value in self.sysctls.items():
            now = _read_sysctl(name)
            if now is not None and now != value:
                changed.append(f"sysctl {name} is {now} (was {value} when the run started; not ours, left)")
        for raw in self.absent:
            path = Path(raw)
            if path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.rmdir()  # only when empty: never what someone else put there
                    changed.append(f"removed {path}")
            elif path.exists():
                path.unlink()
                changed.append(f"removed {path}")
        return changed


def _read_sysctl(name: str) -> str | None:
    try:
        return " ".join(Path("/proc/sys", *name.split(".")).read_text().split())
    except OSError:
        return None


def state_file() -> Path:
    return docker_root() / "host-state.json"


def leftovers() -> list[str]:
    """What of the run is still on the host: the leak check after teardown."""
    found = []
    if daemon_pid() is not None:
        found.append("dockerd running")
    found += [f"mount {m}" for m in own_mounts()]
    link = _run("ip", "-j", "link", "show", plan.NETWORK_BRIDGE, check=False)
    if link.returncode == 0:
        found.append(f"link {plan.NETWORK_BRIDGE}")
    for cidr in plan.UNREACHABLE:
        found += [f"route {r.get('type', 'unicast')} {r['dst']}" for r in _routes(cidr)]
    if _run("nft", "list", "table", "inet", plan.GUARD_TABLE, check=False).returncode == 0:
        found.append(f"nft table {plan.GUARD_TABLE}")
    return found


@contextlib.contextmanager
def running_daemon() -> Iterator[None]:
    """dockerd for the block; stopped after it if this started it."""
    started = start_daemon()
    try:
        yield
    finally:
        if started:
            stop_daemon()
