"""Path routing as the Kubernetes Ingress defines it: pure, no I/O.

A host's routes (:class:`~tailnet_agent.contract.exposes.Route`) are matched against the request's
path without its query or fragment, as the client sent it (not percent-decoded):

* ``Exact`` matches the path exactly (``/foo`` does not match ``/foo/``);
* ``Prefix`` matches by path element: the path split on ``/``, empty elements ignored, must begin
  with the route's elements (``/foo`` and ``/foo/`` match ``/foo``, ``/foo/`` and ``/foo/bar``,
  never ``/foobar``; ``/`` matches every path).

Of the routes that match, the one with the longest path wins (counted in elements, then in
characters); of two with the same path, ``Exact`` before ``Prefix``; of routes still tied, the
first listed. None when no route matches: the caller decides (the expose's backend, or 404).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tailnet_agent.contract.exposes import EXACT, Route

__all__ = ["choose", "elements", "matches", "request_path"]


def request_path(target: str) -> str:
    """The path of a request target (``/a/b?q=1`` -> ``/a/b``); ``/`` for an empty one."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    return path or "/"


def elements(path: str) -> list[str]:
    """The path's elements: split on ``/``, empty ones dropped (``/a//b/`` -> ``["a", "b"]``)."""
    return [e for e in path.split("/") if e]


def matches(route: Route, path: str) -> bool:
    """Whether ``route`` matches the request path ``path`` (no query)."""
    return _matches(route, path, tuple(elements(path)))


def _matches(route: Route, path: str, parts: tuple[str, ...]) -> bool:
    if route.type == EXACT:
        return path == route.path
    want = _route_elements(route.path)
    return parts[:len(want)] == want


@functools.lru_cache(maxsize=4096)
def _route_elements(path: str) -> tuple[str, ...]:
    """A route's elements, split once per route path rather than once per request."""
    return tuple(elements(path))


def _rank(route: Route) -> tuple[int, int, bool]:
    return len(_route_elements(route.path)), len(route.path), route.type == EXACT


def choose(routes: Sequence[Route], target: str) -> Route | None:
    """The route a request for ``target`` (path, maybe with a query) goes to; None when none matches."""
    path = request_path(target)
    parts = tuple(elements(path))
    best: Route | None = None
    for route in routes:
        if _matches(route, path, parts) and (best is None or _rank(route) > _rank(best)):
            best = route
    return best
