"""The shared cache: one informer per (resource, namespace, labels), shared by every controller.

Controllers ask for the informers they need before the cache starts (or after: a late
informer is started at once). Reconcilers read through :meth:`SharedCache.get` and
:meth:`SharedCache.list` (the :class:`~.interfaces.Reader` protocol), never from the API
server, so a reconcile that finds nothing to change makes no request at all. A model class
registered in the :class:`~.scheme.Scheme` reads as validated objects (parsed once per
resourceVersion); a :class:`~.kinds.Resource` reads as the raw, shared dicts.

An informer may be scoped to a namespace and to an equality label selector; a read is served
by the informer of all namespaces and no labels when there is one, otherwise by the scoped one
(which holds only the objects in its scope). Informers of one kind are separate watches, which
kube-apiserver answers in no particular order between them, so what one informer takes in (a watch
event, a list) goes at once into every other informer of the kind whose scope holds it, as a
write's answer does (:meth:`SharedCache.observe`), before any controller runs: a reconcile woken by
a scoped watch never reads an older version from the informer reads are served by. A deletion is
passed on only from an informer without a label selector; a label-selector watch reports an object
that leaves its scope as deleted too, so its deletions stay its own.

A kind can be cached *by metadata* (:meth:`SharedCache.cache_by_metadata`, for Secrets and
ConfigMaps, whose bodies in a big cluster would dominate the operator's memory): whole objects
in one namespace (the operator's), and elsewhere only each object's metadata, from a
metadata-only watch (controllers' watches and mappers see every change). A read of such an
object outside that namespace returns its body fetched once per resourceVersion; the first read
of a version not fetched yet raises :class:`NotYetCached` and starts the fetch, and the
controller retries the request when the body is in (no error, no backoff). So the cache holds
the bodies of the objects reconcilers read, and the names of the rest.

A kind can instead be cached *in some namespaces only* (:meth:`SharedCache.cache_in`): whole
objects there, and nothing listed or watched anywhere else, so the operator needs no
cluster-wide ``list``/``watch`` on it (a metadata-only watch needs them as much as a whole one).
A read outside those namespaces fetches the object with one GET: the first read raises
:class:`NotYetCached` as above, later reads return the last answer, and an answer older than
the refresh interval is fetched again in the background. A fetched answer that differs from the
previous one, and the answer of a write, reach the handlers added for all namespaces as an
informer's events would, so a controller hears of a change to an object it reads at the latest
when it next reads it. A refusal (403) reads as absent: the operator reads only where it was let
in, and a namespace that has not let it in holds nothing of its.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import structlog
from pydantic import BaseModel

from tailnet_operator.types import JSON

from ..client.interfaces import ListerWatcher
from ..clock import Clock, RealClock
from ..errors import Forbidden, NotFound
from ..kinds import Resource
from ..scheme import Scheme
from .informer import (
    NAMESPACE_INDEX,
    DeletedFinalStateUnknown,
    EventHandler,
    IndexFunc,
    Informer,
    MetadataOnly,
    label_selector,
    matches_labels,
    metadata_of,
    newer,
    store_key,
)
from .reading import TypedReader

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

FETCH_REFRESH = 10.0
"""Seconds a fetched answer of a kind cached in some namespaces is read without a new GET (then
it is still read, and fetched again in the background)."""
FETCH_FORGET = 600.0
"""Seconds after its last read that a fetched answer is dropped."""


@dataclass
class _ByMetadata:
    """The bodies fetched of one kind cached by metadata (outside ``namespace``), or cached in
    ``watched`` namespaces only (:meth:`SharedCache.cache_in`: outside them, by GET alone)."""

    namespace: str | None
    bodies: dict[str, JSON] = field(default_factory=dict)
    pending: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    waiters: dict[str, list[Callable[[], None]]] = field(default_factory=dict)
    watched: frozenset[str] | None = None
    """The namespaces cached whole (``cache_in``); None for a kind cached by metadata."""
    refresh: float = FETCH_REFRESH
    answered: dict[str, float] = field(default_factory=dict)
    """When the last answer for each key fetched came (``cache_in``; absent objects too)."""
    read: dict[str, float] = field(default_factory=dict)
    """When each fetched key was last read (``cache_in``)."""
    handlers: list[tuple[EventHandler, Mapping[str, str] | None]] = field(default_factory=list)
    """Told of changes to fetched objects (``cache_in``), with their label filter."""


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


class _Siblings:
    """Every informer's :attr:`~.informer.Informer.siblings`: what it takes in reaches the other
    informers of its kind at once (see the module doc)."""

    def __init__(self, cache: SharedCache, resource: Resource, informer: Informer) -> None:
        self._cache = cache
        self._resource = resource
        self._informer = informer

    def on_add(self, obj: JSON) -> None:
        self._cache._feed(self._resource, obj, source=self._informer)

    def on_update(self, old: JSON, new: JSON) -> None:
        self._cache._feed(self._resource, new, source=self._informer)

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        if not self._informer.labels:  # only a label-selector watch reports an object leaving it as deleted
            self._cache._share_deletion(self._resource, self._informer, obj)


InformerKey = tuple[Resource, str | None, str | None]
"""(resource, namespace or None for all, label selector or None for all)."""


class SharedCache(TypedReader):
    """Informers keyed by (resource, namespace, labels); ``namespace=None`` watches all namespaces."""

    def __init__(self, client: ListerWatcher, *, scheme: Scheme | None = None, clock: Clock | None = None) -> None:
        self.client = client
        self.scheme = scheme or Scheme()
        self._clock: Clock = clock or RealClock()
        self._informers: dict[InformerKey, Informer] = {}
        self._parsed: dict[tuple[Resource, str], tuple[str, BaseModel]] = {}
        self._group: asyncio.TaskGroup | None = None
        self._by_metadata: dict[Resource, _ByMetadata] = {}
        self._optional: set[Resource] = set()

    def tolerate_absent(self, resource: Resource) -> None:
        """Let ``resource`` be a kind the API may not serve (a CRD installed separately, such as the
        Gateway API's): until it is served its informers are synced and empty, and they list it
        again periodically (:attr:`~.informer.Informer.optional`). Call before its informers exist."""
        if any(r == resource for r, _, _ in self._informers):
            raise ValueError(f"{resource}: tolerate_absent() must come before its informers")
        self._optional.add(resource)

    def cache_by_metadata(self, resource: Resource, *, namespace: str | None) -> None:
        """Cache ``resource`` whole in ``namespace`` only and by metadata everywhere else (see
        the module doc). Call before any informer of ``resource`` exists."""
        if any(r == resource for r, _, _ in self._informers):
            raise ValueError(f"{resource}: cache_by_metadata() must come before its informers")
        self._by_metadata[resource] = _ByMetadata(namespace)
        if namespace is not None:
            self.informer(resource, namespace)
        self.informer(resource).add_handler(_Refetch(self, resource))

    def cache_in(self, resource: Resource, namespaces: Iterable[str], *, refresh: float = FETCH_REFRESH) -> None:
        """Cache ``resource`` whole in ``namespaces`` and list or watch it nowhere else; a read
        elsewhere fetches the object (see the module doc). Call before any informer of
        ``resource`` exists; an informer outside ``namespaces`` is refused afterwards."""
        if any(r == resource for r, _, _ in self._informers):
            raise ValueError(f"{resource}: cache_in() must come before its informers")
        watched = frozenset(namespaces)
        self._by_metadata[resource] = _ByMetadata(None, watched=watched, refresh=refresh)
        for namespace in sorted(watched):
            self.informer(resource, namespace)

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
            if by_metadata is not None and by_metadata.watched is not None and namespace not in by_metadata.watched:
                raise ValueError(f"{resource} is cached in {sorted(by_metadata.watched)} only: no informer "
                                 f"{'of all namespaces' if namespace is None else 'in ' + namespace}")
            lister: ListerWatcher = self.client
            if by_metadata is not None and by_metadata.watched is None and namespace != by_metadata.namespace:
                lister = MetadataOnly(self.client)
            informer = Informer(lister, resource, namespace, labels=labels, clock=self._clock,
                                optional=resource in self._optional)
            informer.siblings = _Siblings(self, resource, informer)
            self._informers[key] = informer
            if self._group is not None:
                self._group.create_task(informer.run(), name=f"informer {resource}")
        return informer

    def add_handler(self, resource: Resource, handler: EventHandler, namespace: str | None = None, *,
                    labels: Mapping[str, str] | None = None) -> None:
        """Tell ``handler`` of every change in that scope. Of a kind cached in some namespaces,
        all namespaces means the informers of those and the objects fetched elsewhere."""
        by_metadata = self._by_metadata.get(resource)
        if namespace is None and by_metadata is not None and by_metadata.watched is not None:
            for watched in sorted(by_metadata.watched):
                self.informer(resource, watched, labels=labels).add_handler(handler)
            by_metadata.handlers.append((handler, dict(labels) if labels else None))
            return
        self.informer(resource, namespace, labels=labels).add_handler(handler)

    def add_indexer(self, resource: Resource, name: str, func: IndexFunc) -> None:
        by_metadata = self._by_metadata.get(resource)
        if by_metadata is not None and by_metadata.watched is not None:
            for watched in sorted(by_metadata.watched):
                self.informer(resource, watched).add_indexer(name, func)
            return
        self.informer(resource).add_indexer(name, func)

    def observe(self, resource: Resource, obj: JSON) -> None:
        """Feed a write's answer to every informer of ``resource`` whose scope holds it."""
        self._feed(resource, obj)
        by_metadata = self._by_metadata.get(resource)
        if by_metadata is not None and by_metadata.watched is not None:
            if obj.get("metadata", {}).get("namespace") not in by_metadata.watched:
                self._answered(resource, by_metadata, store_key(obj), obj)
            return
        if by_metadata is not None:
            key = store_key(obj)
            current = by_metadata.bodies.get(key)
            if obj.get("metadata", {}).get("namespace") != by_metadata.namespace and (
                    current is None or newer(obj, current)):
                by_metadata.bodies[key] = obj

    def _feed(self, resource: Resource, obj: JSON, *, source: Informer | None = None) -> None:
        """Give ``obj`` to every informer of ``resource`` but ``source`` whose scope holds it: its
        metadata to a metadata-only informer, the object to the others (nothing from a metadata-only
        ``source`` to those)."""
        whole = source is None or not isinstance(source.client, MetadataOnly)
        for (res, _, _), informer in list(self._informers.items()):
            if res != resource or informer is source:
                continue
            if isinstance(informer.client, MetadataOnly):
                informer.observe(metadata_of(obj))
            elif whole:
                informer.observe(obj)

    def _share_deletion(self, resource: Resource, source: Informer, obj: JSON | DeletedFinalStateUnknown) -> None:
        for (res, _, _), informer in list(self._informers.items()):
            if res == resource and informer is not source:
                informer.forget(obj)

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
        if by_metadata is not None and by_metadata.watched is not None:
            if namespace in by_metadata.watched:
                return self._informers[(resource, namespace, None)].store.get(key)
            return self._fetched(resource, by_metadata, key, name, namespace)
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

    def _now(self) -> float:
        return self._clock.now()

    def _fetched(self, resource: Resource, by_metadata: _ByMetadata, key: str, name: str,
                 namespace: str | None) -> JSON | None:
        """The last answer fetched for an object outside the namespaces cached whole (see the
        module doc); NotYetCached before the first."""
        now = self._now()
        by_metadata.read[key] = now
        answered = by_metadata.answered.get(key)
        if answered is None or now - answered >= by_metadata.refresh:
            self._fetch(resource, by_metadata, key, name, namespace)
        if answered is None:
            raise NotYetCached(resource, key)
        return by_metadata.bodies.get(key)

    def _answered(self, resource: Resource, by_metadata: _ByMetadata, key: str, obj: JSON | None) -> None:
        """Record an answer for a fetched key (None: absent); tell the handlers when it differs
        from the previous answer."""
        known = key in by_metadata.answered
        before = by_metadata.bodies.get(key)
        if obj is not None and before is not None and newer(obj, before) is False:
            obj = before  # an observed write already newer than this answer
        by_metadata.answered[key] = self._now()
        by_metadata.read.setdefault(key, by_metadata.answered[key])
        if obj is None:
            by_metadata.bodies.pop(key, None)
        else:
            by_metadata.bodies[key] = obj
        if not known or before is obj:
            return
        version = (before or {}).get("metadata", {}).get("resourceVersion")
        if obj is not None and before is not None and obj.get("metadata", {}).get("resourceVersion") == version:
            return
        for handler, labels in list(by_metadata.handlers):
            try:
                if before is None and obj is not None:
                    if matches_labels(obj, labels):
                        handler.on_add(obj)
                elif obj is None and before is not None:
                    if matches_labels(before, labels):
                        handler.on_delete(before)
                elif obj is not None and before is not None and (matches_labels(obj, labels)
                                                                 or matches_labels(before, labels)):
                    handler.on_update(before, obj)
            except Exception:
                log.exception("event handler failed", resource=str(resource), object=key)

    def _forget_unread(self, by_metadata: _ByMetadata) -> None:
        """Drop the fetched answers nobody read for FETCH_FORGET seconds."""
        limit = self._now() - FETCH_FORGET
        for key in [k for k, at in by_metadata.read.items() if at < limit and k not in by_metadata.pending]:
            for table in (by_metadata.read, by_metadata.answered, by_metadata.bodies):
                table.pop(key, None)

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
        if by_metadata.watched is not None:
            self._forget_unread(by_metadata)

        async def fetch() -> None:
            failed = False
            try:
                obj = await getter.get(resource, name, namespace)
                if by_metadata.watched is not None:
                    self._answered(resource, by_metadata, key, obj)
                else:
                    current = by_metadata.bodies.get(key)
                    if current is None or newer(obj, current) is not False:
                        by_metadata.bodies[key] = obj
            except NotFound:
                if by_metadata.watched is not None:
                    self._answered(resource, by_metadata, key, None)
                else:
                    by_metadata.bodies.pop(key, None)
            except Forbidden as exc:
                if by_metadata.watched is None:
                    failed = True
                    log.warning("fetching a cached-by-metadata object failed", object=key, error=str(exc))
                else:
                    log.warning("may not read this object: it reads as absent", object=key, error=str(exc))
                    self._answered(resource, by_metadata, key, None)
            except Exception as exc:
                failed = True
                log.warning("fetching a cached-by-metadata object failed", object=key, error=str(exc))
            finally:
                by_metadata.pending.pop(key, None)
            if failed:
                await self._clock.sleep(FETCH_RETRY_DELAY)
            for callback in by_metadata.waiters.pop(key, []):
                callback()

        by_metadata.pending[key] = asyncio.get_running_loop().create_task(fetch(), name=f"fetch {resource} {key}")

    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]:
        """(Of a kind cached by metadata, outside its namespace: the objects' metadata only. Of a
        kind cached in some namespaces: those namespaces' objects; another namespace is a KeyError.)"""
        by_metadata = self._by_metadata.get(resource)
        if by_metadata is not None and by_metadata.watched is not None:
            if namespace is not None and namespace not in by_metadata.watched:
                raise KeyError(f"{resource} is not listed in {namespace}: cached in {sorted(by_metadata.watched)} only")
            stores = [self._informers[(resource, watched, None)].store for watched in sorted(by_metadata.watched)
                      if namespace in (None, watched)]
            return [obj for store in stores for obj in (store.by_index(*index) if index else store.objects())]
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
