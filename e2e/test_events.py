"""Events and finalizers against a real kube-apiserver (and its kube-controller-manager)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hack.localenv import ControlPlane
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.client.config import load
from tailnet_operator.runtime.controller.finalizers import (
    add_finalizer,
    has_finalizer,
    remove_finalizer,
)
from tailnet_operator.runtime.errors import Conflict, Invalid, NotFound
from tailnet_operator.runtime.events import REPORTING_CONTROLLER, EventRecorder, EventType, Outcome
from tailnet_operator.runtime.kinds import CONFIG_MAP, EVENT, NAMESPACE

from .polling import eventually

FINALIZER = "test.tailnet.dev/finalizer"
FINALIZER_FIELD_MANAGER = "test-finalizer"

pytestmark = pytest.mark.integration

NS = "default"



@pytest.fixture
async def client(control_plane: ControlPlane) -> AsyncIterator[Client]:
    async with Client(load(control_plane.kubeconfig)) as c:
        yield c


@pytest.fixture
async def config_map(client: Client) -> AsyncIterator[dict[str, Any]]:
    name = f"subject-{uuid.uuid4().hex[:8]}"
    obj = await client.apply(CONFIG_MAP, {"metadata": {"name": name, "namespace": NS}, "data": {"k": "v"}})
    try:
        yield obj
    finally:
        try:
            current = await client.get(CONFIG_MAP, name, NS)
            if current["metadata"].get("finalizers"):
                await client.merge_patch(CONFIG_MAP, name, {"metadata": {"finalizers": None}}, NS)
            await client.delete(CONFIG_MAP, name, NS)
        except NotFound:
            pass


@pytest.fixture
def recorder(client: Client) -> EventRecorder:
    return EventRecorder(client, reporting_instance="test-instance")


async def events_about(client: Client, obj: dict[str, Any], namespace: str = NS) -> list[dict[str, Any]]:
    uid = obj["metadata"]["uid"]
    listed = await client.list(EVENT, namespace)
    return [e for e in listed.items if e.get("regarding", {}).get("uid") == uid]


# -- events -------------------------------------------------------------------------------------


async def test_an_event_carries_the_object_reason_note_and_reporter(
        client: Client, recorder: EventRecorder, config_map: dict[str, Any]) -> None:
    outcome = await recorder.event(config_map, EventType.WARNING, "SyncFailed", "headscale unreachable",
                                   action="Sync")
    assert outcome is Outcome.CREATED
    (event,) = await events_about(client, config_map)
    meta = config_map["metadata"]
    assert event["metadata"]["namespace"] == NS
    assert event["metadata"]["name"].startswith(meta["name"] + ".")
    assert event["regarding"] == {"apiVersion": "v1", "kind": "ConfigMap", "name": meta["name"],
                                  "namespace": NS, "uid": meta["uid"]}
    assert (event["type"], event["reason"], event["note"], event["action"]) == (
        "Warning", "SyncFailed", "headscale unreachable", "Sync")
    assert event["reportingController"] == REPORTING_CONTROLLER, "a recorder given no name uses the default"
    assert event["reportingInstance"] == "test-instance"
    assert event["eventTime"]
    assert "series" not in event


async def test_repeats_extend_one_event_with_a_series_count(
        client: Client, recorder: EventRecorder, config_map: dict[str, Any]) -> None:
    outcomes = [await recorder.normal(config_map, "Synced", "in sync") for _ in range(5)]
    assert outcomes == [Outcome.CREATED] + [Outcome.SERIES] * 4
    (event,) = await events_about(client, config_map)
    assert event["series"]["count"] == 5
    assert event["series"]["lastObservedTime"] >= event["eventTime"]


async def test_distinct_reasons_are_distinct_events(
        client: Client, recorder: EventRecorder, config_map: dict[str, Any]) -> None:
    await recorder.normal(config_map, "Created", "made it")
    await recorder.normal(config_map, "Synced", "made it")
    await recorder.warning(config_map, "Synced", "made it")
    events = await events_about(client, config_map)
    assert sorted((e["type"], e["reason"]) for e in events) == [
        ("Normal", "Created"), ("Normal", "Synced"), ("Warning", "Synced")]
    assert len({e["metadata"]["name"] for e in events}) == 3


async def test_events_of_cluster_scoped_objects_go_to_default(client: Client,
                                                               recorder: EventRecorder) -> None:
    namespace = await client.get(NAMESPACE, "kube-system")
    assert await recorder.normal(namespace, "Observed", "seen") is Outcome.CREATED
    (event,) = await events_about(client, namespace, "default")
    assert "namespace" not in event["regarding"]
    assert event["regarding"]["kind"] == "Namespace"
    await client.delete(EVENT, event["metadata"]["name"], "default")


async def test_an_api_error_is_logged_not_raised(control_plane: ControlPlane,
                                                 config_map: dict[str, Any]) -> None:
    closed = Client(load(control_plane.kubeconfig))  # never opened: every request fails
    recorder = EventRecorder(closed, reporting_instance="test-instance")
    assert await recorder.normal(config_map, "Synced", "in sync") is Outcome.FAILED


# -- finalizers ---------------------------------------------------------------------------------


async def test_finalizer_is_added_and_removed_by_apply(client: Client, config_map: dict[str, Any]) -> None:
    name = config_map["metadata"]["name"]
    added = await add_finalizer(client, CONFIG_MAP, config_map, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)
    assert has_finalizer(added, FINALIZER)
    assert added["data"] == {"k": "v"}, "the finalizer apply must not drop fields applied by the operator"
    owners = {m["manager"]: m["fieldsV1"] for m in added["metadata"]["managedFields"]}
    assert owners[FINALIZER_FIELD_MANAGER] == {"f:metadata": {"f:finalizers": {f'v:"{FINALIZER}"': {}}}}

    # A finalizer someone else added survives the removal of ours (a set, owned per manager).
    both = {"metadata": {"finalizers": [FINALIZER, "other.dev/keep"]}}
    await client.merge_patch(CONFIG_MAP, name, both, NS)
    removed = await remove_finalizer(client, CONFIG_MAP, await client.get(CONFIG_MAP, name, NS), FINALIZER,
                                  field_manager=FINALIZER_FIELD_MANAGER)
    assert removed["metadata"]["finalizers"] == ["other.dev/keep"]
    assert not has_finalizer(removed, FINALIZER)


async def test_removing_the_finalizer_lets_a_deleted_object_go(client: Client,
                                                                config_map: dict[str, Any]) -> None:
    name = config_map["metadata"]["name"]
    await add_finalizer(client, CONFIG_MAP, config_map, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)
    await client.delete(CONFIG_MAP, name, NS)
    deleting = await client.get(CONFIG_MAP, name, NS)
    assert deleting["metadata"]["deletionTimestamp"]
    assert has_finalizer(deleting, FINALIZER)
    with pytest.raises(Invalid):  # no new finalizers once deletion has started
        await add_finalizer(client, CONFIG_MAP, deleting, "other.dev/late", field_manager="late")

    await remove_finalizer(client, CONFIG_MAP, deleting, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)

    async def gone() -> bool:
        try:
            await client.get(CONFIG_MAP, name, NS)
        except NotFound:
            return True
        return False

    await eventually(gone, timeout=10, what="the ConfigMap disappears")
    # A late removal must not resurrect the object: the uid precondition fails instead.
    with pytest.raises(Conflict):
        await remove_finalizer(client, CONFIG_MAP, deleting, FINALIZER, field_manager=FINALIZER_FIELD_MANAGER)
    assert await gone()
