"""The controller builder refuses wrong arguments when the controller is set up, not on every event.

A predicate is only called when an event arrives, so a Resource given where a predicate belongs
(``owns(CONFIG_MAP, WIDGET)``, meaning the owner) used to be accepted and then fail in the
informer's handler on each event of that kind.
"""

from __future__ import annotations

from typing import Any

import pytest

from tailnet_operator import runtime as rt
from tailnet_operator.runtime.controller import Controller
from tailnet_operator.runtime.testing import FakeClient

WIDGET = rt.Resource("test.tailnet.dev", "v1", "widgets", "Widget")


class _Nothing:
    async def reconcile(self, request: rt.Request) -> rt.Result:
        return rt.Result()


def _controller() -> tuple[Controller, rt.SharedCache]:
    cache = rt.SharedCache(FakeClient().lister_watcher)
    return Controller("widget", _Nothing(), cache), cache


def _handlers(cache: rt.SharedCache, resource: rt.Resource) -> int:
    return len(cache.informer(resource)._handlers)


def test_a_resource_where_a_predicate_belongs_is_a_type_error_at_setup() -> None:
    controller, cache = _controller()
    controller.for_(WIDGET)
    bad: Any = WIDGET
    message = (r"owns\(configmaps.core/v1, \.\.\.\): predicate 1 is the Resource widgets.test.tailnet.dev/v1, "
               r"not a Predicate \(the owner kind goes in owner=")
    with pytest.raises(TypeError, match=message):
        controller.owns(rt.CONFIG_MAP, bad)
    assert _handlers(cache, rt.CONFIG_MAP) == 0, "nothing was registered"


@pytest.mark.parametrize("call", ["for_", "owns", "watches"])
def test_every_builder_method_checks_its_predicates(call: str) -> None:
    controller, _ = _controller()
    not_a_predicate: Any = lambda obj: True  # noqa: E731 (a function, not a Predicate)
    if call == "for_":
        with pytest.raises(TypeError, match=r"predicate 1 .* is not a Predicate: it has no create, update, delete"):
            controller.for_(WIDGET, not_a_predicate)
    elif call == "owns":
        with pytest.raises(TypeError, match="predicate 2"):
            controller.owns(rt.CONFIG_MAP, rt.GenerationChanged(), not_a_predicate, owner=WIDGET)
    else:
        with pytest.raises(TypeError, match="predicate 1"):
            controller.watches(rt.CONFIG_MAP, lambda obj: [], not_a_predicate)


def test_the_resource_owner_and_mapper_are_checked() -> None:
    controller, _ = _controller()
    kind: Any = "Widget"
    with pytest.raises(TypeError, match=r"for_\(\) takes a Resource first, not 'Widget'"):
        controller.for_(kind)
    with pytest.raises(TypeError, match=r"owns\(owner=\.\.\.\) takes a Resource"):
        controller.owns(rt.CONFIG_MAP, owner=kind)
    mapper: Any = WIDGET
    with pytest.raises(TypeError, match="the mapper must be a function"):
        controller.watches(rt.CONFIG_MAP, mapper)


def test_good_arguments_still_build() -> None:
    controller, cache = _controller()
    controller.for_(WIDGET, rt.GenerationChanged()).owns(rt.CONFIG_MAP, rt.LabelsChanged(), owner=WIDGET)
    controller.watches(rt.SECRET, lambda obj: [rt.Request("ns", "w")], rt.any_of(rt.GenerationChanged()))
    assert [_handlers(cache, r) for r in (WIDGET, rt.CONFIG_MAP, rt.SECRET)] == [1, 1, 1]
