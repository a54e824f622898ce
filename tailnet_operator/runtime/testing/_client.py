"""A fake API server in memory: a :class:`~..interfaces.Reader`, :class:`~..interfaces.Writer`
and :class:`~..interfaces.ListerWatcher` for reconciler unit tests (controller-runtime's fake client).

What it models, because reconcilers can observe it (each point is held to the real
kube-apiserver by ``e2e/test_fake_contract.py``):

* ``resourceVersion`` (one counter for all objects), ``uid``, ``creationTimestamp``, and
  ``generation``, bumped when anything but metadata and status changes (absent on the built-in
  kinds in :data:`NO_GENERATION`, as there); a write that changes nothing keeps the
  resourceVersion and sends no watch event;
* optimistic concurrency: a ``metadata.resourceVersion`` in an update or apply body, or a
  ``resource_version`` given to delete, must be the stored one, else :class:`~..errors.Conflict`;
  a ``metadata.uid`` in an apply body must be the stored object's (:class:`~..errors.Invalid` when
  another object holds the name, :class:`~..errors.Conflict` when none does);
* server-side apply with field ownership: each (field manager, operation, subresource) owns the
  fields it sent last; a field an applier stops sending is removed unless another manager also
  owns it; lists named in :data:`~..ssa.LIST_MAP_KEYS` merge by key and ``finalizers`` as a set,
  so two managers can each own their own conditions; ``managedFields`` is filled in as the API
  server does, with an ``Update`` entry for :meth:`FakeClient.add` and :meth:`FakeClient.update`
  (a create or a PUT: the manager owns what it set or changed, and takes it from others);
* the status subresource: a main apply ignores ``status``, a status apply only sets ``status``
  and needs the object to exist;
* deletion: delete sets ``deletionTimestamp`` (and moves the generation) while finalizers remain,
  and removing the last one deletes; once deletion has started no new finalizer may be added
  (:class:`~..errors.Invalid`, as the API server's metadata validation answers);
* list and watch through :attr:`FakeClient.lister_watcher`, so a real
  :class:`~..informer.Informer` or :class:`~..cache.SharedCache` can run on it. A watch from
  ``""`` or ``"0"`` starts with the objects as ADDED events; :meth:`FakeClient.compact` forgets
  the history, after which a watch from an older resourceVersion raises :class:`~..errors.Gone`
  (410), as kube-apiserver answers once etcd compacted or its watch cache dropped it.

What it does not model: defaulting, validation (but for the finalizer rule), admission, the
garbage collector and propagation policies, field selectors, which kinds have a status
subresource (every kind has one here; :meth:`FakeClient.update` replaces ``status`` too),
``managedFields`` times, and conflicts between managers (every apply is forced).
When a test depends on those, test against the real kube-apiserver (``e2e/``).

``writes`` records every write request that succeeded, as ``(verb, kind, name, subresource)``,
no-op applies included (as the API server's request counter would): tests assert "no write
when nothing changed" with it. Seeding with :meth:`FakeClient.add` and :meth:`FakeClient.update`
is not recorded.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from tailnet_operator.types import JSON

from ..cache.informer import matches_labels
from ..cache.reading import TypedReader
from ..client import WATCH_INACTIVITY_TIMEOUT, ObjectList, WatchEvent
from ..client.ssa import Path, fields_v1, item_key, leaf_paths
from ..clock import Clock, RealClock
from ..errors import AlreadyExists, Conflict, Gone, Invalid, NotFound
from ..kinds import Resource
from ..scheme import Scheme

__all__ = ["FakeClient"]

_SYSTEM_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields",
                    "deletionTimestamp", "deletionGracePeriodSeconds", "name", "namespace")

NO_GENERATION = frozenset({("", "ConfigMap"), ("", "Secret"), ("", "Service"), ("", "Namespace"), ("", "Event"),
                           ("", "ServiceAccount"), ("", "Endpoints"), ("coordination.k8s.io", "Lease"),
                           ("events.k8s.io", "Event")})
"""(group, kind) of built-in kinds whose API server strategy sets no ``metadata.generation``
(a ``GenerationChanged`` predicate never passes their updates); custom resources always have one."""

Key = tuple[Resource, str, str]
Owner = tuple[str, str, str]
"""(field manager, operation: ``Apply`` or ``Update``, subresource or ``""``): one managedFields entry."""


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
        self._objects: dict[Key, JSON] = {}
        self._owned: dict[Key, dict[Owner, set[Path]]] = {}
        self._indexers: dict[Resource, dict[str, Callable[[JSON], Iterable[str]]]] = {}
        self._version = 0
        self._compacted = 0
        self._events: list[tuple[int, Resource, WatchEvent]] = []
        self._changed = asyncio.Event()
        self.writes: list[tuple[str, str, str, str]] = []

    # -- seeding and inspection -----------------------------------------------------------------

    def add(self, resource: Resource, obj: JSON, *, field_manager: str | None = None) -> JSON:
        """Store ``obj`` as a user's create would (an ``Update`` entry for ``field_manager``, default
        the fake's); returns the stored object. ``status`` is kept, to seed it."""
        body = copy.deepcopy(obj)
        body.setdefault("apiVersion", resource.api_version)
        body.setdefault("kind", resource.kind)
        key = self._key(resource, body)
        if key in self._objects:
            raise AlreadyExists(409, "AlreadyExists", f"{_what(resource, key[2])} already exists")
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _rfc3339(self._clock))
        meta.pop("resourceVersion", None)
        _set_generation(resource, meta, None, body)
        self._owned[key] = {}
        self._took(key, (field_manager or self.field_manager, "Update", ""), {}, body)
        return self._commit(resource, key, None, body)

    def update(self, resource: Resource, obj: JSON, *, field_manager: str | None = None) -> JSON:
        """Replace an object as a user's PUT would: a ``metadata.resourceVersion`` in ``obj`` must be
        the stored one (:class:`~..errors.Conflict`); none means unconditional. Generation follows
        the spec; the manager (default the fake's) gets an ``Update`` entry for what it changed."""
        body = copy.deepcopy(obj)
        key = self._key(resource, body)
        current = self._existing(resource, key)
        meta = body.setdefault("metadata", {})
        self._check_resource_version(resource, key, meta, current)
        for field in ("uid", "creationTimestamp", "generation", "managedFields", "deletionTimestamp",
                      "deletionGracePeriodSeconds"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
            else:
                meta.pop(field, None)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        self._check_finalizers(resource, current, body)
        _set_generation(resource, meta, current, body)
        self._took(key, (field_manager or self.field_manager, "Update", ""), current, body)
        return self._commit(resource, key, current, body)

    def compact(self) -> None:
        """Forget the watch history before the current resourceVersion, as etcd's compaction at
        its current revision does: a watch must then start from that version or the one before
        (it asks for what follows); from an older one it raises :class:`~..errors.Gone` and an
        informer relists."""
        self._compacted = self._version
        self._events = [e for e in self._events if e[0] >= self._compacted]

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
        if want_uid and current is None:
            raise Conflict(409, "Conflict", f"{_what(resource, key[2])}: uid mismatch: the provided object "
                                            f"specified uid {want_uid}, and no existing object was found")
        if current is not None:
            if want_uid and current["metadata"]["uid"] != want_uid:
                raise _invalid(resource, key[2], "metadata.uid", "FieldValueInvalid",
                               f"Invalid value: {json.dumps(want_uid)}: field is immutable")
            self._check_resource_version(resource, key, body["metadata"], current)
        if subresource == "status":
            sent = {"status": body.get("status") or {}}
        else:
            sent = {k: v for k, v in body.items() if k not in ("status", "apiVersion", "kind")}
            sent["metadata"] = {k: v for k, v in body["metadata"].items() if k not in _SYSTEM_METADATA}
            if not sent["metadata"]:
                del sent["metadata"]
        sent_paths = set(leaf_paths(sent))
        owners = self._owned.setdefault(key, {})
        mine: Owner = (manager, "Apply", subresource or "")
        before = copy.deepcopy(current) if current is not None else None
        tree = _to_tree(copy.deepcopy(current) if current is not None else {
            "apiVersion": resource.api_version, "kind": resource.kind,
            "metadata": {k: v for k, v in body["metadata"].items() if k in ("name", "namespace")}})
        others = {p for m, paths in owners.items() if m != mine for p in paths}
        for path in owners.get(mine, set()) - sent_paths:
            if path not in others:
                _remove(tree, path)
        _merge(tree, _to_tree(sent))
        obj: JSON = _from_tree(tree)
        if current is not None:
            self._check_finalizers(resource, current, obj)
        for m, paths in owners.items():
            if m != mine:
                paths -= {p for p in sent_paths if _at(tree, p) != _at(_to_tree(before or {}), p)}
        owners[mine] = sent_paths
        meta = obj["metadata"]
        if current is None:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _rfc3339(self._clock)
        _set_generation(resource, meta, current, obj)
        self.writes.append(("apply", resource.kind, key[2], subresource or ""))
        return self._commit(resource, key, before, obj)

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        return await self.apply(resource, body, subresource="status", field_manager=field_manager)

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON:
        key = (resource, namespace or "" if resource.namespaced else "", name)
        current = self._existing(resource, key)
        meta = current["metadata"]
        if uid and meta["uid"] != uid:
            raise Conflict(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                                            f"UID in object meta: {meta['uid']}")
        if resource_version and meta["resourceVersion"] != resource_version:
            raise Conflict(409, "Conflict", f"Precondition failed: ResourceVersion in precondition: "
                                            f"{resource_version}, ResourceVersion in object meta: "
                                            f"{meta['resourceVersion']}")
        self.writes.append(("delete", resource.kind, name, ""))
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                obj = copy.deepcopy(current)
                obj["metadata"]["deletionTimestamp"] = _rfc3339(self._clock)
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                if "generation" in obj["metadata"]:  # so a GenerationChanged predicate passes the deletion
                    obj["metadata"]["generation"] += 1
                self._store(resource, key, obj, "MODIFIED")
                return obj
            return current
        self._delete(resource, key, current)
        return {"kind": "Status", "status": "Success"}

    # -- ListerWatcher --------------------------------------------------------------------------

    @property
    def lister_watcher(self) -> _ListerWatcher:
        """This fake as a :class:`~..interfaces.ListerWatcher` (``list`` here is the cache-style read)."""
        return _ListerWatcher(self)

    async def list_objects(self, resource: Resource, namespace: str | None = None, *,
                           label_selector: str | None = None) -> ObjectList:
        labels = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else None
        items = [resource.typed(copy.deepcopy(o)) for o in self._list_raw(resource, namespace, None)
                 if matches_labels(o, labels)]
        return ObjectList(items, str(self._version))

    async def watch_objects(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                            label_selector: str | None = None,
                            inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT) -> AsyncIterator[WatchEvent]:
        """Events after ``resource_version``; from ``""`` or ``"0"``, the current objects as ADDED first.

        Raises :class:`~..errors.Gone` when the history after ``resource_version`` was compacted.
        """
        labels = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else None
        if resource_version in ("", "0"):
            since = self._version
            for obj in self._list_raw(resource, namespace, None):
                if matches_labels(obj, labels):
                    yield WatchEvent("ADDED", copy.deepcopy(obj))
        else:
            since = int(resource_version)
        while True:
            if since + 1 < self._compacted:
                raise Gone(410, "Expired", "The resourceVersion for the provided watch is too old.")
            for version, res, event in list(self._events):
                meta = event.object.get("metadata", {})
                if (version > since and res == resource and (not namespace or meta.get("namespace") == namespace)
                        and matches_labels(event.object, labels)):
                    yield WatchEvent(event.type, copy.deepcopy(event.object))
                since = max(since, version)
            if self._version <= since:
                await self._changed.wait()

    # -- internals ------------------------------------------------------------------------------

    def _key(self, resource: Resource, body: JSON) -> Key:
        meta = body.get("metadata") or {}
        return resource, str(meta.get("namespace") or "") if resource.namespaced else "", str(meta["name"])

    def _existing(self, resource: Resource, key: Key) -> JSON:
        current = self._objects.get(key)
        if current is None:
            raise NotFound(404, "NotFound", f"{resource.kind} {key[2]} not found")
        return current

    @staticmethod
    def _check_resource_version(resource: Resource, key: Key, meta: JSON, current: JSON) -> None:
        """An update or apply that names a resourceVersion is conditional on it (optimistic lock)."""
        wanted = meta.get("resourceVersion")
        if wanted and str(wanted) != current["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", f"Operation cannot be fulfilled on {_what(resource, key[2])}: the object "
                                            "has been modified; please apply your changes to the latest version "
                                            "and try again")

    @staticmethod
    def _check_finalizers(resource: Resource, current: JSON, new: JSON) -> None:
        """Once deletion has started, the finalizers may only shrink (ValidateNoNewFinalizers)."""
        if not current["metadata"].get("deletionTimestamp"):
            return
        old = set(current["metadata"].get("finalizers") or [])
        extra = sorted(set(new.get("metadata", {}).get("finalizers") or []) - old)
        if extra:
            found = "[]string{" + ", ".join(json.dumps(f) for f in extra) + "}"
            raise _invalid(resource, str(current["metadata"]["name"]), "metadata.finalizers", "FieldValueForbidden",
                           f"Forbidden: no new finalizers can be added if the object is being deleted, "
                           f"found new finalizers {found}")

    def _took(self, key: Key, owner: Owner, before: JSON, after: JSON) -> None:
        """Ownership after an Update-operation write (create or PUT): ``owner`` gains the fields it
        set or changed, and the maps and lists it created (their ``.`` entry, which keeps its
        managedFields entry alive after an applier took every value), and every manager loses
        the changed and the removed ones."""
        old_tree, new_tree = _to_tree(_content(before)), _to_tree(_content(after))
        old_paths, new_paths = set(leaf_paths(_content(before))), set(leaf_paths(_content(after)))
        changed = {p for p in new_paths if _at(old_tree, p) != _at(new_tree, p)}
        removed = old_paths - new_paths
        old_maps, new_maps = _maps(old_tree), _maps(new_tree)
        changed |= new_maps - old_maps
        removed |= old_maps - new_maps
        owners = self._owned.setdefault(key, {})
        for other, paths in owners.items():
            paths -= removed | (changed if other != owner else set())
        owners[owner] = owners.get(owner, set()) | changed

    @staticmethod
    def _managed_fields(resource: Resource, owners: dict[Owner, set[Path]]) -> list[JSON]:
        return [{"manager": manager, "operation": operation, "apiVersion": resource.api_version,
                 "fieldsType": "FieldsV1", "fieldsV1": fields_v1(paths), **({"subresource": sub} if sub else {})}
                for (manager, operation, sub), paths in sorted(owners.items()) if paths]

    def _commit(self, resource: Resource, key: Key, before: JSON | None, obj: JSON) -> JSON:
        """Store the result of a write: nothing when it changes nothing (the API server skips the
        etcd write, so the resourceVersion stays), a deletion when the last finalizer went."""
        obj["metadata"]["managedFields"] = self._managed_fields(resource, self._owned.get(key, {}))
        if before is not None and _without_version(obj) == _without_version(before):
            return before
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            return self._delete(resource, key, obj)
        self._store(resource, key, obj, "ADDED" if before is None else "MODIFIED")
        return obj

    def _store(self, resource: Resource, key: Key, obj: JSON, event: str) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._objects[key] = obj
        self._notify(resource, WatchEvent(event, copy.deepcopy(obj)))

    def _delete(self, resource: Resource, key: Key, obj: JSON) -> JSON:
        self._objects.pop(key, None)
        self._owned.pop(key, None)
        self._version += 1
        final = copy.deepcopy(obj)
        final["metadata"]["resourceVersion"] = str(self._version)
        self._notify(resource, WatchEvent("DELETED", final))
        return copy.deepcopy(final)

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


def _set_generation(resource: Resource, meta: JSON, current: JSON | None, new: JSON) -> None:
    """1 on create, one more whenever the spec (anything but metadata and status) changes."""
    if (resource.group, resource.kind) in NO_GENERATION:
        meta.pop("generation", None)
    elif current is None:
        meta["generation"] = 1
    else:
        generation = int(current["metadata"].get("generation", 1))
        meta["generation"] = generation + 1 if _spec_of(new) != _spec_of(current) else generation


def _maps(tree: Any, prefix: Path = ()) -> set[Path]:
    """``(..., ".")`` for every non-empty map or list of a tree but ``metadata``: how an Update
    entry records that its manager created that map or list."""
    found: set[Path] = set()
    if not isinstance(tree, dict):
        return found
    for part, child in tree.items():
        path = (*prefix, part)
        if isinstance(child, dict) and child:
            if part.startswith("f:") and path != ("f:metadata",):
                found.add((*path, "."))
            found |= _maps(child, path)
    return found


def _content(obj: JSON) -> JSON:
    """What an Update-operation manager can own: the object but identity, system metadata and status."""
    content = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "status", "metadata")}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in _SYSTEM_METADATA}
    if meta:
        content["metadata"] = meta
    return content


def _what(resource: Resource, name: str) -> str:
    """How the API server names an object in messages: ``configmaps "x"``, ``widgets.example.dev "x"``."""
    plural = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
    return f'{plural} "{name}"'


def _invalid(resource: Resource, name: str, field: str, reason: str, detail: str) -> Invalid:
    """A 422 as the API server words it, with the field in ``causes``."""
    return Invalid(422, "Invalid", f'{resource.kind} "{name}" is invalid: {field}: {detail}',
                   details={"name": name, "kind": resource.plural,
                            "causes": [{"reason": reason, "message": detail, "field": field}]})
