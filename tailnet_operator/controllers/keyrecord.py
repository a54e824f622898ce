"""One record and one rotation order for every key the operator keeps in a Secret.

The working API key (:mod:`.tailnet`) and the pre-auth keys (:mod:`.preauth`) are both a
:class:`KeyRecord`: the key in the Secret's data, its identity and times in annotations, and the
id of the key it replaced until that one is expired. Both are replaced in the same order, which
survives a crash at any step:

1. create the new key, recording the old one's id as ``previous``;
2. :func:`store_new`: store it in the Secret (a write with an uncertain outcome stores the same
   key again on the next attempt, one that certainly wrote nothing abandons it: :mod:`.unconfirmed`);
3. :func:`finish`: expire the previous key, then store the record without it.

The old key is never expired before the new record is in place, so whatever reads the Secret
always finds a valid key; a reconcile that finds ``previous`` recorded finishes step 3.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, ClassVar, Self, TypeVar

from tailnet_operator.types import JSON

from .unconfirmed import Unconfirmed

__all__ = ["KEY_ID", "KEY_TAG", "NODE_IDS", "PREVIOUS_KEY_ID", "KeyRecord", "finish", "store_new"]

_PREFIX = "tailnet.dev/"
KEY_ID = f"{_PREFIX}key-id"
KEY_PREFIX = f"{_PREFIX}key-prefix"
KEY_CREATED = f"{_PREFIX}key-created"
KEY_EXPIRES = f"{_PREFIX}key-expires"
PREVIOUS_KEY_ID = f"{_PREFIX}previous-key-id"
NODE_IDS = f"{_PREFIX}node-ids"
"""The nodes registered with a CR's keys, current or retired, that Headscale still lists (comma
separated): an agent pod outlives its key, so its node is found by id after the key rotated."""
KEY_TAG = f"{_PREFIX}tag"
"""The tag a pre-auth key was made for (the orphan sweep reads it); the working API key's record has none."""


@dataclass(frozen=True, kw_only=True)
class KeyRecord:
    """A key as its Secret records it. Kinds of keys add what they were made for
    (:meth:`extra_annotations`, :meth:`extra_fields`) and name their data field."""

    DATA_FIELD: ClassVar[str] = "key"

    key: str
    id: str
    prefix: str
    created_at: datetime
    expires_at: datetime
    previous_id: str = ""
    """The key this one replaced, until it is expired (step 3)."""

    @property
    def rotation_due(self) -> datetime:
        """Half the key's lifetime."""
        return self.created_at + (self.expires_at - self.created_at) / 2

    @classmethod
    def from_secret(cls, secret: JSON | None) -> Self | None:
        """The record the Secret holds, or None when there is none (or its annotations are damaged)."""
        raw = ((secret or {}).get("data") or {}).get(cls.DATA_FIELD)
        if not secret or not raw:
            return None
        notes = secret.get("metadata", {}).get("annotations") or {}
        try:
            return cls(key=base64.b64decode(raw).decode(), id=notes[KEY_ID], prefix=notes.get(KEY_PREFIX, ""),
                       created_at=datetime.fromisoformat(notes[KEY_CREATED]),
                       expires_at=datetime.fromisoformat(notes[KEY_EXPIRES]),
                       previous_id=notes.get(PREVIOUS_KEY_ID, ""), **cls.extra_fields(notes))
        except (KeyError, TypeError, ValueError):
            return None

    @classmethod
    def extra_fields(cls, notes: dict[str, str]) -> dict[str, Any]:
        """The kind's own fields, from the annotations (KeyError when one is missing)."""
        return {}

    def extra_annotations(self) -> dict[str, str]:
        return {}

    def annotations(self) -> dict[str, str]:
        """What the Secret records besides the key itself (the inverse of :meth:`from_secret`)."""
        notes = {KEY_ID: self.id, KEY_PREFIX: self.prefix, KEY_CREATED: self.created_at.isoformat(),
                 KEY_EXPIRES: self.expires_at.isoformat()}
        if self.previous_id:
            notes[PREVIOUS_KEY_ID] = self.previous_id
        return {**notes, **self.extra_annotations()}

    def secret(self, metadata: JSON) -> JSON:
        """The Secret that records this key, with ``metadata`` (name, namespace, owner, labels)."""
        return {"metadata": {**metadata, "annotations": {**(metadata.get("annotations") or {}), **self.annotations()}},
                "type": "Opaque",
                "data": {self.DATA_FIELD: base64.b64encode(self.key.encode()).decode()}}

    def without_previous(self) -> Self:
        return replace(self, previous_id="")


K = TypeVar("K", bound=KeyRecord)


async def store_new(unconfirmed: Unconfirmed[K], slot: str, key: K, store: Callable[[K], Awaitable[None]],
                    abandon: Callable[[K], Awaitable[None]]) -> None:
    """Step 2: store a key just created; a failed write is retried with the same key or the key is
    abandoned, as :meth:`.Unconfirmed.store` decides."""
    await unconfirmed.store(slot, key, store, abandon)


async def finish(key: K, store: Callable[[K], Awaitable[None]],
                 expire_previous: Callable[[K], Awaitable[None]]) -> K:
    """Step 3: expire the key ``key`` replaced (if one is recorded) and forget it."""
    if not key.previous_id:
        return key
    await expire_previous(key)
    done = key.without_previous()
    await store(done)
    return done
