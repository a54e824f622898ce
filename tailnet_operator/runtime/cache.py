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
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TypeVar

import structlog
from pydantic import BaseModel

from tailnet_operator.types import JSON

from .clock import Clock
from .informer import NAMESPACE_INDEX, EventHandler, IndexFunc, Informer, label_selector, store_key
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

    def informer(self, resource: Resource, namespace: str | None = None, *,
                 labels: Mapping[str, str] | None = None) -> Informer:
        """The informer for ``resource`` in that scope (created on first use, started if the cache runs)."""
        key = (resource, namespace, label_selector(labels))
        informer = self._informers.get(key)
        if informer is None:
            informer = Informer(self.client, resource, namespace, labels=labels, clock=self._clock)
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
        for (res, _, _), informer in self._informers.items():
            if res == resource:
                informer.observe(obj)

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
        return self._reader(resource, namespace).store.get(key)

    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]:
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
