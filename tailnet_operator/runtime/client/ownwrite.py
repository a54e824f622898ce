"""Which change a write's answer brings that the write itself does not explain.

The REST client records every write (what it sent, what the apiserver answered) with
:func:`record` before it hands the answer to its observers (the cache). Code that wants to know
the writes made under it (a controller, around one reconcile: ``ControllerOptions.ignore_own_writes``)
collects them with :func:`recording`; tasks started inside inherit the collection.

A controller uses the writes of a reconcile to drop the events they cause, whether the
answer or the watch event of the same resourceVersion reaches the cache first: that reconcile
already acted on everything but its own write. The answer may hold more than the write, though:
another writer may have changed the object between the reconcile's read and its write, and the
cache never sees that version (its watch event is older than the answer, so the informer drops
it). :func:`only_written` therefore compares the object the cache held before (``old``) with
the new one and calls the change the write's only when the new one is the answer and every
difference lies in a field the write sent, or in bookkeeping the apiserver changes on every
write (``resourceVersion``, ``managedFields``; on a creation also ``uid``,
``creationTimestamp`` and ``generation``). A changed ``generation`` on an existing object is
never the write's: the status must then follow a spec it has not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from tailnet_operator.types import JSON

from ..kinds import Resource
from .ssa import SET_LISTS, item_key

__all__ = ["OwnWrite", "explains", "only_written", "record", "recording"]


@dataclass(frozen=True)
class OwnWrite:
    """One write: what was sent, and what came back."""

    resource: Resource
    sent: JSON
    """The body sent (apply, merge patch, replace or create)."""
    stored: JSON
    """The object the apiserver answered with (the very dict the cache is fed)."""


_RECORDING: ContextVar[list[OwnWrite] | None] = ContextVar("tailnet_operator_own_writes", default=None)

BOOKKEEPING = frozenset({("metadata", "resourceVersion"), ("metadata", "managedFields")})
"""Changed by every write, whoever makes it."""
CREATED = BOOKKEEPING | {("metadata", "uid"), ("metadata", "creationTimestamp"), ("metadata", "generation")}
"""Set by the apiserver when the write created the object."""


@contextlib.contextmanager
def recording(into: list[OwnWrite]) -> Iterator[list[OwnWrite]]:
    """Append to ``into`` every write recorded (:func:`record`) inside, in this task and those it starts."""
    token = _RECORDING.set(into)
    try:
        yield into
    finally:
        _RECORDING.reset(token)


def record(write: OwnWrite) -> None:
    """Note ``write`` for the :func:`recording` around the caller, if there is one."""
    writes = _RECORDING.get()
    if writes is not None:
        writes.append(write)


def explains(writes: list[OwnWrite], resource: Resource, old: JSON | None, new: JSON) -> bool:
    """Whether one of ``writes`` stored ``new`` (same resourceVersion) and explains ``old`` -> ``new``."""
    version = new.get("metadata", {}).get("resourceVersion")
    return any(w.resource == resource and w.stored.get("metadata", {}).get("resourceVersion") == version
               and only_written(w, old, new) for w in writes)


def only_written(write: OwnWrite, old: JSON | None, new: JSON) -> bool:
    """Whether going from ``old`` (None: absent) to ``new`` changed nothing ``write`` did not send.

    ``new`` must be the write's answer (or its watch event: the same object): an informer that
    keeps less of the object (a metadata-only one) cannot tell what else changed, so its events
    always count.
    """
    if new is not write.stored and new != write.stored:
        return False
    ignored = CREATED if old is None else BOOKKEEPING
    return _same_but_sent(old or {}, new, write.sent, (), ignored)


def _same_but_sent(old: Any, new: Any, sent: Any, path: tuple[str, ...], ignored: frozenset[tuple[str, ...]]) -> bool:
    """``old`` and ``new`` equal at ``path``, except where ``sent`` (the write's body there) covers."""
    if path in ignored:
        return True
    if isinstance(sent, dict) and sent:
        if not (isinstance(old, dict) or old is None) or not isinstance(new, dict):
            return False
        old = old or {}
        return all(_same_but_sent(old.get(k), new.get(k), sent.get(k), (*path, k), ignored)
                   for k in old.keys() | new.keys())
    if isinstance(sent, list) and isinstance(new, list) and (old is None or isinstance(old, list)):
        return _list_same_but_sent(old or [], new, sent, path[-1] if path else "")
    if sent is not None and not isinstance(sent, dict):
        return True  # a value (or an atomic list) the write set: whatever it is now, it is the write's
    return bool(old == new)


def _list_same_but_sent(old: list[Any], new: list[Any], sent: list[Any], name: str) -> bool:
    """A keyed or set-like list: the fields of the items the write sent are its, every other
    item must be unchanged. Any other list the write sent is atomic, and the write's whole."""
    if not sent or any(item_key(name, i) is None for i in (*old, *new, *sent)):
        return True
    before = {item_key(name, i): i for i in old}
    after = {item_key(name, i): i for i in new}
    mine = {item_key(name, i): i for i in sent}
    if name in SET_LISTS:
        return before.keys() - mine.keys() == after.keys() - mine.keys()
    return all(_same_but_sent(before.get(k), after.get(k), mine.get(k), (), frozenset())
               for k in before.keys() | after.keys())
