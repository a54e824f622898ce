"""What a benchmark row claims about its path, checked on both ends of the path.

A row named "direct" is worth nothing if one side was relaying through DERP, and a "DERP" row
flatters whoever happened to find a direct path. Each check reads the state of both nodes: the
measuring side (a tailscaled's peer entry, or the agent's data-plane metrics) and the peer at the
other end (its tailscaled's entry for the measuring node). A claim that does not hold raises
:class:`PathNotAsClaimed`, so a run never writes a row whose path it did not verify.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.paths import Dial, upload
from hack.localenv import TailscaleNode

__all__ = ["AgentUdp", "PathNotAsClaimed", "Peers", "agent_check", "agent_udp", "fetch", "peer_path", "require",
           "tailscaled_check", "udp_counters", "until_direct", "until_direct_tailscaled"]

DIRECT = "direct"
DERP = "DERP"


class PathNotAsClaimed(RuntimeError):
    """A row's path is not the one its name claims."""


def fetch(url: str) -> str:
    """The body of a 2xx answer (urllib raises on any other)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


@dataclass(frozen=True)
class AgentUdp:
    """The agent's WireGuard datagrams over its own UDP socket (not DERP) so far."""

    packets_out: float
    packets_in: float


def udp_counters(metrics: str) -> AgentUdp:
    """The UDP counters in the agent's ``/metrics`` text."""
    counts = {name: float(value) for name, value in
              (line.split() for line in metrics.splitlines()
               if line.startswith("tailnet_agent_dataplane_udp_packets_"))}
    return AgentUdp(counts.get("tailnet_agent_dataplane_udp_packets_out_total", 0.0),
                    counts.get("tailnet_agent_dataplane_udp_packets_in_total", 0.0))


def agent_udp(metrics_url: str) -> AgentUdp:
    return udp_counters(fetch(metrics_url))


class Peers(Protocol):
    """A tailscaled whose status can be read: a host process, or one in a pod."""

    @property
    def hostname(self) -> str: ...

    def peers(self) -> list[dict[str, Any]]: ...


def _peer(node: Peers, hostname: str) -> dict[str, Any] | None:
    return next((p for p in node.peers() if p.get("HostName") == hostname), None)


def peer_path(node: Peers, hostname: str) -> str:
    """How ``node``'s tailscaled reaches the peer ``hostname``: ``direct <addr>``, ``DERP <region>``,
    or ``none`` (no peer entry, or neither)."""
    peer = _peer(node, hostname)
    if peer is None:
        return "none"
    if peer.get("CurAddr"):
        return f"{DIRECT} {peer['CurAddr']}"
    if peer.get("Relay"):
        return f"{DERP} {peer['Relay']}"
    return "none"


def require(claim: str, observed: str, where: str) -> str:
    """``observed`` (a :func:`peer_path`) when it is ``claim`` (:data:`DIRECT` or :data:`DERP`)."""
    if not observed.startswith(claim):
        raise PathNotAsClaimed(f"{where}: the row claims {claim}, the node reports {observed}")
    return observed


def tailscaled_check(client: TailscaleNode, server: TailscaleNode, claim: str) -> Callable[[], str]:
    """Both tailscaleds report ``claim`` for each other."""

    def check() -> str:
        mine = require(claim, peer_path(client, server.hostname), client.hostname)
        theirs = require(claim, peer_path(server, client.hostname), server.hostname)
        return f"{client.hostname}: {mine}; {server.hostname}: {theirs}"

    return check


def agent_check(metrics: str, hostname: str, server: TailscaleNode, claim: str) -> Callable[[], str]:
    """The agent's UDP counters (none over DERP only; both ways when direct) and the peer's entry."""

    def check() -> str:
        udp = agent_udp(metrics)
        if (claim == DIRECT) != bool(udp.packets_out and udp.packets_in):
            raise PathNotAsClaimed(f"{hostname}: the row claims {claim}, its UDP counters are "
                                             f"{udp.packets_out:.0f} out, {udp.packets_in:.0f} in")
        theirs = require(claim, peer_path(server, hostname), server.hostname)
        return f"{hostname}: UDP {udp.packets_out:.0f} out, {udp.packets_in:.0f} in; {server.hostname}: {theirs}"

    return check


async def until_direct(dial: Dial, metrics_url: str, timeout: float = 30.0) -> None:
    """Send a little until the agent's metrics show WireGuard going both ways over UDP."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await upload(dial, 64 * 1024)
        udp = await asyncio.to_thread(agent_udp, metrics_url)
        if udp.packets_out and udp.packets_in:
            return
        await asyncio.sleep(0.5)
    raise PathNotAsClaimed(f"no direct path from the agent within {timeout:.0f} s (see its log)")


async def until_direct_tailscaled(node: TailscaleNode, hostname: str, dial: Dial, timeout: float = 30.0) -> None:
    """Send a little until ``node`` reports a direct address (not DERP) for the peer ``hostname``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await upload(dial, 64 * 1024)
        if (await asyncio.to_thread(peer_path, node, hostname)).startswith(DIRECT):
            return
        await asyncio.sleep(0.5)
    raise PathNotAsClaimed(f"no direct path from {node.hostname} to {hostname} within {timeout:.0f} s")
