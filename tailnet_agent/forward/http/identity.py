"""Who is calling: the peer behind a tailnet address, as the netmap knows it.

Kept apart from the header policy (:mod:`.headers`) because it is the one piece that reads the
netmap; the headers only spell what it found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tailnet_agent.control.netmap import NetMap


@dataclass(frozen=True)
class Identity:
    """Who is calling, from the netmap: the peer node and its owner (a user, or its tags)."""

    node_name: str
    tags: tuple[str, ...] = ()
    login_name: str | None = None
    display_name: str | None = None


Whois = Callable[[str], Identity | None]
"""The identity of a client address; None when nobody in the netmap has it."""


def identify(netmap: NetMap | None, ip: str) -> Identity | None:
    """The peer whose tailnet address ``ip`` is; None when the netmap has no such peer."""
    peer = netmap.peer_by_address(ip) if netmap is not None else None
    if peer is None or netmap is None:
        return None
    name = peer.name.rstrip(".") or peer.hostname
    if peer.tags:
        return Identity(node_name=name, tags=peer.tags)
    profile = netmap.user_profiles.get(peer.user)
    return Identity(node_name=name, login_name=profile.login_name if profile else None,
                    display_name=profile.display_name if profile else None)
