"""The scheme: which pydantic model a kind is read as (controller-runtime's ``runtime.Scheme``).

Readers (the cache, the fake client) take a model class where they take a
:class:`~.kinds.Resource` and return validated objects: ``cache.get(Tailnet, name)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel

from .kinds import Resource

__all__ = ["Scheme"]

M = TypeVar("M", bound=BaseModel)


class Scheme:
    """An immutable map between model classes and resources; ``Scheme()`` knows no models."""

    def __init__(self, models: Mapping[type[BaseModel], Resource] | None = None) -> None:
        self._resources: dict[type[BaseModel], Resource] = dict(models or {})

    def with_models(self, models: Mapping[type[BaseModel], Resource]) -> Scheme:
        """A new scheme that knows ``models`` too."""
        return Scheme({**self._resources, **models})

    def resource(self, model: type[BaseModel]) -> Resource:
        """The resource ``model`` is read from; KeyError names the model when it is not registered."""
        try:
            return self._resources[model]
        except KeyError:
            raise KeyError(f"{model.__name__} is not registered in the scheme") from None

    def __contains__(self, model: object) -> bool:
        return model in self._resources
