"""A CR's pre-auth key: tag-only, in a Secret of the operator's, never shown in status.

An agent's key is reusable, so a restarted pod registers again on its own, and ephemeral, so a
node whose pod is gone ages out of the tailnet. A gateway's is single-use and not ephemeral
(:class:`Wanted`): one node, which stays. Tag-only so the node is the tag and nobody's device; the key also carries
its installation's marker (``hs.owner_tag``), which the orphan sweep (:mod:`.sweep`) recognises. The key is
rotated at half its lifetime and when the Tailnet's login URL or the tag changes, in an order
that survives a crash at any step (the same order as the working API key's):

1. create the new key;
2. store it in the Secret, recording the old key's id as ``previous``;
3. expire the old key, then forget ``previous``.

A failed step 2 that may have stored the key stores the same key again on the next attempt
(:mod:`.unconfirmed`); one that certainly wrote nothing expires it. A crash after 1 leaves an
unused marked key that the orphan sweep expires; after 2, the next reconcile finds ``previous``
and finishes step 3. The old key is never expired before the new Secret is in place,
so a pod restarting in between always finds a valid key. The key itself never leaves the Secret:
status carries only its id, masked prefix and times.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import structlog

from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, NotFound, mask_key
from tailnet_operator.runtime import SECRET, Clock, Writer
from tailnet_operator.types import JSON

from .conditions import rfc3339
from .unconfirmed import Unconfirmed

__all__ = ["AUTH_KEY_FIELD", "LIFETIME", "AuthKey", "AuthKeyKeeper", "Wanted", "expire_owned"]

log = structlog.get_logger("controllers.preauth")

AUTH_KEY_FIELD = "authKey"
"""The Secret's data key, mounted into the agent as a file."""

LIFETIME = timedelta(hours=24)
"""Lifetime of a pre-auth key; it is replaced after half of it."""

_ANNOTATION = "tailnet.dev/"


@dataclass(frozen=True)
class AuthKey:
    """A pre-auth key as its Secret records it: the key, its identity, and what it was made for."""

    key: str
    id: str
    created_at: datetime
    expires_at: datetime
    login_url: str
    tag: str
    previous_id: str = ""
    previous_tag: str = ""
    """The tag the previous key was made for (the tag may have changed with the rotation)."""

    @property
    def prefix(self) -> str:
        return mask_key(self.key)

    @property
    def rotation_due(self) -> datetime:
        return self.created_at + (self.expires_at - self.created_at) / 2

    @classmethod
    def from_secret(cls, secret: JSON | None) -> AuthKey | None:
        """The key the Secret holds, or None when there is none (or the annotations are damaged)."""
        raw = ((secret or {}).get("data") or {}).get(AUTH_KEY_FIELD)
        if not secret or not raw:
            return None
        notes = secret["metadata"].get("annotations") or {}
        try:
            return cls(key=base64.b64decode(raw).decode(), id=notes[f"{_ANNOTATION}key-id"],
                       created_at=datetime.fromisoformat(notes[f"{_ANNOTATION}key-created"]),
                       expires_at=datetime.fromisoformat(notes[f"{_ANNOTATION}key-expires"]),
                       login_url=notes[f"{_ANNOTATION}login-url"], tag=notes[f"{_ANNOTATION}tag"],
                       previous_id=notes.get(f"{_ANNOTATION}previous-key-id", ""),
                       previous_tag=notes.get(f"{_ANNOTATION}previous-tag", ""))
        except (KeyError, ValueError):
            return None

    def annotations(self) -> dict[str, str]:
        notes = {f"{_ANNOTATION}key-id": self.id, f"{_ANNOTATION}key-prefix": self.prefix,
                 f"{_ANNOTATION}key-created": self.created_at.isoformat(),
                 f"{_ANNOTATION}key-expires": self.expires_at.isoformat(),
                 f"{_ANNOTATION}login-url": self.login_url, f"{_ANNOTATION}tag": self.tag}
        if self.previous_id:
            notes[f"{_ANNOTATION}previous-key-id"] = self.previous_id
            notes[f"{_ANNOTATION}previous-tag"] = self.previous_tag or self.tag
        return notes

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
        if stored is not None and stored.previous_id:
            stored = await self._expire_previous(hs, metadata, stored)
        if not (why := self.why_rotate(stored, wanted)):
            assert stored is not None
            return stored, reason
        new = await self._create(hs, wanted, previous=stored)
        await self._store_new(hs, slot, metadata, new)
        if new.previous_id:
            new = await self._expire_previous(hs, metadata, new)
        return new, why

    async def _store_new(self, hs: HeadscaleClient, slot: str, metadata: JSON, new: AuthKey) -> None:
        async def abandon(key: AuthKey) -> None:  # nothing refers to it: expire it, or every retry leaks one
            with contextlib.suppress(HeadscaleError):
                await hs.expire_preauth_key(key.id)

        await self.unconfirmed.store(slot, new, lambda key: self.store(metadata, key), abandon)

    async def _create(self, hs: HeadscaleClient, wanted: Wanted, *, previous: AuthKey | None) -> AuthKey:
        now = self.clock.utcnow()
        # the installation's marker makes the key, and the node made with it, this installation's (the orphan sweep)
        created = await hs.create_preauth_key(expiration=now + LIFETIME, acl_tags=[wanted.tag, hs.owner_tag],
                                              reusable=wanted.reusable, ephemeral=wanted.ephemeral)
        # a key made for another server cannot be expired with this server's API; it ages out there
        same_server = previous is not None and previous.login_url == wanted.login_url
        return AuthKey(key=created.key, id=created.id, created_at=created.created_at or now,
                       expires_at=created.expiration or now + LIFETIME, login_url=wanted.login_url,
                       tag=wanted.tag, previous_id=previous.id if previous and same_server else "",
                       previous_tag=previous.tag if previous and same_server else "")

    async def _expire_previous(self, hs: HeadscaleClient, metadata: JSON, stored: AuthKey) -> AuthKey:
        await expire_owned(hs, [(stored.previous_id, stored.previous_tag or stored.tag)])
        done = replace(stored, previous_id="", previous_tag="")
        await self.store(metadata, done)
        return done

    async def store(self, metadata: JSON, key: AuthKey) -> None:
        await self.writer.apply(SECRET, {
            "metadata": {**metadata, "annotations": key.annotations()},
            "type": "Opaque",
            "data": {AUTH_KEY_FIELD: base64.b64encode(key.key.encode()).decode()},
        }, field_manager=self.field_manager)

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

