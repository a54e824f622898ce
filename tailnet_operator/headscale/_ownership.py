"""What the operator made in Headscale, and which of it no CR refers to any more (orphans).

Headscale 0.26 to 0.29 give a pre-auth key no description and a node no label, so the marker is a
tag: every pre-auth key the operator creates carries :data:`OWNER_TAG` beside the CR's own tag,
and a node registered with such a key carries the key's tags (0.28+ ``tags``; before, forced
tags). A key or node without the marker was not made by the operator and is never touched.
The marker needs no ``tagOwners`` entry: Headscale checks a tag-only key's tags only for their
form, and no grant names the marker.

An owned key is an orphan when it has not expired, is older than ``grace`` (a key is created
before the Secret that records it is written) and no CR's Secret records it (as its current or
previous key). An owned node is an orphan when it registered with an ephemeral key, is older
than ``grace`` and carries none of the tags of the CRs that exist; a non-ephemeral node (a
TailnetGateway's router, kept under ``deletionPolicy: Retain``) is never an orphan here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ._errors import NotFound
from ._models import Node, PreAuthKey

OWNER_TAG = "tag:tailnet-operator"
"""The tag on every pre-auth key (and so every node) the operator creates."""

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


def owned_key(key: PreAuthKey, owner_tag: str = OWNER_TAG) -> bool:
    return owner_tag in key.acl_tags


def owned_node(node: Node, owner_tag: str = OWNER_TAG) -> bool:
    return owner_tag in node.tags


def _old_enough(created: dt.datetime | None, now: dt.datetime, grace: dt.timedelta) -> bool:
    # Without a creation time the age is unknown: not an orphan yet.
    return created is not None and now - created >= grace


def orphans_of(keys: Iterable[PreAuthKey], nodes: Iterable[Node], refs: References, *, now: dt.datetime,
               grace: dt.timedelta = DEFAULT_GRACE, owner_tag: str = OWNER_TAG) -> Orphans:
    """The orphans among ``keys`` and ``nodes`` as listed by Headscale (pure; see the module doc)."""
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


async def find_orphans(hs: HeadscaleClientLike, refs: References, *, now: dt.datetime | None = None,
                       grace: dt.timedelta = DEFAULT_GRACE, owner_tag: str = OWNER_TAG) -> Orphans:
    """The operator's keys and nodes on ``hs`` that no CR refers to (reads only)."""
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
