"""The fake client answers as kube-apiserver does where the two used to differ: stale
resourceVersions conflict, creates and updates record their field manager, no new finalizer
once deletion started, and a watch from compacted history is Gone. The same behaviours are
checked against the real API server by ``e2e/test_fake_contract.py``."""

from __future__ import annotations

import asyncio

import pytest

from tailnet_operator import runtime as rt
from tailnet_operator.runtime.errors import Gone
from tailnet_operator.runtime.testing import FakeClient

WIDGET = rt.Resource("test.tailnet.dev", "v1", "widgets", "Widget")


def widget(value: str = "a", **meta: object) -> rt.JSON:
    return {"metadata": {"name": "w", "namespace": "ns", **meta}, "spec": {"value": value}}


def managers(obj: rt.JSON) -> set[tuple[str, str]]:
    return {(e["manager"], e["operation"]) for e in obj["metadata"].get("managedFields") or []}


async def test_a_stale_resource_version_conflicts_on_update_apply_and_delete() -> None:
    fake = FakeClient()
    stale = fake.add(WIDGET, widget())
    fresh = fake.update(WIDGET, {**stale, "spec": {"value": "b"}})
    assert fresh["metadata"]["resourceVersion"] != stale["metadata"]["resourceVersion"]
    with pytest.raises(rt.Conflict, match="the object has been modified"):
        fake.update(WIDGET, {**stale, "spec": {"value": "c"}})
    with pytest.raises(rt.Conflict, match="the object has been modified"):
        await fake.apply(WIDGET, widget("c", resourceVersion=stale["metadata"]["resourceVersion"]), field_manager="m")
    with pytest.raises(rt.Conflict, match="Precondition failed"):
        await fake.delete(WIDGET, "w", "ns", resource_version=stale["metadata"]["resourceVersion"])
    applied = await fake.apply(WIDGET, widget("c", resourceVersion=fresh["metadata"]["resourceVersion"]),
                               field_manager="m")
    assert applied["spec"] == {"value": "c"}
    unconditional = fake.update(WIDGET, {"metadata": {"name": "w", "namespace": "ns"}, "spec": {"value": "d"}})
    assert unconditional["spec"] == {"value": "d"}, "no resourceVersion: no precondition"


async def test_create_and_update_record_their_field_manager_and_take_the_fields_they_change() -> None:
    fake = FakeClient(field_manager="user")
    created = fake.add(WIDGET, widget(labels={"team": "x"}))
    assert managers(created) == {("user", "Update")}
    assert created["metadata"]["managedFields"][0]["fieldsV1"] == {
        "f:metadata": {"f:labels": {".": {}, "f:team": {}}}, "f:spec": {".": {}, "f:value": {}}}
    applied = await fake.apply(WIDGET, widget("b"), field_manager="ctrl")
    assert managers(applied) == {("user", "Update"), ("ctrl", "Apply")}, "user still owns the label"
    edited = fake.update(WIDGET, {**applied, "spec": {"value": "mine"}}, field_manager="editor")
    assert managers(edited) == {("user", "Update"), ("editor", "Update")}, "the PUT took spec.value from ctrl"
    again = await fake.apply(WIDGET, widget("b"), field_manager="ctrl")
    assert again["spec"] == {"value": "b"} and managers(again) == {("user", "Update"), ("ctrl", "Apply")}
    unlabelled = {k: v for k, v in again["metadata"].items() if k != "labels"}
    bare = fake.update(WIDGET, {**again, "metadata": unlabelled, "spec": {}})
    assert managers(bare) == {("user", "Update")} and bare["metadata"]["managedFields"][0]["fieldsV1"] == {
        "f:spec": {}}, "the PUT removed the labels and spec.value: every other entry went empty"


def test_a_put_that_changes_nothing_keeps_the_resource_version() -> None:
    fake = FakeClient()
    created = fake.add(WIDGET, widget())
    same = fake.update(WIDGET, created)
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


async def test_no_new_finalizer_once_deletion_started() -> None:
    fake = FakeClient()
    obj = fake.add(WIDGET, widget())
    await rt.add_finalizer(fake, WIDGET, obj, "a.example/one", field_manager="one")
    deleting = await fake.delete(WIDGET, "w", "ns")
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["generation"] == 2
    with pytest.raises(rt.Invalid, match="no new finalizers can be added if the object is being deleted") as refused:
        await rt.add_finalizer(fake, WIDGET, deleting, "b.example/two", field_manager="other")
    assert refused.value.status == 422 and refused.value.causes[0]["field"] == "metadata.finalizers"
    with pytest.raises(rt.Invalid):
        fake.update(WIDGET, {**deleting, "metadata": {**deleting["metadata"], "finalizers": ["a.example/one", "c"]}})
    again = await fake.delete(WIDGET, "w", "ns")
    assert again["metadata"]["resourceVersion"] == deleting["metadata"]["resourceVersion"]
    await rt.remove_finalizer(fake, WIDGET, deleting, "a.example/one", field_manager="one")
    assert fake.get(WIDGET, "w", "ns") is None


async def test_an_apply_with_another_objects_uid_is_invalid_and_with_a_gone_ones_a_conflict() -> None:
    fake = FakeClient()
    fake.add(WIDGET, widget())
    with pytest.raises(rt.Invalid, match=r"metadata\.uid"):
        await fake.apply(WIDGET, widget(uid="not-this-one"), field_manager="m")
    with pytest.raises(rt.Conflict, match="uid mismatch"):
        await fake.apply(WIDGET, {**widget(uid="u"), "metadata": {"name": "gone", "namespace": "ns", "uid": "u"}},
                         field_manager="m")


async def test_a_watch_from_compacted_history_is_gone_and_from_now_sees_what_follows() -> None:
    fake = FakeClient()
    old = fake.add(rt.CONFIG_MAP, {"metadata": {"name": "a", "namespace": "ns"}})
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "b", "namespace": "ns"}})
    events = fake.lister_watcher.watch(rt.CONFIG_MAP, "ns", resource_version=old["metadata"]["resourceVersion"])
    assert (await anext(events)).object["metadata"]["name"] == "b", "before compaction the history is there"
    last = fake.add(rt.CONFIG_MAP, {"metadata": {"name": "c", "namespace": "ns"}})
    fake.compact()
    before_last = str(int(last["metadata"]["resourceVersion"]) - 1)
    since_b = fake.lister_watcher.watch(rt.CONFIG_MAP, "ns", resource_version=before_last)
    assert (await anext(since_b)).object["metadata"]["name"] == "c", "the compaction revision itself is kept"
    expired = fake.lister_watcher.watch(rt.CONFIG_MAP, "ns", resource_version=old["metadata"]["resourceVersion"])
    with pytest.raises(Gone) as gone:
        await anext(expired)
    assert gone.value.status == 410
    now = (await fake.lister_watcher.list(rt.CONFIG_MAP, "ns")).resource_version
    live = fake.lister_watcher.watch(rt.CONFIG_MAP, "ns", resource_version=now)
    nxt = asyncio.ensure_future(anext(live))
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "d", "namespace": "ns"}})
    event = await asyncio.wait_for(nxt, 5)
    assert (event.type, event.object["metadata"]["name"]) == ("ADDED", "d")


async def test_a_watch_from_zero_starts_with_the_objects_as_added() -> None:
    fake = FakeClient()
    fake.add(rt.CONFIG_MAP, {"metadata": {"name": "a", "namespace": "ns"}})
    fake.update(rt.CONFIG_MAP, {"metadata": {"name": "a", "namespace": "ns"}, "data": {"k": "v"}})
    fake.compact()
    events = fake.lister_watcher.watch(rt.CONFIG_MAP, "ns", resource_version="0")
    first = await anext(events)
    assert (first.type, first.object["data"]) == ("ADDED", {"k": "v"})
