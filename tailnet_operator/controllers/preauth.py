"""A CR's pre-auth key: tag-only, in a Secret of the operator's, never shown in status.

An agent's key is reusable, so a restarted pod registers again on its own, and ephemeral, so a
node whose pod is gone ages out of the tailnet. A gateway's is single-use and not ephemeral
(:class:`Wanted`): one node, which stays. Tag-only so the node is the tag and nobody's device; the key also carries
its installation's marker (``hs.owner_tag``), which the orphan sweep (:mod:`.sweep`) recognises. The key is
rotated at half its lifetime and when the Tailnet's login URL or the tag changes, in the order
of every key the operator keeps (:mod:`.keyrecord`: create, store, expire the previous one),
which survives a crash at any step. A crash after the create leaves an unused marked key that the
orphan sweep expires; after the store, the next reconcile finds ``previous`` and expires it. The
old key is never expired before the new Secret is in place, so a pod restarting in between
always finds a valid key. The key itself never leaves the Secret:
status carries only its id, masked prefix and times.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, ClassVar

import structlog

from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, NotFound, mask_key
from tailnet_operator.runtime import SECRET, Clock, Writer
from tailnet_operator.types import JSON

from .conditions import rfc3339
from .keyrecord import KEY_TAG, NODE_IDS, KeyRecord, finish, store_new
from .unconfirmed import Unconfirmed

__all__ = ["AUTH_KEY_FIELD", "LIFETIME", "AuthKey", "AuthKeyKeeper", "Wanted", "expire_owned"]

log = structlog.get_logger("controllers.preauth")

AUTH_KEY_FIELD = "authKey"
"""The Secret's data key, mounted into the agent as a file."""

LIFETIME = timedelta(hours=24)
"""Lifetime of a pre-auth key; it is replaced after half of it."""

_LOGIN_URL = "tailnet.dev/login-url"
_PREVIOUS_TAG = "tailnet.dev/previous-tag"


@dataclass(frozen=True, kw_only=True)
class AuthKey(KeyRecord):
    """A pre-auth key as its Secret records it (:mod:`.keyrecord`), with what it was made for."""

    DATA_FIELD: ClassVar[str] = AUTH_KEY_FIELD

    login_url: str
    tag: str
    previous_tag: str = ""
    """The tag the previous key was made for (the tag may have changed with the rotation)."""
    node_ids: frozenset[str] = frozenset()
    """The nodes registered with this CR's keys (:data:`.keyrecord.NODE_IDS`). Read here, written
    by the status phase under its own field manager, never by the key's writes."""

    @classmethod
    def extra_fields(cls, notes: dict[str, str]) -> dict[str, Any]:
        return {"login_url": notes[_LOGIN_URL], "tag": notes[KEY_TAG], "previous_tag": notes.get(_PREVIOUS_TAG, ""),
                "node_ids": frozenset(filter(None, notes.get(NODE_IDS, "").split(",")))}

    def extra_annotations(self) -> dict[str, str]:
        notes = {_LOGIN_URL: self.login_url, KEY_TAG: self.tag}
        if self.previous_id:
            notes[_PREVIOUS_TAG] = self.previous_tag or self.tag
        return notes

    def without_previous(self) -> AuthKey:
        return replace(self, previous_id="", previous_tag="")

    def status(self) -> JSON:
        """``status.preAuthKey``: never the key itself."""
        return {"id": self.id, "prefix": self.prefix, "expiresAt": rfc3339(self.expires_at),
                "nextRotationAt": rfc3339(self.rotation_due)}


@dataclass(frozen=True)
class Wanted:
    """What the current key must have been made for."""

    login_url: str
    tag: str
    reusable: bool = True
    """Agents: reusable, so a restarted pod registers again. The gateway: single use, one node."""
    ephemeral: bool = True
    """Agents: ephemeral, so a gone pod's node ages out. The gateway: a node that stays."""


class AuthKeyKeeper:
    """Creates, stores, rotates and expires one CR's pre-auth key (Secret metadata from ``metadata``)."""

    def __init__(self, writer: Writer, clock: Clock, *, field_manager: str) -> None:
        self.writer = writer
        self.clock = clock
        self.field_manager = field_manager
        self.unconfirmed: Unconfirmed[AuthKey] = Unconfirmed()
        """Keys created whose Secret write may have landed, stored again before any other is made."""

    def why_rotate(self, stored: AuthKey | None, wanted: Wanted) -> str:
        """Why a new key is needed now ("" when the stored one is fine)."""
        if stored is None:
            return "no key yet"
        if stored.login_url != wanted.login_url:
            return f"the Tailnet's login URL changed to {wanted.login_url}"
        if stored.tag != wanted.tag:
            return f"the tag changed from {stored.tag} to {wanted.tag}"
        if self.clock.utcnow() >= stored.rotation_due:
            return "half its lifetime has passed"
        return ""

    async def ensure(self, hs: HeadscaleClient, metadata: JSON, stored: AuthKey | None,
                     wanted: Wanted) -> tuple[AuthKey, str]:
        """The key to use, rotated when due (and the reason, "" when nothing was rotated).

        A key minted by an earlier attempt whose Secret write may have landed is stored again
        first (:mod:`.unconfirmed`): a retry never mints a second key."""
        slot = f"{metadata.get('namespace', '')}/{metadata['name']}"
        reason = ""
        held = self.unconfirmed.held(slot)
        if (pending := self.unconfirmed.pending(slot, stored_id=stored.id if stored else None)) is not None:
            if await _usable(hs, pending.id, self.clock.utcnow()):
                await self._store_new(hs, slot, metadata, pending)
                stored = pending
            else:  # expired meanwhile (the orphan sweep, after its grace): nothing can use it
                self.unconfirmed.forget(slot)
        if held is not None and stored is not None and held.id == stored.id:
            reason = "created before; its Secret write had an uncertain outcome"
        if stored is not None:
            stored = await self._expire_previous(hs, metadata, stored)
        if not (why := self.why_rotate(stored, wanted)):
            assert stored is not None
            return stored, reason
        new = await self._create(hs, wanted, previous=stored)
        await self._store_new(hs, slot, metadata, new)
        return await self._expire_previous(hs, metadata, new), why

    async def _store_new(self, hs: HeadscaleClient, slot: str, metadata: JSON, new: AuthKey) -> None:
        async def abandon(key: AuthKey) -> None:  # nothing refers to it: expire it, or every retry leaks one
            with contextlib.suppress(HeadscaleError):
                await hs.expire_preauth_key(key.id)

        await store_new(self.unconfirmed, slot, new, lambda key: self.store(metadata, key), abandon)

    async def _create(self, hs: HeadscaleClient, wanted: Wanted, *, previous: AuthKey | None) -> AuthKey:
        now = self.clock.utcnow()
        # the installation's marker makes the key, and the node made with it, this installation's (the orphan sweep)
        created = await hs.create_preauth_key(expiration=now + LIFETIME, acl_tags=[wanted.tag, hs.owner_tag],
                                              reusable=wanted.reusable, ephemeral=wanted.ephemeral)
        # a key made for another server cannot be expired with this server's API; it ages out there
        same_server = previous is not None and previous.login_url == wanted.login_url
        return AuthKey(key=created.key, id=created.id, prefix=mask_key(created.key),
                       created_at=created.created_at or now, expires_at=created.expiration or now + LIFETIME,
                       login_url=wanted.login_url, tag=wanted.tag,
                       previous_id=previous.id if previous and same_server else "",
                       previous_tag=previous.tag if previous and same_server else "",
                       node_ids=previous.node_ids if previous else frozenset())

    async def _expire_previous(self, hs: HeadscaleClient, metadata: JSON, stored: AuthKey) -> AuthKey:
        async def expire(key: AuthKey) -> None:
            await expire_owned(hs, [(key.previous_id, key.previous_tag or key.tag)])

        return await finish(stored, lambda key: self.store(metadata, key), expire)

    async def store(self, metadata: JSON, key: AuthKey) -> None:
        await self.writer.apply(SECRET, key.secret(metadata), field_manager=self.field_manager)

    async def expire(self, hs: HeadscaleClient, stored: AuthKey) -> None:
        """Expire the key (and a previous one not yet expired) of a CR being deleted."""
        await expire_owned(hs, [(stored.previous_id, stored.previous_tag or stored.tag), (stored.id, stored.tag)])


async def _usable(hs: HeadscaleClient, key_id: str, now: datetime) -> bool:
    """Whether Headscale still lists the key ``key_id`` unexpired."""
    key = next((k for k in await hs.list_preauth_keys() if k.id == key_id), None)
    return key is not None and (key.expiration is None or key.expiration > now)


async def expire_owned(hs: HeadscaleClient, keys: list[tuple[str, str]]) -> list[str]:
    """Expire each ``(key id, tag)`` whose key Headscale shows carrying that tag and the operator's
    marker; return the ids left alone. A recorded id is never trusted on its own: whoever could
    write the record must not be able to expire someone else's key with it."""
    wanted = [(key_id, tag) for key_id, tag in keys if key_id]
    if not wanted:
        return []
    known = {key.id: key for key in await hs.list_preauth_keys()}
    skipped = []
    for key_id, tag in wanted:
        key = known.get(key_id)
        if key is None:
            continue  # gone already: nothing to expire
        if tag not in key.acl_tags or hs.owner_tag not in key.acl_tags:
            log.warning("not expiring a pre-auth key that is not this object's", key_id=key_id, tag=tag,
                        key_tags=list(key.acl_tags))
            skipped.append(key_id)
            continue
        with contextlib.suppress(NotFound):
            await hs.expire_preauth_key(key_id)
    return skipped

