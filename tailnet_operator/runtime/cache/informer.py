"""Informers: a reflector that keeps a local store in step with kube-apiserver.

The reflector lists, then watches from the list's resourceVersion. A watch that ends (the
server's timeout) or breaks (a connection error) resumes from the last resourceVersion it
saw, after a jittered backoff of 0.8 s doubling to 30 s; only 410 Gone (the version was
compacted away) makes it list again. A relist compares the new list with the store and
emits deletions for objects that vanished in between, as tombstones
(:class:`DeletedFinalStateUnknown`) because their final state was never seen.

A write's answer (the object the API server stored) can be handed to :meth:`Informer.observe`:
it enters the store at once, handlers are told as for a watch event, and the watch event of
the same resourceVersion is then a no-op. So a reconcile woken by some other event already
sees its own last write, and does not write the same thing again. An event older than what
the store holds (both resourceVersions numeric, as etcd's are) is dropped for the same reason.

Objects in the store are shared with every reader: treat them as read-only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from tailnet_agent.contract.backoff import Backoff
from tailnet_operator.types import JSON

from ..client import WATCH_INACTIVITY_TIMEOUT, Client, ObjectList, WatchEvent
from ..client.interfaces import ListerWatcher
from ..clock import Clock, RealClock
from ..errors import Gone, KubeError, NotFound
from ..kinds import Resource

log = structlog.get_logger("informer")

IndexFunc = Callable[[JSON], Iterable[str]]
"""Maps an object to the index values it is filed under."""

NAMESPACE_INDEX = "namespace"


ABSENT_RECHECK = 30.0
"""Seconds between lists of an optional kind found not served (:attr:`Informer.optional`)."""


def namespace_index(obj: JSON) -> list[str]:
    return [str(obj.get("metadata", {}).get("namespace") or "")]


def store_key(obj: JSON) -> str:
    """``namespace/name``, or ``name`` for cluster-scoped objects (client-go's MetaNamespaceKey)."""
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else str(meta["name"])


def label_selector(labels: Mapping[str, str] | None) -> str | None:
    """The equality selector ``a=b,c=d`` for ``labels`` (None or empty: every object)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) if labels else None


def matches_labels(obj: JSON, labels: Mapping[str, str] | None) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in (labels or {}).items())


def newer(candidate: JSON, current: JSON) -> bool | None:
    """Whether ``candidate`` is a later version than ``current``; None when that cannot be told."""
    a = str(candidate.get("metadata", {}).get("resourceVersion", ""))
    b = str(current.get("metadata", {}).get("resourceVersion", ""))
    if a.isdigit() and b.isdigit():
        return int(a) > int(b)
    return None


@dataclass(frozen=True)
class DeletedFinalStateUnknown:
    """An object deleted while the watch was down: ``obj`` is the last state the store had."""

    key: str
    obj: JSON


class EventHandler(Protocol):
    """Told about every change to the store, in order, on the event loop."""

    def on_add(self, obj: JSON) -> None: ...

    def on_update(self, old: JSON, new: JSON) -> None: ...

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None: ...


METADATA_FIELDS = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "deletionTimestamp", "labels", "ownerReferences", "finalizers")
"""What a metadata-only informer keeps of each object (no annotations, no managedFields)."""


def metadata_of(obj: JSON) -> JSON:
    """``obj`` reduced to the metadata a metadata-only informer keeps."""
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""),
            "metadata": {k: meta[k] for k in METADATA_FIELDS if k in meta}}


class MetadataOnly:
    """A :class:`~.interfaces.ListerWatcher` of objects' metadata only: the API server sends
    PartialObjectMetadata (when ``inner`` supports ``metadata_only``, as the REST client does) and
    each object is reduced with :func:`metadata_of`, so bodies (a Secret's data, a ConfigMap's)
    are never held."""

    def __init__(self, inner: ListerWatcher) -> None:
        self.inner = inner

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None) -> ObjectList:
        if isinstance(self.inner, Client):
            result = await self.inner.list(resource, namespace, label_selector=label_selector, metadata_only=True)
        else:
            result = await self.inner.list(resource, namespace, label_selector=label_selector)
        result.items = [metadata_of(o) for o in result.items]
        return result

    async def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None,
                    inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        if isinstance(self.inner, Client):
            events = self.inner.watch(resource, namespace, resource_version=resource_version,
                                      label_selector=label_selector, inactivity_timeout=inactivity_timeout,
                                      metadata_only=True)
        else:
            events = self.inner.watch(resource, namespace, resource_version=resource_version,
                                      label_selector=label_selector, inactivity_timeout=inactivity_timeout)
        async for event in events:
            obj = event.object
            yield WatchEvent(event.type, obj if event.type == "BOOKMARK" else metadata_of(obj))


# -- Store ---------------------------------------------------------------------------------------


class Store:
    """Objects by key with secondary indexes; the namespace index is always present."""

    def __init__(self) -> None:
        self._items: dict[str, JSON] = {}
        self._indexers: dict[str, IndexFunc] = {NAMESPACE_INDEX: namespace_index}
        self._indices: dict[str, dict[str, set[str]]] = {NAMESPACE_INDEX: {}}

    def add_indexer(self, name: str, func: IndexFunc) -> None:
        """Add an index; existing objects are filed under it at once. Re-adding is an error."""
        if name in self._indexers:
            raise ValueError(f"indexer {name!r} already exists")
        self._indexers[name] = func
        self._indices[name] = {}
        for key, obj in self._items.items():
            self._file(name, key, obj)

    def has_indexer(self, name: str) -> bool:
        return name in self._indexers

    def get(self, key: str) -> JSON | None:
        return self._items.get(key)

    def object_keys(self) -> list[str]:
        return list(self._items)

    def objects(self) -> list[JSON]:
        return list(self._items.values())

    def by_index(self, name: str, value: str) -> list[JSON]:
        if name not in self._indices:
            raise KeyError(f"no indexer named {name!r}")
        return [self._items[k] for k in sorted(self._indices[name].get(value, ()))]

    def __len__(self) -> int:
        return len(self._items)

    def put(self, obj: JSON) -> JSON | None:
        """Insert or replace; returns the previous object."""
        key = store_key(obj)
        old = self._items.get(key)
        if old is not None:
            self._unfile(key, old)
        self._items[key] = obj
        for name in self._indexers:
            self._file(name, key, obj)
        return old

    def remove(self, key: str) -> JSON | None:
        old = self._items.pop(key, None)
        if old is not None:
            self._unfile(key, old)
        return old

    def _file(self, name: str, key: str, obj: JSON) -> None:
        for value in self._indexers[name](obj):
            self._indices[name].setdefault(value, set()).add(key)

    def _unfile(self, key: str, obj: JSON) -> None:
        for name, func in self._indexers.items():
            index = self._indices[name]
            for value in func(obj):
                keys = index.get(value)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del index[value]


# -- Informer ------------------------------------------------------------------------------------


def informer_backoff(*, jitter: float = 1.0) -> Backoff:
    """client-go's reflector backoff: 0.8 s doubling to a 30 s cap, times a factor in [1, 1 + jitter)."""
    return Backoff(initial=0.8, maximum=30.0, jitter_low=1.0, jitter_high=1.0 + jitter)


@dataclass
class InformerStats:
    """Counters a test or a debug page can read: how the informer has talked to the server."""

    lists: int = 0
    watches: int = 0
    relists_after_gone: int = 0
    watch_errors: int = 0
    last_resource_version: str = ""


class Informer:
    """List+watch of one resource (optionally one namespace, optionally only objects with
    ``labels``) into a :class:`Store`.

    ``run()`` blocks until cancelled; ``wait_synced()`` returns once the first list is in.
    Handlers added after the first list are replayed the current objects as adds. ``clock``
    (default: the event loop's) times the retry backoff.
    """

    def __init__(self, client: ListerWatcher, resource: Resource, namespace: str | None = None, *,
                 labels: Mapping[str, str] | None = None, backoff: Backoff | None = None,
                 clock: Clock | None = None, inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT,
                 optional: bool = False) -> None:
        self.client = client
        self.optional = optional
        """The kind may not be served (a CRD not installed): a list answered 404 counts as synced
        and empty, and is tried again every :data:`ABSENT_RECHECK` seconds, so the kind's objects
        arrive as adds once its CRD is installed, with no restart."""
        self.absent = False
        """Whether the last list of an optional kind found it not served."""
        self.resource = resource
        self.namespace = namespace
        self.labels = dict(labels or {})
        self._selector = label_selector(labels)
        self.store = Store()
        self.stats = InformerStats()
        self._handlers: list[EventHandler] = []
        self.siblings: EventHandler | None = None
        """Told of every change before the handlers (the shared cache passes it to the other
        informers of the kind); not a handler: it is not replayed, listed or counted."""
        self._synced = asyncio.Event()
        self._backoff = backoff or informer_backoff()
        self._clock: Clock = clock or RealClock()
        self._inactivity_timeout = inactivity_timeout
        self._log = log.bind(resource=str(resource), namespace=namespace or "")

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    def add_handler(self, handler: EventHandler) -> None:
        self._handlers.append(handler)
        if self.synced:
            for obj in self.store.objects():
                handler.on_add(obj)

    def add_indexer(self, name: str, func: IndexFunc) -> None:
        if not self.store.has_indexer(name):
            self.store.add_indexer(name, func)

    async def run(self) -> None:
        resource_version: str | None = None
        while True:
            try:
                if resource_version is None:
                    resource_version = await self._list()
                resource_version = await self._watch(resource_version)
                self._backoff.reset()
            except NotFound as exc:
                resource_version = None
                await (self._absent() if self.optional else self._retry(exc))
            except Gone:
                self.stats.relists_after_gone += 1
                self._log.info("resourceVersion expired, relisting", resource_version=resource_version)
                resource_version = None
            except KubeError as exc:
                await self._retry(exc)

    async def _retry(self, exc: KubeError) -> None:
        self.stats.watch_errors += 1
        delay = self._backoff.next()
        self._log.warning("list/watch failed, retrying", error=str(exc), retry_in=round(delay, 2))
        await self._clock.sleep(delay)

    async def _absent(self) -> None:
        """An optional kind not served: empty and synced, looked for again after a while."""
        if not self.absent:
            self._log.info("kind not served (its CRD is not installed); looking again periodically",
                           retry_in=ABSENT_RECHECK)
        self.absent = True
        self._replace([])
        self._synced.set()
        await self._clock.sleep(ABSENT_RECHECK)

    async def _list(self) -> str:
        self.stats.lists += 1
        result = await self.client.list(self.resource, self.namespace, label_selector=self._selector)
        if self.absent:
            self._log.info("kind served now", objects=len(result.items))
        self.absent = False
        self._replace(result.items)
        self.stats.last_resource_version = result.resource_version
        if not self._synced.is_set():
            self._log.debug("synced", objects=len(result.items))
            self._synced.set()
        return result.resource_version

    async def _watch(self, resource_version: str) -> str:
        """Apply watch events until the server ends the stream; return where to resume."""
        self.stats.watches += 1
        async for event in self.client.watch(self.resource, self.namespace, resource_version=resource_version,
                                             label_selector=self._selector,
                                             inactivity_timeout=self._inactivity_timeout):
            if event.type == "BOOKMARK":
                pass
            elif event.type in ("ADDED", "MODIFIED"):
                self._upsert(event.object)
            elif event.type == "DELETED":
                self._delete(event.object)
            resource_version = event.resource_version or resource_version
            self.stats.last_resource_version = resource_version
        return resource_version

    def observe(self, obj: JSON) -> None:
        """Take a write's answer into the store now, if it is this informer's and newer."""
        if not self.synced or not self._covers(obj):
            return
        current = self.store.get(store_key(obj))
        if current is None or newer(obj, current):
            self._upsert(obj)

    def forget(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        """Take a deletion another informer of the kind saw: drop the object unless the store holds
        a later version of it (a new object of the same name), and tell the handlers."""
        final = obj.obj if isinstance(obj, DeletedFinalStateUnknown) else obj
        if not self.synced:
            return
        key = store_key(final)
        current = self.store.get(key)
        if current is None or newer(current, final) is not False:
            return
        self.store.remove(key)
        self._notify_delete(obj)

    def _covers(self, obj: JSON) -> bool:
        namespace = obj.get("metadata", {}).get("namespace") or None
        return (self.namespace is None or namespace == self.namespace) and matches_labels(obj, self.labels)

    # -- store updates and notifications --------------------------------------------------------

    def _replace(self, items: list[JSON]) -> None:
        seen = set()
        for obj in items:
            seen.add(store_key(obj))
            self._upsert(obj)
        for key in [k for k in self.store.object_keys() if k not in seen]:
            old = self.store.remove(key)
            if old is not None:
                self._notify_delete(DeletedFinalStateUnknown(key, old))

    def _upsert(self, obj: JSON) -> None:
        current = self.store.get(store_key(obj))
        if current is not None and newer(obj, current) is False:
            return  # an observed write is already newer (or this very version: no change)
        old = self.store.put(obj)
        if old is None:
            for handler in self._told():
                self._call(handler.on_add, obj)
        elif old.get("metadata", {}).get("resourceVersion") != obj.get("metadata", {}).get("resourceVersion"):
            for handler in self._told():
                self._call(handler.on_update, old, obj)

    def _delete(self, obj: JSON) -> None:
        if self.store.remove(store_key(obj)) is not None:
            self._notify_delete(obj)

    def _notify_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        for handler in self._told():
            self._call(handler.on_delete, obj)

    def _told(self) -> list[EventHandler]:
        return [self.siblings, *self._handlers] if self.siblings is not None else list(self._handlers)

    def _call(self, func: Callable[..., None], *args: Any) -> None:
        try:
            func(*args)
        except Exception:
            self._log.exception("event handler failed")
