"""The shared cache: one informer per (resource, namespace, labels), shared by every controller.

Controllers ask for the informers they need before the cache starts (or after: a late
informer is started at once). Reconcilers read through :meth:`SharedCache.get` and
:meth:`SharedCache.list` (the :class:`~.interfaces.Reader` protocol), never from the API
server, so a reconcile that finds nothing to change makes no request at all. A model class
registered in the :class:`~.scheme.Scheme` reads as validated objects (parsed once per
resourceVersion); a :class:`~.kinds.Resource` reads as the raw, shared dicts.

An informer may be scoped to a namespace and to an equality label selector; a read is served
by the informer of all namespaces and no labels when there is one, otherwise by the scoped one
(which holds only the objects in its scope).

A kind can be cached *by metadata* (:meth:`SharedCache.cache_by_metadata`, for Secrets and
ConfigMaps, whose bodies in a big cluster would dominate the operator's memory): whole objects
in one namespace (the operator's), and elsewhere only each object's metadata, from a
metadata-only watch (controllers' watches and mappers see every change). A read of such an
object outside that namespace returns its body fetched once per resourceVersion; the first read
of a version not fetched yet raises :class:`NotYetCached` and starts the fetch, and the
controller retries the request when the body is in (no error, no backoff). So the cache holds
the bodies of the objects reconcilers read, and the names of the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import structlog
from pydantic import BaseModel

from tailnet_operator.types import JSON

from .clock import Clock
from .errors import NotFound
from .informer import (
    NAMESPACE_INDEX,
    DeletedFinalStateUnknown,
    EventHandler,
    IndexFunc,
    Informer,
    MetadataOnly,
    label_selector,
    metadata_of,
    newer,
    store_key,
)
from .interfaces import ListerWatcher
from .kinds import Resource
from .reading import TypedReader
from .scheme import Scheme

log = structlog.get_logger("cache")

M = TypeVar("M", bound=BaseModel)

DEFAULT_SYNC_TIMEOUT = 120.0
"""Seconds ``wait_for_sync`` waits by default (controller-runtime's CacheSyncTimeout)."""


class CacheSyncTimeout(TimeoutError):
    """An informer did not finish its first list in time; names the resources."""


class NotYetCached(Exception):
    """The body of an object cached by metadata is being fetched; the controller retries the
    request once it is in (see :meth:`SharedCache.when_fetched`)."""

    def __init__(self, resource: Resource, key: str) -> None:
        super().__init__(f"{resource.kind} {key} is being fetched")
        self.resource = resource
        self.key = key


class Getter(Protocol):
    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON: ...


FETCH_RETRY_DELAY = 1.0
"""Seconds before the requests waiting on a failed fetch are retried."""


@dataclass
class _ByMetadata:
    """The bodies fetched of one kind cached by metadata (outside ``namespace``)."""

    namespace: str | None
    bodies: dict[str, JSON] = field(default_factory=dict)
    pending: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    waiters: dict[str, list[Callable[[], None]]] = field(default_factory=dict)


class _Refetch:
    """Handler on a metadata-only informer: a fetched body whose object changed is fetched again
    (so the next read finds it), and forgotten when the object goes."""

    def __init__(self, cache: SharedCache, resource: Resource) -> None:
        self._cache = cache
        self._resource = resource

    def on_add(self, obj: JSON) -> None:
        self._cache._changed(self._resource, obj)

    def on_update(self, old: JSON, new: JSON) -> None:
        self._cache._changed(self._resource, new)

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        key = obj.key if isinstance(obj, DeletedFinalStateUnknown) else store_key(obj)
        self._cache._by_metadata[self._resource].bodies.pop(key, None)


InformerKey = tuple[Resource, str | None, str | None]
"""(resource, namespace or None for all, label selector or None for all)."""


class SharedCache(TypedReader):
    """Informers keyed by (resource, namespace, labels); ``namespace=None`` watches all namespaces."""

    def __init__(self, client: ListerWatcher, *, scheme: Scheme | None = None, clock: Clock | None = None) -> None:
        self.client = client
        self.scheme = scheme or Scheme()
        self._clock = clock
        self._informers: dict[InformerKey, Informer] = {}
        self._parsed: dict[tuple[Resource, str], tuple[str, BaseModel]] = {}
        self._group: asyncio.TaskGroup | None = None
        self._by_metadata: dict[Resource, _ByMetadata] = {}

    def cache_by_metadata(self, resource: Resource, *, namespace: str | None) -> None:
        """Cache ``resource`` whole in ``namespace`` only and by metadata everywhere else (see
        the module doc). Call before any informer of ``resource`` exists."""
        if any(r == resource for r, _, _ in self._informers):
            raise ValueError(f"{resource}: cache_by_metadata() must come before its informers")
        self._by_metadata[resource] = _ByMetadata(namespace)
        if namespace is not None:
            self.informer(resource, namespace)
        self.informer(resource).add_handler(_Refetch(self, resource))

    def when_fetched(self, error: NotYetCached, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the fetch that ``error`` announced has ended (or at once if it has)."""
        partial = self._by_metadata[error.resource]
        if error.key in partial.pending:
            partial.waiters.setdefault(error.key, []).append(callback)
        else:
            callback()

    def informer(self, resource: Resource, namespace: str | None = None, *,
                 labels: Mapping[str, str] | None = None) -> Informer:
        """The informer for ``resource`` in that scope (created on first use, started if the cache runs)."""
        key = (resource, namespace, label_selector(labels))
        informer = self._informers.get(key)
        if informer is None:
            by_metadata = self._by_metadata.get(resource)
            lister: ListerWatcher = self.client
            if by_metadata is not None and namespace != by_metadata.namespace:
                lister = MetadataOnly(self.client)
            informer = Informer(lister, resource, namespace, labels=labels, clock=self._clock)
            self._informers[key] = informer
            if self._group is not None:
                self._group.create_task(informer.run(), name=f"informer {resource}")
        return informer

    def add_handler(self, resource: Resource, handler: EventHandler, namespace: str | None = None, *,
                    labels: Mapping[str, str] | None = None) -> None:
        self.informer(resource, namespace, labels=labels).add_handler(handler)

    def add_indexer(self, resource: Resource, name: str, func: IndexFunc) -> None:
        self.informer(resource).add_indexer(name, func)

    def observe(self, resource: Resource, obj: JSON) -> None:
        """Feed a write's answer to every informer of ``resource`` whose scope holds it."""
        by_metadata = self._by_metadata.get(resource)
        for (res, namespace, _), informer in self._informers.items():
            if res == resource:
                if by_metadata is not None and namespace != by_metadata.namespace:
                    informer.observe(metadata_of(obj))
                else:
                    informer.observe(obj)
        if by_metadata is not None:
            key = store_key(obj)
            current = by_metadata.bodies.get(key)
            if obj.get("metadata", {}).get("namespace") != by_metadata.namespace and (
                    current is None or newer(obj, current)):
                by_metadata.bodies[key] = obj

    async def run(self) -> None:
        """Run every informer until cancelled; informers added later join the same group."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            for (resource, _, _), informer in list(self._informers.items()):
                group.create_task(informer.run(), name=f"informer {resource}")
            try:
                await asyncio.Event().wait()
            finally:
                self._group = None

    async def wait_for_sync(self, timeout: float = DEFAULT_SYNC_TIMEOUT) -> None:
        """Return once every informer has listed; raise :class:`CacheSyncTimeout` after ``timeout`` s."""
        pending = [i for i in self._informers.values() if not i.synced]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(i.wait_synced() for i in pending))
        except TimeoutError:
            names = ", ".join(str(i.resource) for i in self._informers.values() if not i.synced)
            raise CacheSyncTimeout(f"caches not synced after {timeout:.0f}s: {names}") from None

    # -- the read API (Reader) ----------------------------------------------------------------

    def _get_raw(self, resource: Resource, name: str, namespace: str | None) -> JSON | None:
        key = f"{namespace}/{name}" if namespace and resource.namespaced else name
        by_metadata = self._by_metadata.get(resource)
        if by_metadata is not None:
            if namespace == by_metadata.namespace:
                return self._informers[(resource, namespace, None)].store.get(key)
            return self._body(resource, by_metadata, key, name, namespace)
        return self._reader(resource, namespace).store.get(key)

    def _body(self, resource: Resource, by_metadata: _ByMetadata, key: str, name: str,
              namespace: str | None) -> JSON | None:
        meta = self._informers[(resource, None, None)].store.get(key)
        if meta is None:
            return None
        body = by_metadata.bodies.get(key)
        if body is not None and newer(meta, body) is not True:
            return body
        self._fetch(resource, by_metadata, key, name, namespace)
        raise NotYetCached(resource, key)

    def _changed(self, resource: Resource, meta: JSON) -> None:
        by_metadata = self._by_metadata[resource]
        key = store_key(meta)
        body = by_metadata.bodies.get(key)
        if body is not None and newer(meta, body):
            self._fetch(resource, by_metadata, key, meta["metadata"]["name"], meta["metadata"].get("namespace"))

    def _fetch(self, resource: Resource, by_metadata: _ByMetadata, key: str, name: str,
               namespace: str | None) -> None:
        if key in by_metadata.pending:
            return
        getter: Getter = self.client  # type: ignore[assignment]  # the REST client and the fake's have get()

        async def fetch() -> None:
            failed = False
            try:
                obj = await getter.get(resource, name, namespace)
                current = by_metadata.bodies.get(key)
                if current is None or newer(obj, current) is not False:
                    by_metadata.bodies[key] = obj
            except NotFound:
                by_metadata.bodies.pop(key, None)
            except Exception as exc:
                failed = True
                log.warning("fetching a cached-by-metadata object failed", object=key, error=str(exc))
            finally:
                by_metadata.pending.pop(key, None)
            if failed:
                await asyncio.sleep(FETCH_RETRY_DELAY)
            for callback in by_metadata.waiters.pop(key, []):
                callback()

        by_metadata.pending[key] = asyncio.get_running_loop().create_task(fetch(), name=f"fetch {resource} {key}")

    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]:
        """(Of a kind cached by metadata, outside its namespace: the objects' metadata only.)"""
        by_metadata = self._by_metadata.get(resource)
        if by_metadata is not None and namespace is not None and namespace == by_metadata.namespace:
            store = self._informers[(resource, namespace, None)].store
        else:
            store = self._reader(resource, namespace).store
        if index is not None:
            items = store.by_index(*index)
            if namespace:
                items = [o for o in items if o.get("metadata", {}).get("namespace") == namespace]
            return items
        if namespace and resource.namespaced:
            return store.by_index(NAMESPACE_INDEX, namespace)
        return store.objects()

    def _typed(self, model: type[M], resource: Resource, obj: JSON) -> M:
        """``obj`` validated as ``model``, parsed once per resourceVersion (read-only, like the dict)."""
        key = (resource, store_key(obj))
        version = str(obj.get("metadata", {}).get("resourceVersion", ""))
        hit = self._parsed.get(key)
        if hit is not None and hit[0] == version and version and isinstance(hit[1], model):
            return hit[1]
        parsed = model.model_validate(obj)
        self._parsed[key] = (version, parsed)
        if len(self._parsed) > 2 * sum(len(i.store) for i in self._informers.values()) + 64:
            self._parsed = {k: v for k, v in self._parsed.items()
                            if any(r == k[0] and i.store.get(k[1]) is not None
                                   for (r, _, _), i in self._informers.items())}  # forget deleted objects
        return parsed

    def _reader(self, resource: Resource, namespace: str | None) -> Informer:
        informer = self._informers.get((resource, None, None)) or self._informers.get((resource, namespace, None))
        if informer is None:
            informer = next((i for (r, ns, _), i in self._informers.items()
                             if r == resource and ns in (None, namespace)), None)
        if informer is None:
            raise KeyError(f"no informer for {resource}: register it before reading")
        return informer
