"""Keys minted but not yet known to be stored: stored again, never minted again.

The working API key (:mod:`.tailnet`) and the pre-auth keys (:mod:`.preauth`) are both created in
Headscale first and recorded in a Secret second. When that write fails, one of two things is known:

- it **certainly** wrote nothing (a 4xx answer, or the request was never sent:
  :func:`~tailnet_operator.runtime.certainly_not_written`): nothing refers to the key, so it is
  expired at once (``abandon``);
- it **may** have been stored (a timeout, a broken connection, a 5xx: etcd may have committed it):
  expiring the key could leave the Secret holding a dead key, and minting another on the retry
  would leak one key per retry. So the key is remembered here, by the Secret it was meant for, and
  the next attempt stores the *same* key again (an apply of the same content is idempotent);
  if the Secret turns out to hold it, it is simply forgotten.

A key that was once uncertain is never abandoned later, even when a retry certainly failed: the
first write may still have landed. The record lives in the process: a leader that exits between
the two steps leaves its key behind (pre-auth keys carry the installation's marker and the
orphan sweep expires them; API keys carry none: see docs/reliability.md, "Chaos").

A create can also go unseen: Headscale made the key, but its answer was lost or the lookup that
names the new key failed, so the operator holds no id to expire. :class:`Unseen` remembers the
expiration each create asked for until the key is stored; a listed API key with exactly that
expiration is the one that create made (the client picks it, to the microsecond, so it tells
mints apart), and is expired unless it is the key in use.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, Protocol, TypeVar

from tailnet_operator.runtime import certainly_not_written

__all__ = ["Unconfirmed", "Unseen"]


class _Key(Protocol):
    @property
    def id(self) -> str: ...


K = TypeVar("K", bound=_Key)


class _Listed(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def expiration(self) -> dt.datetime | None: ...


L = TypeVar("L", bound=_Listed)

SAME_EXPIRATION = dt.timedelta(milliseconds=1)
"""How close a listed expiration must be to the one asked for: a store keeping only milliseconds
still matches, two mints of one process never do (they are more than a millisecond apart)."""


class Unconfirmed(Generic[K]):
    """Minted keys whose store had an uncertain outcome, one per slot (the Secret's ``namespace/name``)."""

    def __init__(self) -> None:
        self._keys: dict[str, K] = {}

    def held(self, slot: str) -> K | None:
        """The key remembered for ``slot``, confirmed or not (to tell what :meth:`pending` confirmed)."""
        return self._keys.get(slot)

    def pending(self, slot: str, *, stored_id: str | None) -> K | None:
        """The key minted for ``slot`` that must be stored before anything else is minted, or None.
        ``stored_id`` is the id the Secret is seen to hold: when it is that key's, the key is
        confirmed and forgotten."""
        key = self._keys.get(slot)
        if key is not None and key.id == stored_id:
            del self._keys[slot]
            return None
        return key

    def forget(self, slot: str) -> None:
        """Drop the record (the key turned out to be unusable: nothing more can be done with it)."""
        self._keys.pop(slot, None)

    async def store(self, slot: str, key: K, write: Callable[[K], Awaitable[None]],
                    abandon: Callable[[K], Awaitable[None]]) -> None:
        """``write(key)``; on failure, ``abandon(key)`` if nothing can refer to it, else remember it
        for the next attempt. The error is raised again either way."""
        held = self._keys.get(slot)
        was_uncertain = held is not None and held.id == key.id
        try:
            await write(key)
        except Exception as exc:
            if certainly_not_written(exc) and not was_uncertain:
                self._keys.pop(slot, None)
                await abandon(key)
            else:
                self._keys[slot] = key
            raise
        self._keys.pop(slot, None)


class Unseen:
    """The expirations asked for by creates not yet followed by a store, one set per slot."""

    def __init__(self) -> None:
        self._asked: dict[str, set[dt.datetime]] = {}

    def asking(self, slot: str, expiration: dt.datetime) -> None:
        """Before a create: its key may exist from now on without the operator knowing its id."""
        self._asked.setdefault(slot, set()).add(expiration)

    def asked(self, slot: str) -> frozenset[dt.datetime]:
        return frozenset(self._asked.get(slot, ()))

    def done(self, slot: str, expirations: Iterable[dt.datetime]) -> None:
        """Forget ``expirations``: their keys were expired, or stored (the key in use, not an unseen one)."""
        left = self._asked.get(slot, set()) - set(expirations)
        if left:
            self._asked[slot] = left
        else:
            self._asked.pop(slot, None)

    @staticmethod
    def made_by(asked: Iterable[dt.datetime], listed: Iterable[L], *, keep: set[str]) -> list[L]:
        """The keys in ``listed`` that a create asking one of ``asked`` made, except those in ``keep``
        (an expired key no longer matches: Headscale sets its expiration to the moment it expired)."""
        wanted = list(asked)
        return [key for key in listed if key.id not in keep and key.expiration is not None
                and any(abs(key.expiration - when) < SAME_EXPIRATION for when in wanted)]
