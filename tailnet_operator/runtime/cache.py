"""The shared cache: one informer per (resource, namespace), shared by every controller.

Controllers ask for the informers they need before the cache starts (or after: a late
informer is started at once). Reconcilers read through :meth:`SharedCache.get` and
:meth:`SharedCache.list`, never from the API server, so a reconcile that finds nothing to
change makes no request at all.
"""

from __future__ import annotations

import asyncio

import structlog

from .client import JSON, Client
from .informer import NAMESPACE_INDEX, EventHandler, IndexFunc, Informer
from .kinds import Resource

log = structlog.get_logger("cache")

DEFAULT_SYNC_TIMEOUT = 120.0
"""Seconds ``wait_for_sync`` waits by default (controller-runtime's CacheSyncTimeout)."""


class CacheSyncTimeout(TimeoutError):
    """An informer did not finish its first list in time; names the resources."""


class SharedCache:
    """Informers keyed by (resource, namespace); ``namespace=None`` watches all namespaces."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._informers: dict[tuple[Resource, str | None], Informer] = {}
        self._group: asyncio.TaskGroup | None = None

    def informer(self, resource: Resource, namespace: str | None = None) -> Informer:
        """The informer for ``resource`` (created on first use, started if the cache runs)."""
        key = (resource, namespace)
        informer = self._informers.get(key)
        if informer is None:
            informer = Informer(self.client, resource, namespace)
            self._informers[key] = informer
            if self._group is not None:
                self._group.create_task(informer.run(), name=f"informer {resource}")
        return informer

    def add_handler(self, resource: Resource, handler: EventHandler, namespace: str | None = None) -> None:
        self.informer(resource, namespace).add_handler(handler)

    def add_indexer(self, resource: Resource, name: str, func: IndexFunc) -> None:
        self.informer(resource).add_indexer(name, func)

    async def run(self) -> None:
        """Run every informer until cancelled; informers added later join the same group."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            for (resource, _), informer in list(self._informers.items()):
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

    # -- the read API -------------------------------------------------------------------------

    def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON | None:
        """The cached object, or None. Reads the all-namespaces informer unless only a namespaced one exists."""
        key = f"{namespace}/{name}" if namespace and resource.namespaced else name
        return self._reader(resource, namespace).store.get(key)

    def list(self, resource: Resource, namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[JSON]:
        """Cached objects, optionally of one namespace or under one ``(indexer, value)``."""
        store = self._reader(resource, namespace).store
        if index is not None:
            items = store.by_index(*index)
            if namespace:
                items = [o for o in items if o.get("metadata", {}).get("namespace") == namespace]
            return items
        if namespace and resource.namespaced:
            return store.by_index(NAMESPACE_INDEX, namespace)
        return store.objects()

    def _reader(self, resource: Resource, namespace: str | None) -> Informer:
        informer = self._informers.get((resource, None)) or self._informers.get((resource, namespace))
        if informer is None:
            raise KeyError(f"no informer for {resource}: register it before reading")
        return informer
