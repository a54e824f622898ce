"""The runtime against a real kube-apiserver: convergence, ownership, garbage collection,
zero writes when nothing changes, and outages of the API server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hack.localenv import ControlPlane, Environment
from hack.localenv.tcpproxy import TcpProxy
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.controller import Request
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, NAMESPACE
from tailnet_operator.runtime.manager import Manager, ManagerOptions

from .leases import hijack, lease_history
from .polling import eventually
from .widgets import WIDGET, WidgetReconciler, install_widget_crd, quiet, widget

pytestmark = pytest.mark.integration

WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")



async def config_map_value(client: Client, namespace: str, name: str) -> str | None:
    try:
        cm = await client.get(CONFIG_MAP, f"{name}-data", namespace)
    except NotFound:
        return None
    return str(cm.get("data", {}).get("value"))


def value_is(client: Client, namespace: str, name: str, expected: str | None) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await config_map_value(client, namespace, name) == expected

    return check


def writes(registry: CollectorRegistry) -> float:
    total = 0.0
    for metric in registry.collect():
        if metric.name == "rest_client_requests":
            total += sum(s.value for s in metric.samples
                         if s.name.endswith("_total") and s.labels.get("method") in WRITE_METHODS)
    return total


def sample(registry: CollectorRegistry, metric: str, **labels: str) -> float:
    return registry.get_sample_value(metric, labels) or 0.0


@asynccontextmanager
async def running_manager(kubeconfig: Path, *, registry: CollectorRegistry | None = None, workers: int = 2,
                          namespace: str | None = None,
                          ignore_own_writes: bool = False) -> AsyncIterator[tuple[Manager, WidgetReconciler]]:
    from tailnet_operator.runtime.controller import ControllerOptions

    manager = Manager(rest_config.load(kubeconfig), ManagerOptions(graceful_shutdown_timeout=5),
                      registry=registry or CollectorRegistry())
    reconciler = WidgetReconciler(manager.cache, manager.writer())
    options = ControllerOptions(workers=workers, ignore_own_writes=ignore_own_writes)
    (manager.controller("widget", reconciler, options=options)
     .for_(WIDGET, namespace=namespace).owns(CONFIG_MAP, namespace=namespace))
    task = asyncio.create_task(manager.run())
    try:
        await eventually(lambda: manager.cache.informer(WIDGET, namespace).synced or task.done(), what="cache sync")
        if task.done():
            task.result()
        yield manager, reconciler
    finally:
        manager.stop()
        await asyncio.wait_for(task, 30)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"rt-{uuid.uuid4().hex[:8]}"
    control_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
async def admin(control_plane: ControlPlane) -> AsyncIterator[Client]:
    async with Client(rest_config.load(control_plane.kubeconfig), field_manager="test-admin") as client:
        await install_widget_crd(client)
        yield client


async def test_controller_converges_recreates_owned_objects_and_gc_collects_them(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    async with running_manager(control_plane.kubeconfig) as (_, reconciler):
        await admin.create(WIDGET, widget("alpha", namespace, "one"))
        await eventually(lambda: config_map_value(admin, namespace, "alpha"), what="alpha's ConfigMap")
        assert await config_map_value(admin, namespace, "alpha") == "one"

        async def status_observed() -> bool:
            obj = await admin.get(WIDGET, "alpha", namespace)
            return bool(obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"])

        await eventually(status_observed, what="status.observedGeneration")

        await admin.merge_patch(WIDGET, "alpha", {"spec": {"value": "two"}}, namespace)
        await eventually(value_is(admin, namespace, "alpha", "two"),
                         what="the ConfigMap to follow the spec")

        before = reconciler.calls[Request(namespace, "alpha")]
        await admin.delete(CONFIG_MAP, "alpha-data", namespace)
        await eventually(value_is(admin, namespace, "alpha", "two"),
                         what="the deleted ConfigMap to be recreated")
        assert reconciler.calls[Request(namespace, "alpha")] > before

    await admin.delete(WIDGET, "alpha", namespace, propagation="Background")
    await eventually(value_is(admin, namespace, "alpha", None), timeout=60,
                     what="the garbage collector to delete the owned ConfigMap")


async def test_reconciling_objects_already_as_desired_makes_zero_writes(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    names = [f"w{i}" for i in range(5)]
    async with running_manager(control_plane.kubeconfig) as _:
        for name in names:
            await admin.create(WIDGET, widget(name, namespace, name.upper()))
        for name in names:
            await eventually(value_is(admin, namespace, name, name.upper()),
                             what=f"{name} converged")

    registry = CollectorRegistry()
    async with running_manager(control_plane.kubeconfig, registry=registry) as (_, reconciler):
        await eventually(lambda: all(reconciler.calls[Request(namespace, n)] >= 1 for n in names)
                         and reconciler.in_flight == 0, what="every widget reconciled once")
        await eventually(lambda: sample(registry, "controller_runtime_reconcile_total",
                                        controller="widget", result="success") >= len(names),
                         what="successful reconciles counted")
        assert writes(registry) == 0
        assert sample(registry, "rest_client_requests_total", code="200", method="GET",
                      host=control_plane.url.removeprefix("https://")) > 0


async def test_a_spec_change_costs_exactly_two_writes_and_a_repeat_reconcile_none(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    """The owned ConfigMap and the status, once each: the runtime feeds each write's answer to the
    cache, so the reconcile that the ConfigMap's own event triggers finds nothing to write. The
    manager is scoped to the test's namespace, so Widgets of other tests (whose namespaces may be
    terminating) add no requests to the count."""
    registry = CollectorRegistry()

    def settled(name: str, value: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            obj = await admin.get(WIDGET, name, namespace)
            return (obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
                    and await config_map_value(admin, namespace, name) == value)

        return check

    async with running_manager(control_plane.kubeconfig, registry=registry, namespace=namespace) as (manager,
                                                                                                   reconciler):
        await admin.create(WIDGET, widget("counted", namespace, "one"))
        await eventually(settled("counted", "one"), what="created and settled")
        await quiet(manager, reconciler, admin, namespace, ["counted"])
        assert writes(registry) == 2, "creating a Widget writes its ConfigMap and its status"

        for step, value in enumerate(("two", "three", "four"), start=1):
            await admin.merge_patch(WIDGET, "counted", {"spec": {"value": value}}, namespace)
            await eventually(settled("counted", value), what=f"the change to {value}")
            await quiet(manager, reconciler, admin, namespace, ["counted"])
            assert writes(registry) == 2 + 2 * step, f"spec change {step}: one ConfigMap and one status write"

        before, calls = writes(registry), reconciler.calls[Request(namespace, "counted")]
        for controller in manager.controllers:
            controller.queue.add(Request(namespace, "counted"))
        await eventually(lambda: reconciler.calls[Request(namespace, "counted")] > calls, what="a repeat reconcile")
        await quiet(manager, reconciler, admin, namespace, ["counted"])
        assert writes(registry) == before, "reconciling an object already as desired writes nothing"


def settled(admin: Client, namespace: str, name: str, value: str) -> Callable[[], Awaitable[bool]]:
    """The Widget's status has seen its generation and its ConfigMap holds ``value``."""
    async def check() -> bool:
        obj = await admin.get(WIDGET, name, namespace)
        return (obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
                and await config_map_value(admin, namespace, name) == value)

    return check


async def test_with_ignore_own_writes_a_change_costs_one_reconcile_and_a_change_by_another_writer_still_wakes_it(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    """The answers of the reconcile's ConfigMap and status writes queue nothing (without the
    option each queued one more reconcile, which wrote nothing); a label another writer sets, which
    leaves the generation alone, still wakes the Widget, and so does its ConfigMap deleted."""
    registry = CollectorRegistry()
    request = Request(namespace, "own")
    async with running_manager(control_plane.kubeconfig, registry=registry, namespace=namespace,
                               ignore_own_writes=True) as (manager, reconciler):
        await admin.create(WIDGET, widget("own", namespace, "one"))
        await eventually(settled(admin, namespace, "own", "one"), what="created and settled")
        await quiet(manager, reconciler, admin, namespace, ["own"])
        assert (reconciler.calls[request], writes(registry)) == (1, 2), "one reconcile, two writes"

        for step, value in enumerate(("two", "three"), start=1):
            await admin.merge_patch(WIDGET, "own", {"spec": {"value": value}}, namespace)
            await eventually(settled(admin, namespace, "own", value), what=f"the change to {value}")
            await quiet(manager, reconciler, admin, namespace, ["own"])
            assert (reconciler.calls[request], writes(registry)) == (1 + step, 2 + 2 * step)

        await admin.merge_patch(WIDGET, "own", {"metadata": {"labels": {"team": "a"}}}, namespace)
        await eventually(lambda: reconciler.calls[request] == 4, what="the label change to wake the Widget")
        await admin.delete(CONFIG_MAP, "own-data", namespace)
        await eventually(value_is(admin, namespace, "own", "three"), what="the deleted ConfigMap recreated")
        await quiet(manager, reconciler, admin, namespace, ["own"])
        assert reconciler.calls[request] == 5
        assert manager.controllers[0].own_writes_dropped == 4, "creation, two changes, the ConfigMap recreated"


# -- outages -----------------------------------------------------------------------------------


@pytest.fixture
def private_plane(environment: Environment) -> Iterator[ControlPlane]:
    """A control plane of this test alone, since the test stops its API server."""
    plane = environment.control_plane()
    yield plane
    plane.stop()


async def test_watch_resumes_after_a_broken_connection_without_relisting(
    private_plane: ControlPlane, tmp_path: Path
) -> None:
    proxy = await TcpProxy("127.0.0.1", private_plane.port).start()
    kubeconfig = private_plane.kubeconfig_for(f"https://{proxy.address}", tmp_path / "via-proxy")
    ns = "outage"
    async with Client(rest_config.load(private_plane.kubeconfig)) as admin:
        await install_widget_crd(admin)
        await admin.create(NAMESPACE, {"metadata": {"name": ns}})
        for name, value in (("keep", "a"), ("change", "b"), ("drop", "c")):
            await admin.create(WIDGET, widget(name, ns, value))
        async with running_manager(kubeconfig) as (manager, reconciler):
            await eventually(value_is(admin, ns, "drop", "c"), what="converged")
            informer = manager.cache.informer(WIDGET)
            assert informer.stats.lists == 1

            await proxy.cut()
            await admin.create(WIDGET, widget("new", ns, "d"))
            await admin.merge_patch(WIDGET, "change", {"spec": {"value": "B"}}, ns)
            await admin.delete(WIDGET, "drop", ns)
            errors_before = informer.stats.watch_errors
            await eventually(lambda: informer.stats.watch_errors > errors_before + 1,
                             what="the informer to fail at least twice during the outage")
            await proxy.restore()

            await eventually(value_is(admin, ns, "new", "d"), what="created")
            await eventually(value_is(admin, ns, "change", "B"), what="changed")
            await eventually(lambda: Request(ns, "drop") in reconciler.missing, what="deletion seen")
            assert informer.stats.lists == 1, "a valid resourceVersion must resume the watch, not relist"
            assert informer.stats.watches >= 2
            assert informer.stats.relists_after_gone == 0
    await proxy.close()


async def test_apiserver_restart_and_compaction_relist_and_miss_nothing(private_plane: ControlPlane) -> None:
    ns = "restart"
    async with Client(rest_config.load(private_plane.kubeconfig)) as admin:
        await install_widget_crd(admin)
        await admin.create(NAMESPACE, {"metadata": {"name": ns}})
        for name, value in (("keep", "a"), ("change", "b"), ("drop", "c")):
            await admin.create(WIDGET, widget(name, ns, value))
    async with running_manager(private_plane.kubeconfig) as (manager, reconciler):
        informer = manager.cache.informer(WIDGET)
        await eventually(lambda: all(reconciler.calls[Request(ns, n)] for n in ("keep", "change", "drop"))
                         and reconciler.in_flight == 0, what="converged")

        private_plane.stop_apiserver()
        second, second_kubeconfig = private_plane.extra_apiserver()
        try:
            async with Client(rest_config.load(second_kubeconfig)) as other:
                await other.create(WIDGET, widget("new", ns, "d"))
                await other.merge_patch(WIDGET, "change", {"spec": {"value": "B"}}, ns)
                await other.delete(WIDGET, "drop", ns)
                for i in range(20):  # move etcd well past the informer's resourceVersion
                    await other.create(CONFIG_MAP, {"metadata": {"name": f"filler-{i}", "namespace": ns}})
        finally:
            second.stop()
        private_plane.compact_etcd()
        private_plane.start_apiserver()

        async with Client(rest_config.load(private_plane.kubeconfig)) as admin:
            await eventually(value_is(admin, ns, "new", "d"), what="created")
            await eventually(value_is(admin, ns, "change", "B"), what="changed")
            await eventually(lambda: Request(ns, "drop") in reconciler.missing, what="deletion seen")
        assert informer.stats.relists_after_gone >= 1
        assert informer.stats.lists >= 2


# -- leader election at the manager level ------------------------------------------------------


def _elected_manager(kubeconfig: Path, identity: str, lease: str) -> tuple[Manager, WidgetReconciler]:
    from tailnet_operator.runtime.leaderelection import LeaderElectionConfig

    options = ManagerOptions(
        leader_election=True, leader_election_id=lease, leader_election_namespace="default",
        leader_election_config=LeaderElectionConfig(lease_duration=3.0, renew_deadline=2.0, retry_period=0.25,
                                                    identity=identity),
        graceful_shutdown_timeout=5)
    manager = Manager(rest_config.load(kubeconfig), options, registry=CollectorRegistry())
    reconciler = WidgetReconciler(manager.cache, manager.writer())
    manager.controller("widget", reconciler).for_(WIDGET).owns(CONFIG_MAP)
    return manager, reconciler


async def test_only_the_leader_reconciles_and_a_graceful_stop_hands_over_quickly(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    lease = f"widgets-{uuid.uuid4().hex[:6]}"
    first, first_reconciler = _elected_manager(control_plane.kubeconfig, "first", lease)
    second, second_reconciler = _elected_manager(control_plane.kubeconfig, "second", lease)
    first_task = asyncio.create_task(first.run())
    await eventually(lambda: first.elector is not None and first.elector.is_leader, what="first to lead")
    second_task = asyncio.create_task(second.run())
    try:
        await admin.create(WIDGET, widget("led", namespace, "x"))
        await eventually(value_is(admin, namespace, "led", "x"), what="the leader to reconcile")
        assert first_reconciler.calls[Request(namespace, "led")] >= 1
        assert sum(second_reconciler.calls.values()) == 0, "a follower must not reconcile"

        async with lease_history(admin, lease, "default") as history:
            first.stop()
            await asyncio.wait_for(first_task, 10)
            await eventually(lambda: second.elector is not None and second.elector.is_leader, timeout=30,
                             what="the follower to take over")
            await eventually(lambda: history.holders()[-1] == "second", what="the takeover in the Lease")
        # A graceful stop releases the Lease, so the follower need not wait for it to expire.
        assert history.holders() == ["first", "", "second"]

        await admin.merge_patch(WIDGET, "led", {"spec": {"value": "y"}}, namespace)
        await eventually(value_is(admin, namespace, "led", "y"), what="the new leader to reconcile")
        assert second_reconciler.calls[Request(namespace, "led")] >= 1
    finally:
        second.stop()
        first.stop()
        await asyncio.gather(first_task, second_task, return_exceptions=True)


async def test_a_manager_that_loses_its_lease_stops_reconciling_at_once(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    from tailnet_operator.runtime.manager import LeadershipLost

    lease = f"widgets-{uuid.uuid4().hex[:6]}"
    manager, reconciler = _elected_manager(control_plane.kubeconfig, "doomed", lease)
    task = asyncio.create_task(manager.run())
    await eventually(lambda: manager.elector is not None and manager.elector.is_leader, what="leading")
    await hijack(admin, lease, "default", "usurper")
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(task, 30)  # a deadline for liveness; how fast is the benchmarks' business
    assert reconciler.in_flight == 0
    assert sample(manager.registry, "leader_election_master_status", name=lease) == 0


# -- the informer's edges -----------------------------------------------------------------------


async def test_informer_takes_objects_larger_than_128_kib_and_reconnects_a_silent_watch(
    control_plane: ControlPlane, tmp_path: Path, namespace: str
) -> None:
    from tailnet_operator.runtime.cache.informer import Informer

    proxy = await TcpProxy("127.0.0.1", control_plane.port).start()
    kubeconfig = control_plane.kubeconfig_for(f"https://{proxy.address}", tmp_path / "via-proxy")
    async with Client(rest_config.load(kubeconfig)) as client, \
            Client(rest_config.load(control_plane.kubeconfig)) as admin:
        informer = Informer(client, CONFIG_MAP, namespace, inactivity_timeout=2.0)
        task = asyncio.create_task(informer.run())
        try:
            await eventually(lambda: informer.synced, what="sync")
            big = "x" * (300 * 1024)
            await admin.create(CONFIG_MAP, {"metadata": {"name": "big", "namespace": namespace}, "data": {"v": big}})
            await eventually(lambda: (informer.store.get(f"{namespace}/big") or {}).get("data", {}).get("v") == big,
                             what="a 300 KiB object through the watch")

            watches = informer.stats.watches
            proxy.freeze()
            await eventually(lambda: informer.stats.watch_errors >= 1, timeout=10,
                             what="the inactivity watchdog to drop the silent watch")
            proxy.thaw()
            await admin.create(CONFIG_MAP, {"metadata": {"name": "after", "namespace": namespace}})
            await eventually(lambda: informer.store.get(f"{namespace}/after") is not None, timeout=20,
                             what="the object created after the silence")
            assert informer.stats.watches > watches
            assert informer.stats.lists == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await proxy.close()


async def test_manager_serves_probes_and_controller_runtime_metrics(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    import aiohttp

    manager = Manager(rest_config.load(control_plane.kubeconfig),
                      ManagerOptions(metrics_bind_address="127.0.0.1:0", health_probe_bind_address="127.0.0.1:0"),
                      registry=CollectorRegistry())
    reconciler = WidgetReconciler(manager.cache, manager.writer())
    manager.controller("widget", reconciler).for_(WIDGET).owns(CONFIG_MAP)
    task = asyncio.create_task(manager.run())
    try:
        await eventually(lambda: "metrics" in manager.bound_addresses and "probes" in manager.bound_addresses,
                         what="servers bound")
        probes = "http://{}:{}".format(*manager.bound_addresses["probes"])
        metrics = "http://{}:{}/metrics".format(*manager.bound_addresses["metrics"])
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                async with http.get(f"{probes}/readyz") as resp:
                    return resp.status == 200 and await resp.text() == "ok"

            await eventually(ready, what="/readyz")
            async with http.get(f"{probes}/healthz?verbose") as resp:
                assert resp.status == 200
                assert "[+]ping ok" in await resp.text()
            await admin.create(WIDGET, widget("scraped", namespace, "m"))
            await eventually(value_is(admin, namespace, "scraped", "m"), what="reconciled")
            async with http.get(metrics) as resp:
                text = await resp.text()
        for family in ("controller_runtime_reconcile_total", "controller_runtime_reconcile_time_seconds_bucket",
                       "controller_runtime_active_workers", "controller_runtime_max_concurrent_reconciles",
                       "workqueue_depth", "workqueue_adds_total", "workqueue_queue_duration_seconds_bucket",
                       "workqueue_work_duration_seconds_bucket", "workqueue_retries_total",
                       "rest_client_requests_total"):
            assert f"\n{family}{{" in text, f"{family} missing from /metrics"
        assert 'controller_runtime_reconcile_total{controller="widget",result="success"}' in text
        assert "_created" not in text
    finally:
        manager.stop()
        await asyncio.wait_for(task, 30)


async def test_a_burst_of_changes_on_many_objects_costs_exactly_two_writes_each(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    """Churn: every Widget changed at once while 8 workers reconcile. A reconcile woken by the
    event of its own ConfigMap (or status) write must find the cache already holding that write,
    so each change costs its ConfigMap and its status and nothing more."""
    registry = CollectorRegistry()
    count = 30

    async def all_settled(value: str) -> bool:
        items = (await admin.list(WIDGET, namespace)).items
        return len(items) == count and all(
            (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"]
            and (o.get("status") or {}).get("value") == value for o in items)

    async with running_manager(control_plane.kubeconfig, registry=registry, namespace=namespace,
                               workers=8) as (manager, reconciler):
        await asyncio.gather(*(admin.create(WIDGET, widget(f"w{i}", namespace, "one")) for i in range(count)))
        await eventually(lambda: all_settled("one"), what="all created and settled")
        await quiet(manager, reconciler, admin, namespace, [f"w{i}" for i in range(count)])
        assert writes(registry) == 2 * count, "creating a Widget writes its ConfigMap and its status"

        await asyncio.gather(*(admin.merge_patch(WIDGET, f"w{i}", {"spec": {"value": "two"}}, namespace)
                               for i in range(count)))
        await eventually(lambda: all_settled("two"), what="every change settled")
        await quiet(manager, reconciler, admin, namespace, [f"w{i}" for i in range(count)])
        assert writes(registry) == 4 * count, "each change: one ConfigMap and one status write, no more"


async def test_listed_objects_of_a_built_in_kind_carry_their_kind_as_watched_ones_do(
    control_plane: ControlPlane, admin: Client, namespace: str
) -> None:
    """kube-apiserver leaves ``apiVersion`` and ``kind`` out of a built-in kind's list items; an
    object read from the cache is an owner and an Event's subject by its kind, whichever way it came."""
    from tailnet_operator.runtime.cache.informer import Informer

    await admin.create(CONFIG_MAP, {"metadata": {"name": "listed", "namespace": namespace}})
    raw = await admin.request("GET", CONFIG_MAP.path(namespace))
    assert raw["items"] and "kind" not in raw["items"][0], "the server sends list items without their kind"
    listed = await admin.list(CONFIG_MAP, namespace)
    assert [(o["apiVersion"], o["kind"]) for o in listed.items] == [("v1", "ConfigMap")]

    informer = Informer(admin, CONFIG_MAP, namespace)
    task = asyncio.create_task(informer.run())
    try:
        await eventually(lambda: informer.synced, what="sync")
        await admin.create(CONFIG_MAP, {"metadata": {"name": "watched", "namespace": namespace}})
        await eventually(lambda: informer.store.get(f"{namespace}/watched") is not None, what="the watched object")
        for name in ("listed", "watched"):
            obj = informer.store.get(f"{namespace}/{name}") or {}
            assert (obj.get("apiVersion"), obj.get("kind")) == ("v1", "ConfigMap"), name
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
