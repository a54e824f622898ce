"""Real tailscaled nodes in userspace networking, joined to a test Headscale.

Each node has its own state directory and socket. Outbound traffic from a node goes through
its HTTP proxy and SOCKS5 listeners on 127.0.0.1 (userspace networking has no TUN device);
inbound TCP to a node's tailnet address is forwarded by tailscaled to the same port on
127.0.0.1.

``TS_DEBUG_OMIT_LOCAL_ADDRS`` keeps nodes from advertising this machine's own interface
addresses as endpoints, so peer-to-peer traffic stays on loopback or goes through DERP.

A name a node's netmap does not carry (a MagicDNS name not given yet, or between the two renames of
a hand-over) is looked up with the machine's resolver, outside the machine. As root, each node runs
in a mount namespace of its own whose ``/etc/resolv.conf`` names no server (Go then asks loopback,
where none listens), so such a lookup fails here (:func:`_own_resolver`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hack import binaries

from ._process import ManagedProcess, free_port, socket_dir, wait_until
from .headscale import Headscale

START_TIMEOUT = 60.0


def _binary_for(user: int | None, shared_dir: Path) -> Path:
    """tailscaled's path; for another user, a copy outside the (private) build cache."""
    cached = binaries.binary("tailscaled")
    if user is None:
        return cached
    copy = shared_dir / "bin" / cached.parent.name / "tailscaled"
    if not copy.exists():
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cached, copy)
        copy.chmod(0o755)
    return copy


def _own_resolver(argv: Sequence[str | os.PathLike[str]], resolv_conf: Path,
                  user: int | None) -> list[str | os.PathLike[str]] | None:
    """``argv`` run in a mount namespace of its own with ``resolv_conf`` (naming no server) over
    ``/etc/resolv.conf``, as ``user`` when given; None without root or util-linux's tools."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return None
    resolv_conf.parent.mkdir(parents=True, exist_ok=True)
    resolv_conf.write_text("# no server: a name the netmap lacks is not looked up outside this machine\n")
    drop = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /etc/resolv.conf && exec "$@"', resolv_conf, *drop, *argv]


class TailscaleNode:
    """One tailscaled plus the ``tailscale`` CLI bound to its socket."""

    def __init__(self, hostname: str, workdir: Path, *, headscale: Headscale, log_dir: Path,
                 run_id: str, user: int | None = None, env: dict[str, str] | None = None,
                 netns: str | None = None) -> None:
        """``netns``: run on a TUN device in that network namespace (kernel mode: the namespace
        routes tailnet addresses, with no proxy), instead of in userspace on the host."""
        self.hostname = hostname
        self.headscale = headscale
        self.workdir = workdir
        self.user = user
        self.netns = netns
        self._socket_dir = socket_dir("tnts-", owner=user)
        self.socket = self._socket_dir / "tailscaled.sock"
        self.http_proxy_port = free_port()
        self.socks5_port = free_port()
        env = {
            "SSL_CERT_FILE": str(headscale.ca_bundle),
            "TS_DEBUG_OMIT_LOCAL_ADDRS": "true",
            "TS_NO_LOGS_NO_SUPPORT": "true",
            **(env or {}),
        }
        common = [f"--statedir={workdir / 'state'}", f"--socket={self.socket}", "--port=0", "--no-logs-no-support"]
        if netns is not None:
            # `ip netns exec` puts /etc/netns/<name>/resolv.conf in place (SiteHost writes one).
            self.process = ManagedProcess(f"tailscaled-{hostname}", [
                "ip", "netns", "exec", netns, binaries.binary("tailscaled"), "--tun=tailscale0", *common,
            ], log_dir=log_dir, run_id=run_id, env=env)
            return
        argv: list[str | os.PathLike[str]] = [
            _binary_for(user, workdir.parent), "--tun=userspace-networking", *common,
            f"--outbound-http-proxy-listen=127.0.0.1:{self.http_proxy_port}",
            f"--socks5-server=127.0.0.1:{self.socks5_port}",
        ]
        wrapped = _own_resolver(argv, workdir / "resolv.conf", user)
        self.process = ManagedProcess(f"tailscaled-{hostname}", wrapped or argv, log_dir=log_dir, run_id=run_id,
                                      env=env, user=None if wrapped else user)

    @property
    def http_proxy(self) -> str:
        """URL of the node's outbound HTTP proxy: requests through it travel over the tailnet."""
        return f"http://127.0.0.1:{self.http_proxy_port}"

    def start(self) -> TailscaleNode:
        for directory in (self.workdir, self._socket_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.user is not None:
                os.chown(directory, self.user, self.user)
        self.process.start()
        wait_until(lambda: self._socket_ready(), timeout=START_TIMEOUT, what=f"{self.hostname} socket")
        return self

    def up(self, authkey: str, *, advertise_routes: Sequence[str] = (), accept_routes: bool = False,
           timeout: float = START_TIMEOUT) -> None:
        """Join the tailnet with a pre-auth key; returns once the node is Running."""
        args = ["up", f"--login-server={self.headscale.url}", f"--authkey={authkey}",
                f"--hostname={self.hostname}", "--accept-dns=false", f"--timeout={int(timeout)}s"]
        if advertise_routes:
            args.append(f"--advertise-routes={','.join(advertise_routes)}")
        if accept_routes:
            args.append("--accept-routes")
        if self.netns is not None:
            args.append("--netfilter-mode=off")  # its namespace is its own: no firewall to set up
        self.cli(*args, timeout=timeout + 5)
        wait_until(lambda: self.status().get("BackendState") == "Running", timeout=timeout,
                   what=f"{self.hostname} Running")

    def set(self, *args: str) -> None:
        """``tailscale set ...``: change preferences such as advertised routes."""
        self.cli("set", *args)

    def cli(self, *args: str, timeout: float = 30.0) -> str:
        proc = subprocess.run([str(binaries.binary("tailscale")), f"--socket={self.socket}", *args],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"tailscale {args[0]} on {self.hostname} failed: {proc.stderr.strip()}"
                               f"\nlog: {self.process.log_path}")
        return proc.stdout

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self.cli("status", "--json"))
        return status

    def ipv4(self) -> str:
        return str(next(ip for ip in self.status()["Self"]["TailscaleIPs"] if "." in ip))

    def ipv6(self) -> str:
        return str(next(ip for ip in self.status()["Self"]["TailscaleIPs"] if ":" in ip))

    def peers(self) -> list[dict[str, Any]]:
        return list((self.status().get("Peer") or {}).values())

    def sees(self, hostname: str) -> bool:
        return any(p.get("HostName") == hostname for p in self.peers())

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _socket_ready(self) -> bool:
        self.process.check_running()
        return self.socket.exists()
