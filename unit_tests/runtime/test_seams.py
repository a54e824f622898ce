"""The runtime's seams without a server: the fake client's SSA semantics, the Applier's comparison,
typed cache reads, write feedback into the cache, owner references and the controller builder."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from tailnet_operator import runtime as rt
from tailnet_operator.runtime.cache.informer import DeletedFinalStateUnknown
from tailnet_operator.runtime.controller import Controller
from tailnet_operator.runtime.testing import FakeClient

WIDGET = rt.Resource("test.tailnet.dev", "v1", "widgets", "Widget")
FINALIZER = "test.tailnet.dev/finalizer"


class Widget(BaseModel):
    model_config = ConfigDict(extra="allow")
    spec: dict[str, Any]


def widget(name: str = "w", value: str = "a") -> rt.JSON:
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"value": value}}


def status(**fields: Any) -> rt.JSON:
    return {"metadata": {"name": "w", "namespace": "ns"}, "status": fields}


async def test_fake_apply_bumps_resource_version_and_generation_only_on_change() -> None:
    fake = FakeClient()
    created = fake.add(WIDGET, widget())
    assert created["metadata"]["generation"] == 1 and created["metadata"]["resourceVersion"] == "1"
    same = await fake.apply(WIDGET, widget(), field_manager="m")
    changed = await fake.apply(WIDGET, widget(value="b"), field_manager="m")
    assert same["metadata"]["resourceVersion"] == "2"  # managedFields changed: m now owns spec.value
    assert changed["metadata"]["generation"] == 2 and changed["metadata"]["resourceVersion"] == "3"
    again = await fake.apply(WIDGET, widget(value="b"), field_manager="m")
    assert again["metadata"]["resourceVersion"] == "3"
    assert len(fake.writes) == 3, "a no-op apply is still a request"


async def test_fake_status_apply_merges_conditions_by_type_per_manager() -> None:
    fake = FakeClient()
    fake.add(WIDGET, widget())
    await fake.apply_status(WIDGET, status(conditions=[{"type": "Ready", "status": "True"}], note="x"),
                            field_manager="a")
    await fake.apply_status(WIDGET, status(conditions=[{"type": "Applied", "status": "True"}]), field_manager="b")
    obj = await fake.apply_status(WIDGET, status(conditions=[{"type": "Ready", "status": "False"}]),
                                  field_manager="a")
    assert obj["status"] == {"conditions": [{"type": "Ready", "status": "False"},
                                            {"type": "Applied", "status": "True"}]}, "a's note is removed"
    assert obj["metadata"]["generation"] == 1, "status does not move the generation"
    assert {(e["manager"], e["operation"], e.get("subresource", "")) for e in obj["metadata"]["managedFields"]} == {
        ("a", "Apply", "status"), ("b", "Apply", "status"), ("fake", "Update", "")}, "add() is a create by 'fake'"


async def test_fake_errors_and_finalizers() -> None:
    fake = FakeClient()
    with pytest.raises(rt.NotFound):
        await fake.apply_status(WIDGET, status(x=1))
    obj = fake.add(WIDGET, widget())
    with pytest.raises(rt.Conflict):
        await fake.delete(WIDGET, "w", "ns", uid="someone-else")
    await rt.add_finalizer(fake, WIDGET, obj, FINALIZER, field_manager="widget-finalizer")
    await fake.delete(WIDGET, "w", "ns")
    deleting = fake.get(WIDGET, "w", "ns")
    assert deleting is not None and deleting["metadata"]["deletionTimestamp"]
    await rt.remove_finalizer(fake, WIDGET, deleting, FINALIZER, field_manager="widget-finalizer")
    assert fake.get(WIDGET, "w", "ns") is None
    with pytest.raises(rt.Conflict):
        # the uid precondition: never recreated
        await rt.add_finalizer(fake, WIDGET, obj, FINALIZER, field_manager="widget-finalizer")


async def test_applier_writes_only_what_differs_including_fields_to_remove() -> None:
    fake = FakeClient()
    applier = rt.Applier(fake, fake, field_manager="m")
    cm = {"metadata": {"name": "c", "namespace": "ns", "labels": {"a": "1"}}, "data": {"k": "v"}}
    await applier.apply(rt.CONFIG_MAP, cm)
    await applier.apply(rt.CONFIG_MAP, cm)
    assert len(fake.writes) == 1 and applier.skipped == 1
    await applier.apply(rt.CONFIG_MAP, {"metadata": {"name": "c", "namespace": "ns"}, "data": {"k": "v"}})
    assert len(fake.writes) == 2, "dropping a label this manager owns is a change"
    stored = fake.get(rt.CONFIG_MAP, "c", "ns")
    assert stored is not None and "labels" not in stored["metadata"]
    fake.update(rt.CONFIG_MAP, {**stored, "data": {"k": "v", "other": "someone else's"}})
    await applier.apply(rt.CONFIG_MAP, {"metadata": {"name": "c", "namespace": "ns"}, "data": {"k": "v"}})
    assert len(fake.writes) == 2, "fields of other managers are not this manager's business"


def test_needs_apply_reads_managed_fields_as_the_apiserver_writes_them() -> None:
    current: rt.JSON = {"metadata": {"name": "c", "managedFields": [{
        "manager": "m", "operation": "Apply", "fieldsV1": {
            "f:metadata": {"f:ownerReferences": {'k:{"uid":"u1"}': {}}},  # an atomic item, as kube records it
            "f:data": {"f:k": {}, "f:old": {}}}}],
        "ownerReferences": [{"uid": "u1", "name": "o"}]}, "data": {"k": "v", "old": "x"}}
    desired: rt.JSON = {"metadata": {"name": "c", "ownerReferences": [{"uid": "u1", "name": "o"}]}, "data": {"k": "v"}}
    assert rt.needs_apply(desired, current, manager="m"), "data.old would be removed"
    assert not rt.needs_apply(desired, current, manager="other")
    desired["data"]["old"] = "x"
    assert not rt.needs_apply(desired, current, manager="m")


async def test_cache_reads_typed_objects_and_takes_a_write_answer_before_its_watch_event() -> None:
    fake = FakeClient()
    fake.add(WIDGET, widget())
    cache = rt.SharedCache(fake.lister_watcher, scheme=rt.Scheme({Widget: WIDGET}))
    events: list[str] = []

    class Handler:
        def on_add(self, obj: rt.JSON) -> None:
            events.append("add")

        def on_update(self, old: rt.JSON, new: rt.JSON) -> None:
            events.append(f"update {new['metadata']['resourceVersion']}")

        def on_delete(self, obj: rt.JSON | DeletedFinalStateUnknown) -> None:
            events.append("delete")

    cache.add_handler(WIDGET, Handler())
    task = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.wait_for_sync(), 5)
        typed = cache.get(Widget, "w", "ns")
        assert isinstance(typed, Widget) and typed.spec == {"value": "a"}
        assert cache.get(Widget, "w", "ns") is typed, "parsed once per resourceVersion"
        stored = await fake.apply(WIDGET, widget(value="b"), field_manager="m")
        cache.observe(WIDGET, stored)
        assert (cache.get(WIDGET, "w", "ns") or {})["spec"] == {"value": "b"}
        for _ in range(20):
            await asyncio.sleep(0)
        assert events == ["add", "update 2"], "the watch event of the same version adds nothing"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_informer_scoped_by_namespace_and_labels_holds_only_its_scope() -> None:
    fake = FakeClient()
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "mine", "namespace": "a", "labels": {"app": "x"}}})
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "other-label", "namespace": "a", "labels": {"app": "y"}}})
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "other-ns", "namespace": "b", "labels": {"app": "x"}}})
    cache = rt.SharedCache(fake.lister_watcher)
    informer = cache.informer(rt.CONFIG_MAP, "a", labels={"app": "x"})
    task = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.wait_for_sync(), 5)
        assert [o["metadata"]["name"] for o in cache.list(rt.CONFIG_MAP, "a")] == ["mine"]
        fake.add(rt.CONFIG_MAP, {"metadata": {"name": "later", "namespace": "a", "labels": {"app": "x"}}})
        fake.add(rt.CONFIG_MAP, {"metadata": {"name": "later-other", "namespace": "a"}})
        for _ in range(20):
            await asyncio.sleep(0)
        assert sorted(informer.store.object_keys()) == ["a/later", "a/mine"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_owner_reference_and_set_controller_reference() -> None:
    owner = {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "metadata": {"name": "w", "uid": "u1"}}
    assert rt.owner_reference(owner) == {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "name": "w",
                                         "uid": "u1", "controller": True, "blockOwnerDeletion": True}
    child = rt.set_controller_reference(owner, {"metadata": {"name": "c"}})
    assert rt.set_controller_reference(owner, child)["metadata"]["ownerReferences"] == [rt.owner_reference(owner)]
    other = {**owner, "metadata": {"name": "x", "uid": "u2"}}
    with pytest.raises(rt.AlreadyOwned):
        rt.set_controller_reference(other, child)
    with pytest.raises(ValueError, match=r"metadata\.uid"):
        rt.owner_reference({"apiVersion": "v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_owns_infers_the_owner_kind_from_for_and_the_default_worker_count() -> None:
    fake = FakeClient()
    cache = rt.SharedCache(fake.lister_watcher)

    class Nothing:
        async def reconcile(self, request: rt.Request) -> rt.Result:
            return rt.Result()

    controller = Controller("w", Nothing(), cache)
    with pytest.raises(ValueError, match="for_"):
        controller.owns(rt.CONFIG_MAP)
    controller.for_(WIDGET).owns(rt.CONFIG_MAP, namespace="ns", labels={"app": "w"})
    with pytest.raises(ValueError, match="already"):
        controller.for_(WIDGET)
    assert controller.options.workers == rt.DEFAULT_WORKERS > 1
    informer = cache.informer(rt.CONFIG_MAP, "ns", labels={"app": "w"})
    informer._upsert({"metadata": {"name": "c", "namespace": "ns", "resourceVersion": "1", "ownerReferences": [
        {"apiVersion": "test.tailnet.dev/v1", "kind": "Widget", "name": "w", "uid": "u", "controller": True}]}})
    assert controller.queue.len() == 1, "the owned ConfigMap woke its Widget"


def test_the_public_surface_is_complete_and_sorted() -> None:
    assert rt.__all__ == sorted(rt.__all__, key=lambda n: (not n.isupper(), n))
    for name in rt.__all__:
        assert hasattr(rt, name), name
    assert "FakeClient" not in rt.__all__ and not hasattr(rt, "FakeClient"), "test doubles live in runtime.testing"


def test_no_product_module_imports_the_testing_room() -> None:
    package = Path(rt.__file__).resolve().parents[1]
    testing = package / "runtime" / "testing"
    importers = []
    for path in sorted(package.rglob("*.py")):
        if testing in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(".testing" in name or name.startswith("testing") for name in names):
                importers.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not importers, f"the product imports its test doubles: {importers}"
