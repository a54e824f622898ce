"""The typed half of every :class:`~.interfaces.Reader`: a model class in, validated objects out.

Implementations (the shared cache, the fake client) supply raw lookups; this base adds the
overloads that accept a model registered in the :class:`~.scheme.Scheme`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar, overload

from pydantic import BaseModel

from tailnet_operator.types import JSON

from ..kinds import Resource
from ..scheme import Scheme

__all__ = ["TypedReader"]

M = TypeVar("M", bound=BaseModel)


class TypedReader(ABC):
    """``get``/``list`` by :class:`~.kinds.Resource` (raw dicts) or by model class (validated)."""

    scheme: Scheme

    @abstractmethod
    def _get_raw(self, resource: Resource, name: str, namespace: str | None) -> JSON | None: ...

    @abstractmethod
    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]: ...

    def _typed(self, model: type[M], resource: Resource, obj: JSON) -> M:
        """``obj`` validated as ``model``; implementations may cache the result."""
        return model.model_validate(obj)

    @overload
    def get(self, kind: type[M], name: str, namespace: str | None = None) -> M | None: ...

    @overload
    def get(self, kind: Resource, name: str, namespace: str | None = None) -> JSON | None: ...

    def get(self, kind: type[M] | Resource, name: str, namespace: str | None = None) -> M | JSON | None:
        """The object, or None. A model class returns it validated (``ValidationError`` if it does not parse)."""
        resource = kind if isinstance(kind, Resource) else self.scheme.resource(kind)
        obj = self._get_raw(resource, name, namespace)
        if obj is None or isinstance(kind, Resource):
            return obj
        return self._typed(kind, resource, obj)

    @overload
    def list(self, kind: type[M], namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[M]: ...

    @overload
    def list(self, kind: Resource, namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[JSON]: ...

    def list(self, kind: type[M] | Resource, namespace: str | None = None, *,
             index: tuple[str, str] | None = None) -> list[M] | list[JSON]:
        """Objects, optionally of one namespace or filed under one ``(indexer, value)``."""
        resource = kind if isinstance(kind, Resource) else self.scheme.resource(kind)
        items = self._list_raw(resource, namespace, index)
        if isinstance(kind, Resource):
            return items
        return [self._typed(kind, resource, obj) for obj in items]
