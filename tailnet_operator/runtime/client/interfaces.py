"""The seams between reconcilers and Kubernetes: what a reconciler reads with, writes with, and
what an informer lists and watches with.

=================  =========================================  ==============================
protocol           production                                 tests
=================  =========================================  ==============================
:class:`Reader`    :class:`~.cache.SharedCache` (the cache)   :class:`~.testing.FakeClient`
:class:`Writer`    :class:`~.client.Client` (or an Applier)   :class:`~.testing.FakeClient`
ListerWatcher      :class:`~.client.Client`                   :class:`~.testing.FakeClient`
=================  =========================================  ==============================

Reads come from the cache, never from the API server. ``get``/``list`` take either a
:class:`~.kinds.Resource` (the raw object, a shared dict to treat as read-only) or a pydantic
model registered in the :class:`~.scheme.Scheme` (the validated object; ``ValidationError``
when the stored object does not parse).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, TypeVar, overload

from pydantic import BaseModel

from tailnet_operator.types import JSON

from ..kinds import Resource
from . import WATCH_INACTIVITY_TIMEOUT, ObjectList, WatchEvent

__all__ = ["ListerWatcher", "Reader", "Writer"]

M = TypeVar("M", bound=BaseModel)


class Reader(Protocol):
    """Get and list from a cache of the cluster (controller-runtime's ``client.Reader``)."""

    @overload
    def get(self, kind: type[M], name: str, namespace: str | None = None) -> M | None: ...

    @overload
    def get(self, kind: Resource, name: str, namespace: str | None = None) -> JSON | None: ...

    def get(self, kind: type[M] | Resource, name: str, namespace: str | None = None) -> M | JSON | None:
        """The object, or None when it is not there."""
        ...

    @overload
    def list(self, kind: type[M], namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[M]: ...

    @overload
    def list(self, kind: Resource, namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[JSON]: ...

    def list(self, kind: type[M] | Resource, namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[M] | list[JSON]:
        """Objects, optionally of one namespace or filed under one ``(indexer, value)``."""
        ...


class Writer(Protocol):
    """Server-side apply and delete (controller-runtime's ``client.Writer``, SSA-only).

    ``field_manager`` None means the writer's own manager; each controller has one.
    Every method returns what the API server stored.
    """

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON: ...

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON: ...

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON: ...


class ListerWatcher(Protocol):
    """What an informer needs: a (paged) list and a watch from a resourceVersion."""

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None) -> ObjectList: ...

    def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
              label_selector: str | None = None,
              inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]: ...
