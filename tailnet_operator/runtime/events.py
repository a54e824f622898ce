"""Kubernetes Events (events.k8s.io/v1) about the objects the operator manages.

`EventRecorder.event()` turns one occurrence into at most one API write:

1. **Spam filter.** Each regarded object has a token bucket (client-go's
   `EventSourceObjectSpamFilter`: burst 25, refilled one token per 300 s). Every occurrence,
   repeated or not, takes a token; without one it is dropped, so an object stuck in a failure
   loop cannot flood etcd.
2. **Series.** An occurrence with the same `EventKey` (object uid, type, reason, action, note)
   as one seen less than `series_window` seconds (600) before it is a repeat: the existing Event
   gets `series: {count, lastObservedTime}` merge-patched in, where `count` is the number of
   occurrences so far (the apiserver requires at least 2; the first occurrence has no series).
   Anything else creates a new Event named `<object name>.<16 hex digits>`.

Events of cluster-scoped objects go to the "default" namespace. Recording never raises into the
caller: API failures are logged and the occurrence is dropped (`Outcome.FAILED`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum, StrEnum
from typing import Protocol, final

import structlog

from tailnet_operator.types import JSON

from .clock import Clock, RealClock
from .controller.ratelimit import TokenBucket
from .errors import KubeError, NotFound
from .kinds import EVENT, Resource

__all__ = [
    "EventKey",
    "EventRecorder",
    "EventType",
    "EventWriter",
    "ObjectReference",
    "Outcome",
    "Series",
    "SeriesCache",
    "SpamFilter",
]


REPORTING_CONTROLLER = "controller-manager"
"""The Events' ``reportingController`` of a recorder that is given none; a program names itself."""
CLUSTER_SCOPED_NAMESPACE = "default"
"""Where Events about cluster-scoped objects are written."""

DEFAULT_SERIES_WINDOW = 600.0
"""Seconds after the last occurrence during which an identical one extends the same Event."""
DEFAULT_SPAM_BURST = 25
"""Occurrences an object may produce at once before the spam filter drops them."""
DEFAULT_SPAM_QPS = 1.0 / 300.0
"""Tokens per second refilled per object: one every 5 minutes."""
DEFAULT_CACHE_SIZE = 4096
"""Objects (spam filter) and keys (series) remembered; the least recently used are forgotten."""

_NOTE_LIMIT = 1024  # bytes, the apiserver's limit on `note`
_FIELD_LIMIT = 128  # characters, the apiserver's limit on reason, action and reportingInstance
_NAME_LIMIT = 253
_SUFFIX_HEX = 16

log = structlog.get_logger("events")


class EventType(StrEnum):
    NORMAL = "Normal"
    """Expected progress: created, synced, connected."""
    WARNING = "Warning"
    """Something a human may have to look at."""


class Outcome(Enum):
    """What `EventRecorder.event()` did with one occurrence."""

    CREATED = "created"
    SERIES = "series"
    """An existing Event's series count was raised."""
    DROPPED = "dropped"
    """The object's spam-filter bucket was empty."""
    FAILED = "failed"
    """The API write failed or the object had no name/uid; logged."""


# -------------------------------------------------------------------------------------------------
# Pure parts: references, keys, the spam filter and the series cache
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectReference:
    """The `regarding` of an Event; `namespace` is "" for cluster-scoped objects."""

    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, obj: JSON) -> ObjectReference:
        """The reference to an object as read from the API; ValueError if it lacks name or uid."""
        meta = obj.get("metadata") or {}
        if not meta.get("name") or not meta.get("uid") or not obj.get("kind"):
            raise ValueError("an event needs an object with kind, metadata.name and metadata.uid")
        return cls(str(obj.get("apiVersion", "")), str(obj["kind"]), str(meta["name"]),
                   str(meta.get("namespace") or ""), str(meta["uid"]))

    @property
    def event_namespace(self) -> str:
        return self.namespace or CLUSTER_SCOPED_NAMESPACE

    def to_json(self) -> JSON:
        ref: JSON = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}
        if self.namespace:
            ref["namespace"] = self.namespace
        return ref


@dataclass(frozen=True)
class EventKey:
    """Occurrences with equal keys are the same event and share one Event object."""

    uid: str
    type: str
    reason: str
    action: str
    note: str


@final
class SpamFilter:
    """A token bucket per key (client-go's per-source-and-object spam filter).

    Each bucket starts full with `burst` tokens (default 25) and refills `qps` tokens per second
    (default 1/300); `allow` takes one token. Only the `max_keys` (4096) most recently used
    buckets are kept; a forgotten key starts full again.
    """

    def __init__(self, *, burst: int = DEFAULT_SPAM_BURST, qps: float = DEFAULT_SPAM_QPS,
                 max_keys: int = DEFAULT_CACHE_SIZE) -> None:
        if burst < 1 or qps < 0 or max_keys < 1:
            raise ValueError("burst and max_keys must be at least 1 and qps not negative")
        self._burst = burst
        self._qps = qps
        self._max_keys = max_keys
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def allow(self, key: Hashable, now: float) -> bool:
        """Take a token for `key` at monotonic time `now` (seconds); False when none is left."""
        bucket = self._buckets.pop(key, None) or TokenBucket(self._qps, self._burst)
        allowed = bucket.take(now)
        self._buckets[key] = bucket
        if len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return allowed


@dataclass
class Series:
    """The Event that occurrences of one key are counted on."""

    name: str
    namespace: str
    count: int
    last_seen: float
    """Monotonic seconds of the latest occurrence."""


@final
class SeriesCache:
    """Maps an `EventKey` to the Event that is still collecting its occurrences.

    An occurrence within `window` seconds (default 600) of the previous one of its key joins
    that series; after a longer gap, or once the key was evicted (more than `max_keys` (4096)
    more recent keys), it starts a new Event.
    """

    def __init__(self, *, window: float = DEFAULT_SERIES_WINDOW, max_keys: int = DEFAULT_CACHE_SIZE) -> None:
        if window < 0 or max_keys < 1:
            raise ValueError("window must not be negative and max_keys must be at least 1")
        self._window = window
        self._max_keys = max_keys
        self._series: OrderedDict[EventKey, Series] = OrderedDict()

    def repeat(self, key: EventKey, now: float) -> Series | None:
        """Count an occurrence at `now` on the current series of `key`; None if there is none."""
        series = self._series.get(key)
        if series is None or now - series.last_seen > self._window:
            return None
        series.count += 1
        series.last_seen = now
        self._series.move_to_end(key)
        return series

    def start(self, key: EventKey, name: str, namespace: str, now: float) -> Series:
        """Record that the Event `namespace/name` now counts the occurrences of `key`, from 1."""
        series = self._series[key] = Series(name, namespace, 1, now)
        self._series.move_to_end(key)
        if len(self._series) > self._max_keys:
            self._series.popitem(last=False)
        return series

    def forget(self, key: EventKey) -> None:
        self._series.pop(key, None)


def event_name(object_name: str, suffix: str) -> str:
    """`<object name>.<suffix>`, with the object name cut so the whole is a valid name."""
    head = object_name[: _NAME_LIMIT - len(suffix) - 1].rstrip(".-")
    return f"{head}.{suffix}"


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime: `2026-11-29T13:45:00.123456Z`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _truncate_bytes(text: str, limit: int) -> str:
    return text.encode()[:limit].decode(errors="ignore")


# -------------------------------------------------------------------------------------------------
# The recorder
# -------------------------------------------------------------------------------------------------


class EventWriter(Protocol):
    """The part of `Client` the recorder needs; tests pass a fake."""

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON: ...

    async def merge_patch(self, resource: Resource, name: str, patch: JSON, namespace: str | None = None,
                          *, subresource: str | None = None) -> JSON: ...


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@final
class EventRecorder:
    """Writes Events as `reporting_controller` / `reporting_instance`.

    `reporting_instance` is typically the leader-election identity (cut to 128 characters).
    Writes for one key are serialized, so a repeat never patches an Event still being created;
    each write may take `request_timeout` seconds (default 10).
    """

    def __init__(self, client: EventWriter, *, reporting_instance: str,
                 reporting_controller: str = REPORTING_CONTROLLER, clock: Clock | None = None,
                 series_window: float = DEFAULT_SERIES_WINDOW, spam_burst: int = DEFAULT_SPAM_BURST,
                 spam_qps: float = DEFAULT_SPAM_QPS, request_timeout: float = 10.0) -> None:
        self._client = client
        self._controller = reporting_controller[:_FIELD_LIMIT]
        self._instance = reporting_instance[:_FIELD_LIMIT]
        self._clock: Clock = clock or RealClock()
        self._spam = SpamFilter(burst=spam_burst, qps=spam_qps)
        self._series = SeriesCache(window=series_window)
        self._timeout = request_timeout
        self._locks: dict[EventKey, _KeyLock] = {}

    async def normal(self, obj: JSON, reason: str, note: str, *, action: str = "Reconcile") -> Outcome:
        return await self.event(obj, EventType.NORMAL, reason, note, action=action)

    async def warning(self, obj: JSON, reason: str, note: str, *, action: str = "Reconcile") -> Outcome:
        return await self.event(obj, EventType.WARNING, reason, note, action=action)

    async def event(self, obj: JSON, type: EventType, reason: str, note: str, *,
                    action: str = "Reconcile") -> Outcome:
        """Record one occurrence about `obj` (as read from the API: needs kind, name and uid).

        `reason` is CamelCase and machine-readable ("TailnetConnected"), `note` is for humans
        (cut to 1024 bytes), `action` is what the controller did or failed to do. Never raises.
        """
        try:
            ref = ObjectReference.of(obj)
        except ValueError as exc:
            log.warning("event dropped", reason=reason, error=str(exc))
            return Outcome.FAILED
        if not self._spam.allow((ref.kind, ref.namespace, ref.name, ref.uid), self._clock.now()):
            log.debug("event dropped by the spam filter", object=f"{ref.kind}/{ref.name}", reason=reason)
            return Outcome.DROPPED
        key = EventKey(ref.uid, str(type), reason[:_FIELD_LIMIT], action[:_FIELD_LIMIT],
                       _truncate_bytes(note, _NOTE_LIMIT))
        async with self._serialized(key):
            series = self._series.repeat(key, self._clock.now())
            if series is not None:
                outcome = await self._patch_series(key, series)
                if outcome is not None:
                    return outcome
            return await self._create(key, ref)

    async def _create(self, key: EventKey, ref: ObjectReference) -> Outcome:
        name = event_name(ref.name, secrets.token_hex(_SUFFIX_HEX // 2))
        body: JSON = {
            "apiVersion": EVENT.api_version, "kind": EVENT.kind,
            "metadata": {"name": name, "namespace": ref.event_namespace},
            "eventTime": micro_time(self._clock.utcnow()),
            "type": key.type, "reason": key.reason, "action": key.action, "note": key.note,
            "regarding": ref.to_json(),
            "reportingController": self._controller, "reportingInstance": self._instance,
        }
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.create(EVENT, body, ref.event_namespace)
        except (KubeError, TimeoutError) as exc:
            self._series.forget(key)
            self._log_failure("create", ref.event_namespace, name, key, exc)
            return Outcome.FAILED
        self._series.start(key, name, ref.event_namespace, self._clock.now())
        return Outcome.CREATED

    async def _patch_series(self, key: EventKey, series: Series) -> Outcome | None:
        """Raise the Event's series count; None when the Event is gone (expired: start anew)."""
        patch = {"series": {"count": series.count, "lastObservedTime": micro_time(self._clock.utcnow())}}
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.merge_patch(EVENT, series.name, patch, series.namespace)
        except NotFound:
            self._series.forget(key)
            return None
        except (KubeError, TimeoutError) as exc:
            self._log_failure("patch", series.namespace, series.name, key, exc)
            return Outcome.FAILED
        return Outcome.SERIES

    @contextlib.asynccontextmanager
    async def _serialized(self, key: EventKey) -> AsyncIterator[None]:
        entry = self._locks.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[key]

    @staticmethod
    def _log_failure(verb: str, namespace: str, name: str, key: EventKey, exc: BaseException) -> None:
        log.warning("could not record an event", verb=verb, event_name=f"{namespace}/{name}", type=key.type,
                    reason=key.reason, error=str(exc) or type(exc).__name__)
