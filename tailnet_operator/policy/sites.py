"""Which TailnetSites may route: overlaps with reserved networks or older sites block a site.

Pure, like the rest of ``policy/``: sites and reserved networks in, a verdict per site out
(the sites' ``SiteInput`` for derivation is built from the sites this leaves unblocked). The older site (earlier
``creationTimestamp``, then name) keeps working; a site blocked by a reserved network does not
block younger ones, since it routes nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class SiteRoutes:
    name: str
    created: str
    """RFC 3339 creation time; orders sites by age."""
    routes: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    blocked: bool
    blocked_by: str = ""
    """The reserved network or older site, named for a person to act on."""
    message: str = ""


def _overlap(a: Iterable[str], b: Iterable[str]) -> tuple[str, str] | None:
    for left in a:
        net_a = ipaddress.ip_network(left, strict=False)
        for right in b:
            net_b = ipaddress.ip_network(right, strict=False)
            if net_a.version == net_b.version and net_a.overlaps(net_b):
                return left, right
    return None


def judge(sites: Sequence[SiteRoutes], reserved: Sequence[str]) -> dict[str, Verdict]:
    """A verdict for every site, oldest first."""
    verdicts: dict[str, Verdict] = {}
    active: list[SiteRoutes] = []
    for site in sorted(sites, key=lambda s: (s.created, s.name)):
        hit = _overlap(site.routes, reserved)
        if hit is not None:
            verdicts[site.name] = Verdict(
                True, f"reservedNetworks {hit[1]}",
                f"route {hit[0]} overlaps the reserved network {hit[1]} of the Tailnet; change the route "
                "or the Tailnet's reservedNetworks")
            continue
        older = next(((o, h) for o in active if (h := _overlap(site.routes, o.routes)) is not None), None)
        if older is not None:
            other, (mine, theirs) = older
            verdicts[site.name] = Verdict(
                True, f"TailnetSite {other.name}",
                f"route {mine} overlaps route {theirs} of the older TailnetSite {other.name}, which keeps "
                "it; change one of them or delete the older site")
            continue
        verdicts[site.name] = Verdict(False)
        active.append(site)
    return verdicts
