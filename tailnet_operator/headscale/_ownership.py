"""What the operator made in Headscale, and which of it no CR refers to any more (orphans).

Headscale 0.26 to 0.29 give a pre-auth key no description and a node no label, so the marker is a
tag: every pre-auth key the operator creates carries its installation's marker beside the CR's own
tag, and a node registered with such a key carries the key's tags (0.28+ ``tags``; before, forced
tags). A key or node without the marker was not made by this installation and is never touched.
The marker needs no ``tagOwners`` entry: Headscale checks a tag-only key's tags only for their
form, and no grant names the marker.

One marker per installation, so that several clusters (or several Tailnets of one cluster) can
share one Headscale without sweeping each other's keys and nodes. The installation is the
Tailnet object: :func:`installation_tag` is ``tag:tailnet-operator-`` and the first 16 hex digits
of the Tailnet's uid. Decided over the operator's namespace (every default install is
``tailnet-system``, so two clusters would share it) and over a setting (whoever installs the
second cluster would have to know to change it): the uid is unique per cluster without any
configuration, every reconciler already holds it when it talks to that Headscale, and it survives
operator upgrades and restarts. Deleting and recreating the Tailnet gives a new marker; the
previous one's keys are then left alone and expire on their own (pre-auth keys live 24 hours).

Keys and nodes made before markers were per installation carry :data:`LEGACY_OWNER_TAG`, shared by
every installation. The sweep never touches them (nothing tells whose they are). After an upgrade
a CR's key is replaced at half its lifetime (12 hours) by one with the installation's marker; the
legacy keys, recorded or not, expire on their own within their 24-hour lifetime; an agent keeps
its node (and that node's legacy tag) until it registers again, and an ephemeral node of a pod
that is gone is removed by Headscale once it has been offline for
``ephemeral_node_inactivity_timeout``.

An owned key is an orphan when it has not expired, is older than ``grace`` (a key is created
before the Secret that records it is written) and no CR's Secret records it (as its current or
previous key). An owned node is an orphan when it registered with an ephemeral key, is older
than ``grace`` and carries none of the tags of the CRs that exist; a non-ephemeral node (a
TailnetGateway's router, kept under ``deletionPolicy: Retain``) is never an orphan here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ._errors import NotFound
from ._models import Node, PreAuthKey

LEGACY_OWNER_TAG = "tag:tailnet-operator"
"""The marker every installation shared before markers were per installation; never swept."""
OWNER_TAG = LEGACY_OWNER_TAG
"""The same as :data:`LEGACY_OWNER_TAG`."""
OWNER_TAG_PREFIX = "tag:tailnet-operator-"
"""An installation's marker is this prefix and 16 hex digits (:func:`installation_tag`)."""
_MARKER = re.compile(r"^tag:tailnet-operator-[0-9a-f]{16}$")
_UID_DIGITS = 16

DEFAULT_GRACE = dt.timedelta(minutes=10)
"""How old a key or node must be before it may be an orphan: longer than a create-then-store takes."""


class HeadscaleClientLike(Protocol):
    """The calls the sweep makes (a :class:`~._client.HeadscaleClient` has them all)."""

    async def list_preauth_keys(self) -> list[PreAuthKey]: ...
    async def list_nodes(self) -> list[Node]: ...
    async def expire_preauth_key(self, key_id: str | int) -> None: ...
    async def delete_node(self, node_id: str | int) -> None: ...


@dataclass(frozen=True)
class References:
    """What the CRs that exist refer to: pre-auth key ids (in their Secrets) and node tags."""

    key_ids: frozenset[str] = frozenset()
    tags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Orphans:
    """Owned keys to expire and owned ephemeral nodes to delete."""

    keys: tuple[PreAuthKey, ...] = ()
    nodes: tuple[Node, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.keys or self.nodes)


def installation_tag(tailnet_uid: str) -> str:
    """The marker of the installation a Tailnet is: ``tag:tailnet-operator-`` and the first 16 hex
    digits of its uid (a UUID). ValueError for anything that is not a uid."""
    digits = tailnet_uid.replace("-", "").lower()
    if len(digits) < _UID_DIGITS or not re.fullmatch(r"[0-9a-f]+", digits):
        raise ValueError(f"an installation marker is made from a Tailnet's uid (a UUID), got {tailnet_uid!r}")
    return OWNER_TAG_PREFIX + digits[:_UID_DIGITS]


def check_marker(owner_tag: str) -> str:
    """``owner_tag`` if it is an installation's marker (:func:`installation_tag`); ValueError otherwise.
    The shared :data:`LEGACY_OWNER_TAG` is refused: it would make every installation's keys this one's."""
    if not _MARKER.match(owner_tag):
        raise ValueError(f"{owner_tag!r} is not an installation's marker ({OWNER_TAG_PREFIX}<16 hex digits>)")
    return owner_tag


def owned_key(key: PreAuthKey, owner_tag: str) -> bool:
    """Whether ``key`` carries the installation's marker ``owner_tag``."""
    return owner_tag in key.acl_tags


def owned_node(node: Node, owner_tag: str) -> bool:
    """Whether ``node`` carries the installation's marker ``owner_tag``."""
    return owner_tag in node.tags


def _old_enough(created: dt.datetime | None, now: dt.datetime, grace: dt.timedelta) -> bool:
    # Without a creation time the age is unknown: not an orphan yet.
    return created is not None and now - created >= grace


def orphans_of(keys: Iterable[PreAuthKey], nodes: Iterable[Node], refs: References, *, now: dt.datetime,
               owner_tag: str, grace: dt.timedelta = DEFAULT_GRACE) -> Orphans:
    """The orphans among ``keys`` and ``nodes`` as listed by Headscale that carry the installation's
    marker ``owner_tag`` (pure; see the module doc). ValueError if ``owner_tag`` is no installation's."""
    check_marker(owner_tag)
    keys = list(keys)
    by_id = {k.id: k for k in keys}
    orphan_keys = tuple(
        k for k in keys
        if owned_key(k, owner_tag) and k.id not in refs.key_ids and _old_enough(k.created_at, now, grace)
        and (k.expiration is None or k.expiration > now))
    orphan_nodes = []
    for node in nodes:
        key = by_id.get(node.pre_auth_key_id or "")
        if not owned_node(node, owner_tag) or key is None or not key.ephemeral:
            continue
        if set(node.tags) & refs.tags or not _old_enough(node.created_at, now, grace):
            continue
        orphan_nodes.append(node)
    return Orphans(keys=orphan_keys, nodes=tuple(orphan_nodes))


async def find_orphans(hs: HeadscaleClientLike, refs: References, *, owner_tag: str, now: dt.datetime | None = None,
                       grace: dt.timedelta = DEFAULT_GRACE) -> Orphans:
    """The installation's keys and nodes on ``hs`` (marked ``owner_tag``) that none of its CRs refers
    to (reads only)."""
    check_marker(owner_tag)
    keys = await hs.list_preauth_keys()
    nodes = await hs.list_nodes()
    return orphans_of(keys, nodes, refs, now=now or dt.datetime.now(dt.UTC), grace=grace, owner_tag=owner_tag)


async def sweep_orphans(hs: HeadscaleClientLike, orphans: Orphans) -> Orphans:
    """Expire the orphan keys and delete the orphan nodes; returns what was swept (one already
    gone counts as swept). A failure raises after what came before it was done."""
    for key in orphans.keys:
        await hs.expire_preauth_key(key.id)
    for node in orphans.nodes:
        with contextlib.suppress(NotFound):
            await hs.delete_node(node.id)
    return orphans
