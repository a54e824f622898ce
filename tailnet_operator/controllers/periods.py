"""How soon each reconciler looks again: every period of the controllers, in one place.

A reconcile that returns ``Result(requeue_after=...)`` is looked at again after that many seconds
even when no watched object changes. The periods differ by what changes without an event: an agent's
own view (its ``/status``), a router's advertisements, Headscale coming back.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "AGENT_RESYNC",
    "CLEANUP_ATTEMPT_TIMEOUT",
    "CLEANUP_GIVE_UP",
    "CLEANUP_RETRY",
    "DNS_REFUSED_RETRY",
    "GATEWAY_REGISTER_WAIT",
    "GATEWAY_SETTLING",
    "HEADSCALE_RETRY",
    "POLICY_RESYNC",
    "REFERENCE_RETRY",
    "SWEEP_EVERY",
    "SWEEP_RETRY",
    "TAILNET_RESYNC",
]

HEADSCALE_RETRY = 10.0
"""A reconcile that could not reach Headscale (or has no working key yet) tries again this soon."""

AGENT_RESYNC = 30.0
"""Egress, ingress and gateway status comes from the agent and Headscale, which change on their
own; it is refreshed this often (sooner when a pre-auth key's rotation is due)."""

GATEWAY_REGISTER_WAIT = 2.0
"""A gateway whose router has not registered yet looks again this soon."""

GATEWAY_SETTLING = 5.0
"""A gateway whose routes are not all advertised and approved looks again this soon: approval comes
from the Policy reconciler or a person, neither of which the gateway watches."""

REFERENCE_RETRY = 10.0
"""An object refused only because an object it names (a Gateway listener's certificate Secret) is
missing looks again this soon: a Secret outside the namespaces the cache watches is fetched when
read, never watched, so its creation brings no event until something reads it again."""

POLICY_RESYNC = 30.0
"""Routers advertise on their own schedule; site status and approvals are refreshed this often."""

TAILNET_RESYNC = 300.0
"""A Tailnet's reachability is checked at least this often, with no change and no rotation due."""

DNS_REFUSED_RETRY = 300.0
"""A Tailnet whose hosts ConfigMap was refused looks again this soon (a spec change looks at once)."""

SWEEP_EVERY = 600.0
"""How often each Tailnet's Headscale is swept for orphans."""

SWEEP_RETRY = 60.0
"""How soon a sweep that could not reach Headscale is tried again."""

CLEANUP_RETRY = 10.0
"""How soon a finalizer whose Headscale cleanup failed tries again."""

CLEANUP_GIVE_UP = timedelta(minutes=5)
"""How long a finalizer retries Headscale before it lets the object go with a Warning Event."""

CLEANUP_ATTEMPT_TIMEOUT = 60.0
"""Seconds one cleanup attempt may take, all its requests and their retries included."""
