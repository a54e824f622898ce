"""A fake API server in memory: a :class:`~.interfaces.Reader`, :class:`~.interfaces.Writer` and
:class:`~.interfaces.ListerWatcher` for reconciler unit tests (controller-runtime's fake client).

What it models, because reconcilers can observe it:

* ``resourceVersion`` (one counter for all objects), ``uid``, ``creationTimestamp``, and
  ``generation``, bumped when anything but metadata and status changes;
* server-side apply with field ownership: each (field manager, subresource) owns the fields it
  sent last; a field it stops sending is removed unless another manager also owns it; lists
  named in :data:`~.ssa.LIST_MAP_KEYS` merge by key and ``finalizers`` as a set, so two managers
  can each own their own conditions; ``managedFields`` is filled in as the API server does;
* the status subresource: a main apply ignores ``status``, a status apply only sets ``status``
  and needs the object to exist;
* :class:`~.errors.NotFound`, and :class:`~.errors.Conflict` for a failed uid or
  resourceVersion precondition;
* finalizers: delete sets ``deletionTimestamp`` while any remain; removing the last deletes;
* list and watch through :attr:`FakeClient.lister_watcher`, so a real
  :class:`~.informer.Informer` or :class:`~.cache.SharedCache` can run on it.

What it does not model: defaulting, validation, admission, the garbage collector, field
selectors, and conflicts between managers (every apply is forced). When a test depends on
those, test against the real kube-apiserver (``e2e/``).

``writes`` records every write request that succeeded, as ``(verb, kind, name, subresource)``,
no-op applies included (as the API server's request counter would): tests assert "no write
when nothing changed" with it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from tailnet_operator.types import JSON

from ..client import WATCH_INACTIVITY_TIMEOUT, ObjectList, WatchEvent
from ..clock import Clock, RealClock
from ..errors import Conflict, NotFound
from ..informer import matches_labels
from ..kinds import Resource
from ..reading import TypedReader
from ..scheme import Scheme
from ..ssa import Path, fields_v1, item_key, leaf_paths

__all__ = ["FakeClient"]

_SYSTEM_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields",
                    "deletionTimestamp", "name", "namespace")


class FakeClient(TypedReader):
    """Objects in memory, with the semantics listed in the module docstring.

    ``field_manager`` is used when a write names none (default ``"fake"``); ``clock`` stamps
    ``creationTimestamp`` and ``deletionTimestamp`` (default: the real wall clock).
    """

    def __init__(self, *, scheme: Scheme | None = None, field_manager: str = "fake",
                 clock: Clock | None = None) -> None:
        self.scheme = scheme or Scheme()
        self.field_manager = field_manager
        self._clock: Clock = clock or RealClock()
        self._objects: dict[tuple[Resource, str, str], JSON] = {}
        self._owned: dict[tuple[Resource, str, str], dict[tuple[str, str], set[Path]]] = {}
        self._indexers: dict[Resource, dict[str, Callable[[JSON], Iterable[str]]]] = {}
        self._version = 0
        self._events: list[tuple[int, Resource, WatchEvent]] = []
        self._changed = asyncio.Event()
        self.writes: list[tuple[str, str, str, str]] = []

    # -- seeding and inspection -----------------------------------------------------------------

    def add(self, resource: Resource, obj: JSON) -> JSON:
        """Store ``obj`` as if a user created it (no field manager); returns the stored object."""
        body = copy.deepcopy(obj)
        body.setdefault("apiVersion", resource.api_version)
        body.setdefault("kind", resource.kind)
        key = self._key(resource, body)
        if key in self._objects:
            raise Conflict(409, "AlreadyExists", f"{resource.kind} {key[2]} already exists")
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _rfc3339(self._clock))
        meta["generation"] = 1
        self._store(resource, key, body, "ADDED")
        return body

    def update(self, resource: Resource, obj: JSON) -> JSON:
        """Replace an object as a user would (PUT without a precondition); generation follows the spec."""
        body = copy.deepcopy(obj)
        key = self._key(resource, body)
        current = self._existing(resource, key)
        meta = body.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation", "managedFields", "deletionTimestamp"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        if _spec_of(body) != _spec_of(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        self._store(resource, key, body, "MODIFIED")
        return body

    def add_indexer(self, resource: Resource, name: str, func: Callable[[JSON], Iterable[str]]) -> None:
        self._indexers.setdefault(resource, {})[name] = func

    # -- Reader ---------------------------------------------------------------------------------

    def _get_raw(self, resource: Resource, name: str, namespace: str | None) -> JSON | None:
        return self._objects.get((resource, namespace or "" if resource.namespaced else "", name))

    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]:
        items = [o for (r, ns, _), o in sorted(self._objects.items(), key=lambda kv: kv[0][1:])
                 if r == resource and (not namespace or ns == namespace)]
        if index is not None:
            func = self._indexers.get(resource, {}).get(index[0])
            if func is None:
                raise KeyError(f"no indexer named {index[0]!r}")
            items = [o for o in items if index[1] in func(o)]
        return items

    # -- Writer ---------------------------------------------------------------------------------

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON:
        manager = field_manager or self.field_manager
        body = {"apiVersion": resource.api_version, "kind": resource.kind, **copy.deepcopy(body)}
        key = self._key(resource, body)
        current = self._objects.get(key)
        want_uid = body["metadata"].get("uid")
        if subresource == "status" and current is None:
            raise NotFound(404, "NotFound", f"{resource.kind} {key[2]} not found")
        if want_uid and (current is None or current["metadata"]["uid"] != want_uid):
            raise Conflict(409, "Conflict", f"Precondition failed: UID in precondition: {want_uid}")
        if subresource == "status":
            sent = {"status": body.get("status") or {}}
        else:
            sent = {k: v for k, v in body.items() if k not in ("status", "apiVersion", "kind")}
            sent["metadata"] = {k: v for k, v in body["metadata"].items() if k not in _SYSTEM_METADATA}
            if not sent["metadata"]:
                del sent["metadata"]
        sent_paths = set(leaf_paths(sent))
        owners = self._owned.setdefault(key, {})
        mine = (manager, subresource or "")
        before = copy.deepcopy(current) if current is not None else None
        tree = _to_tree(copy.deepcopy(current) if current is not None else {
            "apiVersion": resource.api_version, "kind": resource.kind,
            "metadata": {k: v for k, v in body["metadata"].items() if k in ("name", "namespace")}})
        others = {p for m, paths in owners.items() if m != mine for p in paths}
        for path in owners.get(mine, set()) - sent_paths:
            if path not in others:
                _remove(tree, path)
        _merge(tree, _to_tree(sent))
        for m, paths in owners.items():
            if m != mine:
                paths -= {p for p in sent_paths if _at(tree, p) != _at(_to_tree(before or {}), p)}
        owners[mine] = sent_paths
        obj: JSON = _from_tree(tree)
        meta = obj["metadata"]
        if current is None:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _rfc3339(self._clock)
            meta["generation"] = 1
        elif _spec_of(obj) != _spec_of(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        meta["managedFields"] = [
            {"manager": m, "operation": "Apply", "apiVersion": resource.api_version, "fieldsType": "FieldsV1",
             "fieldsV1": fields_v1(paths), **({"subresource": sub} if sub else {})}
            for (m, sub), paths in sorted(owners.items()) if paths]
        self.writes.append(("apply", resource.kind, key[2], subresource or ""))
        if before is not None and _without_version(obj) == _without_version(before):
            return before  # a no-op apply is a request, but changes nothing, not even the resourceVersion
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._delete(resource, key, obj)
            return obj
        self._store(resource, key, obj, "ADDED" if current is None else "MODIFIED")
        return obj

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        return await self.apply(resource, body, subresource="status", field_manager=field_manager)

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON:
        key = (resource, namespace or "" if resource.namespaced else "", name)
        current = self._existing(resource, key)
        meta = current["metadata"]
        if (uid and meta["uid"] != uid) or (resource_version and meta["resourceVersion"] != resource_version):
            raise Conflict(409, "Conflict", f"Precondition failed for {resource.kind} {name}")
        self.writes.append(("delete", resource.kind, name, ""))
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                obj = copy.deepcopy(current)
                obj["metadata"]["deletionTimestamp"] = _rfc3339(self._clock)
                self._store(resource, key, obj, "MODIFIED")
                return obj
            return current
        self._delete(resource, key, current)
        return {"kind": "Status", "status": "Success"}

    # -- ListerWatcher --------------------------------------------------------------------------

    @property
    def lister_watcher(self) -> _ListerWatcher:
        """This fake as a :class:`~.interfaces.ListerWatcher` (``list`` here is the cache-style read)."""
        return _ListerWatcher(self)

    async def list_objects(self, resource: Resource, namespace: str | None = None, *,
                           label_selector: str | None = None) -> ObjectList:
        labels = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else None
        items = [copy.deepcopy(o) for o in self._list_raw(resource, namespace, None) if matches_labels(o, labels)]
        return ObjectList(items, str(self._version))

    async def watch_objects(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None,
                    inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        labels = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else None
        since = int(resource_version or 0)
        while True:
            for version, res, event in list(self._events):
                meta = event.object.get("metadata", {})
                if (version > since and res == resource and (not namespace or meta.get("namespace") == namespace)
                        and matches_labels(event.object, labels)):
                    yield WatchEvent(event.type, copy.deepcopy(event.object))
                since = max(since, version)
            if self._version <= since:
                await self._changed.wait()

    # -- internals ------------------------------------------------------------------------------

    def _key(self, resource: Resource, body: JSON) -> tuple[Resource, str, str]:
        meta = body.get("metadata") or {}
        return resource, str(meta.get("namespace") or "") if resource.namespaced else "", str(meta["name"])

    def _existing(self, resource: Resource, key: tuple[Resource, str, str]) -> JSON:
        current = self._objects.get(key)
        if current is None:
            raise NotFound(404, "NotFound", f"{resource.kind} {key[2]} not found")
        return current

    def _store(self, resource: Resource, key: tuple[Resource, str, str], obj: JSON, event: str) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._objects[key] = obj
        self._notify(resource, WatchEvent(event, copy.deepcopy(obj)))

    def _delete(self, resource: Resource, key: tuple[Resource, str, str], obj: JSON) -> None:
        self._objects.pop(key, None)
        self._owned.pop(key, None)
        self._version += 1
        final = copy.deepcopy(obj)
        final["metadata"]["resourceVersion"] = str(self._version)
        self._notify(resource, WatchEvent("DELETED", final))

    def _notify(self, resource: Resource, event: WatchEvent) -> None:
        self._events.append((self._version, resource, event))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every watcher; later ones wait on the new event


class _ListerWatcher:
    def __init__(self, fake: FakeClient) -> None:
        self._fake = fake

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON:
        obj = self._fake._get_raw(resource, name, namespace)
        if obj is None:
            raise NotFound(404, "NotFound", f"{resource.kind} {name} not found")
        return copy.deepcopy(obj)

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None) -> ObjectList:
        return await self._fake.list_objects(resource, namespace, label_selector=label_selector)

    def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
              label_selector: str | None = None,
              inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        return self._fake.watch_objects(resource, namespace, resource_version=resource_version,
                                        label_selector=label_selector, inactivity_timeout=inactivity_timeout)


# -- the tree view of an object: list-maps and sets become maps keyed like fieldsV1 ---------------------


def _to_tree(value: Any, name: str = "") -> Any:
    if isinstance(value, dict):
        return {f"f:{k}": _to_tree(v, k) for k, v in value.items()}
    if isinstance(value, list) and value and all(item_key(name, i) for i in value):
        return {item_key(name, i): (_to_tree(i) if isinstance(i, dict) else True) for i in value}
    return value


def _from_tree(tree: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    if tree and all(k.startswith("v:") for k in tree):
        return [json.loads(k[2:]) for k in tree]
    if tree and all(k.startswith("k:") for k in tree):
        return [_from_tree(v) for v in tree.values()]
    return {k[2:]: _from_tree(v) for k, v in tree.items()}


def _at(tree: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _remove(tree: Any, path: Path) -> None:
    parents = []
    node = tree
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        parents.append((node, part))
        node = node[part]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    for parent, part in reversed(parents):  # drop list-map items whose key went, and empty maps
        child = parent[part]
        keyless = part.startswith("k:") and not all(f"f:{k}" in child for k in json.loads(part[2:]))
        empty = isinstance(child, dict) and not child and not part.startswith("f:metadata")
        if keyless or empty:
            del parent[part]


def _merge(into: Any, tree: Any) -> None:
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and value:
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _spec_of(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _without_version(obj: JSON) -> JSON:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


def _rfc3339(clock: Clock) -> str:
    return clock.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
