"""Server-side apply field sets, the way reconcilers need them: "would this apply change anything?"

A field set is a set of *paths* in the notation of ``metadata.managedFields[].fieldsV1``:
``f:<name>`` for a map key, ``k:<json>`` for an item of a list keyed by ``LIST_MAP_KEYS``
(``conditions`` by ``type``, ``ownerReferences`` by ``uid``), ``v:<json>`` for a member of a
set-like list (``finalizers``). Any other list is atomic: one leaf.

:func:`needs_apply` is the runtime's desired-state comparison: an apply of ``desired`` by
``manager`` is needed only when a value it sends differs from the object, or when the object
still carries a field the manager owns and no longer sends (the apply would remove it). It
reads the cached object only, so a reconcile that finds nothing to change makes no request.
Limits: defaulting by the apiserver is not modelled, so send only fields you mean to own with
their final values (which is what server-side apply wants anyway).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tailnet_operator.types import JSON

__all__ = ["LIST_MAP_KEYS", "SET_LISTS", "Path", "fields_v1", "leaf_paths", "managed_paths", "needs_apply",
           "subset"]

Path = tuple[str, ...]

LIST_MAP_KEYS: dict[str, tuple[str, ...]] = {"conditions": ("type",), "ownerReferences": ("uid",)}
"""Lists merged by key (``x-kubernetes-list-type: map``) that the operator applies."""
SET_LISTS = frozenset({"finalizers"})
"""Lists merged as sets (``x-kubernetes-list-type: set``)."""

_IGNORED = frozenset({("f:apiVersion",), ("f:kind",), ("f:metadata", "f:name"), ("f:metadata", "f:namespace"),
                      ("f:metadata", "f:uid"), ("f:metadata", "f:resourceVersion")})
"""Identity, not content: part of every apply body, never 'owned' in a way that matters here."""


def item_key(name: str, item: Any) -> str | None:
    """``k:{...}`` or ``v:...`` for an item of list ``name``; None when the list is atomic."""
    if name in SET_LISTS:
        return "v:" + json.dumps(item, separators=(",", ":"))
    keys = LIST_MAP_KEYS.get(name)
    if keys is not None and isinstance(item, dict) and all(k in item for k in keys):
        return "k:" + json.dumps({k: item[k] for k in sorted(keys)}, separators=(",", ":"))
    return None


def leaf_paths(body: JSON, prefix: Path = ()) -> Iterator[Path]:
    """Every leaf path of ``body`` (an empty map is a leaf too)."""
    if not body:
        if prefix:
            yield prefix
        return
    for name, value in body.items():
        path = (*prefix, f"f:{name}")
        if isinstance(value, dict):
            yield from leaf_paths(value, path)
        elif isinstance(value, list) and value and all(item_key(name, i) for i in value):
            for item in value:
                key = item_key(name, item)
                assert key is not None
                if isinstance(item, dict):
                    yield from leaf_paths(item, (*path, key))
                else:
                    yield (*path, key)
        else:
            yield path


def fields_v1(paths: set[Path]) -> JSON:
    """The ``fieldsV1`` tree of a set of leaf paths (list-map items get their ``.`` entry)."""
    tree: JSON = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(part, {})
            if part.startswith("k:"):
                node.setdefault(".", {})
    return tree


def managed_paths(obj: JSON, manager: str, *, subresource: str = "") -> set[Path]:
    """The leaf paths ``manager`` owns on ``obj`` (from metadata.managedFields; Apply entries only)."""
    paths: set[Path] = set()
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if (entry.get("manager") == manager and entry.get("operation") == "Apply"
                and (entry.get("subresource") or "") == subresource):
            paths |= set(_tree_leaves(entry.get("fieldsV1") or {}, ()))
    return paths


def _tree_leaves(tree: JSON, prefix: Path) -> Iterator[Path]:
    children = {k: v for k, v in tree.items() if k != "."}
    if not children:
        if prefix:
            yield prefix
        return
    for name, sub in children.items():
        yield from _tree_leaves(sub if isinstance(sub, dict) else {}, (*prefix, name))


def subset(desired: Any, current: Any, name: str = "") -> bool:
    """Whether every value in ``desired`` is in ``current`` as server-side apply would merge it."""
    if isinstance(desired, dict):
        if not isinstance(current, dict):
            return False
        return all(subset(v, current.get(k), k) for k, v in desired.items())
    if isinstance(desired, list) and isinstance(current, list) and desired \
            and all(item_key(name, i) for i in desired):
        by_key = {item_key(name, i): i for i in current}
        return all(subset(i, by_key.get(item_key(name, i)), "") if isinstance(i, dict) else item_key(name, i) in by_key
                   for i in desired)
    return bool(desired == current)


def _value_at(body: JSON, path: Path) -> Any:
    node: Any = body
    for part in path:
        if not (part.startswith("f:") and isinstance(node, dict)):
            return None
        node = node.get(part[2:])
    return node


def needs_apply(desired: JSON, current: JSON | None, *, manager: str, subresource: str = "") -> bool:
    """Whether applying ``desired`` as ``manager`` would change ``current`` (None: not there yet).

    ``subresource="status"`` compares ``desired["status"]`` against the status fields the
    manager owns through the status subresource.
    """
    if current is None:
        return True
    desired = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}  # lists omit them
    if not subset(desired, current):
        return True
    sent = {p for p in leaf_paths(desired) if _value_at(desired, p) != {}}  # an empty map covers nothing
    for owned in managed_paths(current, manager, subresource=subresource) - _IGNORED:
        # Sent when a sent path lies under the owned one, or the owned one under a sent path (the
        # API server records some items as one atomic entry, e.g. an ownerReference by its uid).
        if not any(owned[: len(path)] == path or path[: len(owned)] == owned for path in sent):
            return True  # the manager owns a field it no longer sends: the apply removes it
    return False
