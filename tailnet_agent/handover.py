"""An agent that is told to stop keeps its listeners while clients may still be sent to it.

Peers reach an ingress by its MagicDNS name. When its pod is replaced, the operator moves the name
to the successor's node once that pod is ready (``tailnet_operator/controllers/ingress_status.py``
``succession``), and peers learn the rename from their next netmap. Until then a peer resolves the
name to this node, so closing the listeners at SIGTERM would refuse it: a pod deleted, evicted or
drained while its successor is still starting would drop requests. So the drain starts only once
control has renamed this node (or never named it ``hostname``), or after :data:`HOLD_SHARE` of the
drain deadline, which leaves the rest to the connections open by then.

An ingress whose replicas share an address (``TAILNET_SHARED_ADDRESS``) hands that over instead: it
withdraws its route to it, and control moves the route to another replica (Headscale elects a new
primary among the online advertisers and sends every peer the change). The replica keeps accepting
for :data:`MIN_HOLD` seconds, then until no new connection has come to the shared address for
:data:`QUIET` seconds (at most :data:`MAX_HOLD` in all): a replica that was not the primary gets
none and stops after the minimum, the primary stops once its peers have moved.

An egress does the same with its listeners (:func:`still_sought`): its pod's endpoint leaves the
Services when the pod starts terminating, but a node's kube-proxy that has no ready endpoint of a
Service goes on sending to a terminating one that still serves (a single replica deleted, evicted
or drained while its successor starts), and one that is late goes on sending to it anyway. A
connection accepted then is served; closing the listeners at SIGTERM would refuse it.
"""

from __future__ import annotations

from collections.abc import Callable

from tailnet_agent.contract.clock import Clock
from tailnet_agent.control.netmap import NetMap

HOLD_SHARE = 2 / 3
"""The part of ``TAILNET_DRAIN_TIMEOUT`` an ingress may keep accepting for (20 s of the operator's 30)."""
CHECK_INTERVAL = 0.5
"""Seconds between two looks at the node's own name (or primary routes)."""
MIN_HOLD = 3.0
"""Seconds an agent keeps accepting after it began to stop, at the least: Headscale moves a shared
route within about 2 s (a NodeStore batch of 500 ms, a map batch of 800 ms)."""
QUIET = 2.0
"""Then until no new connection has come for this long: peers still sending to a shared address
have not had the move yet (their netmaps come at different times, and control does not tell a
stopping replica whether it was the primary: under a policy that hides the replicas from each
other its netmap shows neither its own primary routes nor another's); an egress's clients are
still sent here by some node's kube-proxy."""
MAX_HOLD = 15.0
"""Seconds at most an agent keeps accepting that way: as long as a terminating pod that fails its
readiness stays a serving endpoint (three failed probes 5 s apart)."""


def holds_name(netmap: NetMap | None, hostname: str) -> bool:
    """Whether control names this node ``hostname`` (the first label of its MagicDNS name)."""
    if netmap is None or not hostname:
        return False
    return netmap.self_node.name.split(".", 1)[0].lower() == hostname.lower()


def still_sought(since: float, now: float, quiet_for: float) -> bool:
    """Whether an agent that began to stop (or withdrew its shared address) at ``since`` keeps
    accepting at ``now``, with no new connection for ``quiet_for`` seconds."""
    return now - since < MIN_HOLD or quiet_for < QUIET


async def serve_until_handed_over(named: Callable[[], bool], clock: Clock, budget: float) -> float:
    """Wait while ``named()`` and at most ``budget`` seconds; the seconds waited."""
    started = clock.now()
    while named() and clock.now() - started < budget:
        await clock.sleep(min(CHECK_INTERVAL, budget - (clock.now() - started)))
    return clock.now() - started


async def serve_while_sought(quiet_for: Callable[[], float], clock: Clock, budget: float) -> float:
    """Wait from now while :func:`still_sought` (``quiet_for``: seconds since the last new
    connection), at most :data:`MAX_HOLD` and ``budget`` seconds; the seconds waited."""
    since = clock.now()
    return await serve_until_handed_over(lambda: still_sought(since, clock.now(), quiet_for()), clock,
                                         min(MAX_HOLD, budget))
