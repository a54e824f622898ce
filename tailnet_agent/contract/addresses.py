"""Which addresses an ingress's replicas may share (``TAILNET_SHARED_ADDRESS``, ``spec.sharedAddress``).

A shared address is advertised by every replica as a host route and answered as its own; control
sends it to one replica at a time. It must be an address a peer can route to and that control never
gives a node: not in the tailnet's own ranges, not loopback, link-local, multicast, unspecified or
reserved. The agent checks it at startup, the operator's API before anything is created.
"""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = ["TAILNET_RANGES", "host_route", "shared_address_problem"]

TAILNET_RANGES: Final = (ipaddress.ip_network("100.64.0.0/10"), ipaddress.ip_network("fd7a:115c:a1e0::/48"))
"""The ranges control gives node addresses from (Tailscale's CGNAT and ULA ranges)."""


def host_route(address: str) -> str:
    """``address`` as a /32 (or /128) route, as advertised and approved; "" when it is not an IP
    address (a DNS name)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ""
    return f"{ip}/{ip.max_prefixlen}"


def shared_address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``address`` cannot be shared (a phrase to follow the address), or None when it can."""
    if any(address in network for network in TAILNET_RANGES):
        return ("is in the tailnet's own range; choose an address outside 100.64.0.0/10 and "
                "fd7a:115c:a1e0::/48")
    if (address.is_loopback or address.is_multicast or address.is_unspecified or address.is_link_local
            or address.is_reserved):
        return "is not a unicast address a peer can route to"
    return None
