from __future__ import annotations

from typing import Any

from tailnet_operator.runtime.controller import Request, owner_mapper, self_mapper
from tailnet_operator.runtime.controller.predicates import (
    AnnotationsChanged,
    FieldChanged,
    GenerationChanged,
    LabelsChanged,
    Matching,
    Not,
    all_of,
    any_of,
)
from tailnet_operator.runtime.kinds import NAMESPACE, Resource

WIDGET = Resource("test.tailnet.dev", "v1", "widgets", "Widget")


def obj(generation: int = 1, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "x", "namespace": "ns", "generation": generation, "labels": labels or {},
                         "annotations": annotations or {}, **meta}}


def test_generation_changed_passes_spec_updates_only() -> None:
    p = GenerationChanged()
    assert p.update(obj(1), obj(2))
    assert not p.update(obj(1), obj(1, labels={"a": "b"}))
    assert p.create(obj()) and p.delete(obj())


def test_label_and_annotation_predicates_and_combinators() -> None:
    labels, annotations = LabelsChanged(), AnnotationsChanged()
    relabelled = obj(1, labels={"team": "red"})
    assert labels.update(obj(), relabelled) and not annotations.update(obj(), relabelled)
    either = any_of(GenerationChanged(), labels)
    both = all_of(GenerationChanged(), labels)
    assert either.update(obj(), relabelled) and not both.update(obj(), relabelled)
    assert both.update(obj(1), obj(2, labels={"team": "red"}))
    assert Not(labels).update(obj(), obj(2))
    assert not Not(labels).create(obj())


def test_matching_judges_the_new_object() -> None:
    red = Matching(lambda o: o["metadata"]["labels"].get("team") == "red")
    assert red.update(obj(), obj(labels={"team": "red"}))
    assert not red.create(obj())


def test_owner_mapper_finds_the_controller_owner_of_the_right_kind() -> None:
    child = obj(ownerReferences=[
        {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "name": "w1", "uid": "1", "controller": True},
        {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "name": "w2", "uid": "2"},
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "3", "controller": True},
    ])
    assert owner_mapper(WIDGET)(child) == [Request("ns", "w1")]
    assert owner_mapper(WIDGET, only_controller=False)(child) == [Request("ns", "w1"), Request("ns", "w2")]
    assert self_mapper(child) == [Request("ns", "x")]


def test_a_cluster_scoped_owner_is_mapped_without_a_namespace() -> None:
    namespace_owned = obj(ownerReferences=[{"apiVersion": "v1", "kind": "Namespace", "name": "team-a",
                                            "uid": "1", "controller": True}])
    assert owner_mapper(NAMESPACE)(namespace_owned) == [Request("", "team-a")]


def test_field_changed_passes_updates_of_that_one_field() -> None:
    p = FieldChanged("status", "policy", "appliedHash")
    before = {**obj(), "status": {"policy": {"appliedHash": "a"}, "conditions": []}}
    assert not p.update(before, {**obj(), "status": {"policy": {"appliedHash": "a"}, "conditions": [{}]}})
    assert p.update(before, {**obj(), "status": {"policy": {"appliedHash": "b"}}})
    assert p.update(obj(), before), "appearing counts as a change"
    assert not p.update(obj(), {**obj(), "status": "not a mapping"})
    assert p.create(obj()) and p.delete(obj())
