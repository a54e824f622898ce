"""Predicates filter events before they become requests (they do not filter the cache).

Each predicate answers for create, update and delete. Create and delete pass unless a
predicate says otherwise; the "changed" predicates only judge updates, as in
controller-runtime's ``pkg/predicate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..client import JSON


class Predicate(Protocol):
    def create(self, obj: JSON) -> bool: ...

    def update(self, old: JSON, new: JSON) -> bool: ...

    def delete(self, obj: JSON) -> bool: ...


def _meta(obj: JSON, field: str) -> object:
    return obj.get("metadata", {}).get(field)


class _UpdateOnly:
    """Passes creates and deletes; subclasses judge updates by one metadata field."""

    field = ""

    def create(self, obj: JSON) -> bool:
        return True

    def delete(self, obj: JSON) -> bool:
        return True

    def update(self, old: JSON, new: JSON) -> bool:
        return _meta(old, self.field) != _meta(new, self.field)


class GenerationChanged(_UpdateOnly):
    """Updates pass only when ``metadata.generation`` changed (spec, not status or metadata)."""

    field = "generation"


class LabelsChanged(_UpdateOnly):
    field = "labels"


class AnnotationsChanged(_UpdateOnly):
    field = "annotations"


class FieldChanged(_UpdateOnly):
    """Updates pass only when the value at ``path`` (e.g. ``status.policy.appliedHash``) changed:
    for watchers that care about one part of another object's status, not every status write."""

    def __init__(self, *path: str) -> None:
        self.path = path

    def update(self, old: JSON, new: JSON) -> bool:
        return _at(old, self.path) != _at(new, self.path)


def _at(obj: JSON, path: tuple[str, ...]) -> object:
    value: object = obj
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


@dataclass(frozen=True)
class And:
    predicates: tuple[Predicate, ...]

    def create(self, obj: JSON) -> bool:
        return all(p.create(obj) for p in self.predicates)

    def update(self, old: JSON, new: JSON) -> bool:
        return all(p.update(old, new) for p in self.predicates)

    def delete(self, obj: JSON) -> bool:
        return all(p.delete(obj) for p in self.predicates)


@dataclass(frozen=True)
class Or:
    predicates: tuple[Predicate, ...]

    def create(self, obj: JSON) -> bool:
        return any(p.create(obj) for p in self.predicates)

    def update(self, old: JSON, new: JSON) -> bool:
        return any(p.update(old, new) for p in self.predicates)

    def delete(self, obj: JSON) -> bool:
        return any(p.delete(obj) for p in self.predicates)


@dataclass(frozen=True)
class Not:
    predicate: Predicate

    def create(self, obj: JSON) -> bool:
        return not self.predicate.create(obj)

    def update(self, old: JSON, new: JSON) -> bool:
        return not self.predicate.update(old, new)

    def delete(self, obj: JSON) -> bool:
        return not self.predicate.delete(obj)


@dataclass(frozen=True)
class Matching:
    """Passes objects for which ``func`` is true (judging the new object on update)."""

    func: Callable[[JSON], bool]

    def create(self, obj: JSON) -> bool:
        return self.func(obj)

    def update(self, old: JSON, new: JSON) -> bool:
        return self.func(new)

    def delete(self, obj: JSON) -> bool:
        return self.func(obj)


def all_of(*predicates: Predicate) -> And:
    return And(predicates)


def any_of(*predicates: Predicate) -> Or:
    return Or(predicates)
