"""An ingress agent that is told to stop keeps its listeners while its node still holds the name.

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
for :data:`SHARED_MIN_HOLD` seconds, then until no new connection has come to the shared address
for :data:`SHARED_QUIET` seconds (at most :data:`SHARED_HOLD` in all): a replica that was not the
primary gets none and stops after the minimum, the primary stops once its peers have moved.
"""

from __future__ import annotations

from collections.abc import Callable

from tailnet_agent.contract.clock import Clock
from tailnet_agent.control.netmap import NetMap

HOLD_SHARE = 2 / 3
"""The part of ``TAILNET_DRAIN_TIMEOUT`` an ingress may keep accepting for (20 s of the operator's 30)."""
CHECK_INTERVAL = 0.5
"""Seconds between two looks at the node's own name (or primary routes)."""
SHARED_MIN_HOLD = 3.0
"""Seconds a replica keeps accepting after its withdrawal is taken, at the least: Headscale moves the
route within about 2 s (a NodeStore batch of 500 ms, a map batch of 800 ms)."""
SHARED_QUIET = 2.0
"""Then until no new connection has reached the shared address for this long: peers still sending
there have not had the move yet (their netmaps come at different times, and control does not
tell a stopping replica whether it was the primary: under a policy that hides the replicas from
each other its netmap shows neither its own primary routes nor another's)."""
SHARED_HOLD = 15.0
"""Seconds at most a replica keeps accepting on the shared address after its withdrawal."""


def holds_name(netmap: NetMap | None, hostname: str) -> bool:
    """Whether control names this node ``hostname`` (the first label of its MagicDNS name)."""
    if netmap is None or not hostname:
        return False
    return netmap.self_node.name.split(".", 1)[0].lower() == hostname.lower()


def holding_shared(withdrawn_at: float, now: float, quiet_for: float) -> bool:
    """Whether a replica that withdrew its shared address at ``withdrawn_at`` keeps accepting at
    ``now``, with no new connection to the address for ``quiet_for`` seconds."""
    return now - withdrawn_at < SHARED_MIN_HOLD or quiet_for < SHARED_QUIET


async def serve_until_handed_over(named: Callable[[], bool], clock: Clock, budget: float) -> float:
    """Wait while ``named()`` and at most ``budget`` seconds; the seconds waited."""
    started = clock.now()
    while named() and clock.now() - started < budget:
        await clock.sleep(min(CHECK_INTERVAL, budget - (clock.now() - started)))
    return clock.now() - started
