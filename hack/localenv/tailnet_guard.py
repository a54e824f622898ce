"""No tailnet address is ever reached through the machine's own network.

A userspace tailscaled (every test's "laptop", every benchmark's peer) proxies a connection to an
address it has no peer for through the host's network: its dialer uses the tailnet only for the
addresses of its netmap. A test that asks for a Gateway's or an agent's tailnet address before
that node is in the laptop's netmap would send the packet out of the machine's default route (the
Gateway API conformance suite does, while it waits for a Gateway). An ``unreachable`` route over the
tailnet's ranges (Headscale's defaults, as the tests configure them) makes such a dial fail at
once, here.

The route is shared by every process of a run (``make test`` runs two pytest processes side by
side): each holder registers its pid under a lock, the first adds the route unless it is already
there, and the last one removes it if a holder added it. Adding a route needs root; without it
the guard says so once and holds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["TAILNET_RANGES", "TailnetGuard"]

TAILNET_RANGES = ("100.64.0.0/10", "fd7a:115c:a1e0::/48")
"""Headscale's address ranges (hack/localenv/headscale.py's ``prefixes``)."""
STATE = Path("/run/tailnet-test-guard.json")
"""The holders' pids and whether a holder added the routes (root's /run: gone at reboot)."""


def _ip(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)


def _family(cidr: str) -> str:
    return "-6" if ":" in cidr else "-4"


def route_present(cidr: str) -> bool:
    found = _ip(_family(cidr), "route", "show", "type", "unreachable", cidr).stdout
    return cidr.split("/")[0] in found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class _Shared:
    holders: list[int] = field(default_factory=list)
    """The pids of the processes that hold the guard (those still alive)."""
    added: list[str] = field(default_factory=list)
    """The routes a holder added (the last one removes them); a route that was there stays."""


@contextlib.contextmanager
def _shared() -> Iterator[_Shared]:
    """The shared state under an exclusive lock, written back afterwards."""
    with STATE.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            raw = json.loads(STATE.read_text()) if STATE.exists() else {}
        except (OSError, ValueError):
            raw = {}
        shared = _Shared([int(p) for p in raw.get("holders", []) if _alive(int(p))],
                         [str(c) for c in raw.get("added", [])])
        yield shared
        STATE.write_text(json.dumps(asdict(shared)))


class TailnetGuard:
    """One process's hold on the unreachable routes over :data:`TAILNET_RANGES`."""

    def __init__(self) -> None:
        self.held = False

    def start(self) -> TailnetGuard:
        if self.held:
            return self
        if os.geteuid() != 0:
            print("tailnet guard: not root, so no unreachable route over the tailnet's ranges: a tailnet address "
                  "not yet in a tailscaled's netmap would be dialled through this machine's network", file=sys.stderr)
            return self
        with _shared() as shared:
            if not shared.holders:
                shared.added = [cidr for cidr in TAILNET_RANGES if not route_present(cidr)]
                for cidr in shared.added:
                    _ip(_family(cidr), "route", "add", "unreachable", cidr)
            shared.holders.append(os.getpid())
        self.held = True
        return self

    def stop(self) -> None:
        if not self.held:
            return
        with _shared() as shared:
            if os.getpid() in shared.holders:
                shared.holders.remove(os.getpid())
            if not shared.holders:
                for cidr in shared.added:
                    _ip(_family(cidr), "route", "del", "unreachable", cidr)
                shared.added = []
        self.held = False
