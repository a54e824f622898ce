"""What the runtime benchmark measures with: a bare HTTP client of the control plane, the
apiserver's own write counters, a watch that tells when Widgets converge, and the CPU and
peak RSS of a controller process (from /proc)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

GROUP = "test.tailnet.dev"
WIDGETS = f"/apis/{GROUP}/v1"
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"})
COUNTED_RESOURCES = frozenset({"widgets", "configmaps"})
FIELD_MANAGER = "widget-controller"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ApiError(RuntimeError):
    pass


class Api:
    """A bare aiohttp client of the apiserver as the admin user (what the floor writes with)."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext, *, connections: int = 64) -> None:
        self.url = url
        self._ssl = ssl_context
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Api:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=self._connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), read_bufsize=1 << 20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                      params: dict[str, str] | None = None, ok: Iterable[int] = ()) -> Any:
        data = None if body is None else json.dumps(body)
        async with self.session.request(method, self.url + path, data=data, params=params,
                                        headers={"Content-Type": content_type}) as resp:
            payload = await resp.read()
            if resp.status >= 300 and resp.status not in ok:
                raise ApiError(f"{method} {path}: {resp.status} {payload[:300]!r}")
            return json.loads(payload) if payload.startswith(b"{") else payload.decode()

    async def apply(self, path: str, body: Any) -> Any:
        return await self.request("PATCH", path, body, content_type="application/apply-patch+yaml",
                                  params={"fieldManager": FIELD_MANAGER, "force": "true"})

    async def write_count(self) -> int:
        """Writes to Widgets and ConfigMaps the apiserver has served since it started."""
        text = await self.request("GET", "/metrics")
        total = 0
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels_text, _, value = line.rpartition(" ")
            labels = dict(part.split("=", 1) for part in labels_text[len("apiserver_request_total{"):-1].split(",")
                          if "=" in part)
            if (labels.get("verb", "").strip('"') in WRITE_VERBS
                    and labels.get("resource", "").strip('"') in COUNTED_RESOURCES):
                total += int(float(value))
        return total


async def bounded(limit: int, jobs: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    """Run ``jobs`` with at most ``limit`` in flight."""
    semaphore = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[Any]]) -> None:
        async with semaphore:
            await job()

    async with asyncio.TaskGroup() as group:
        for job in jobs:
            group.create_task(one(job))


def widget(name: str, namespace: str, value: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"value": value}}


async def create_widgets(api: Api, namespace: str, count: int) -> list[dict[str, Any]]:
    """A new namespace with ``count`` Widgets; returns them as created."""
    await api.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    created: list[dict[str, Any]] = []

    async def create(i: int) -> None:
        created.append(await api.request("POST", f"{WIDGETS}/namespaces/{namespace}/widgets",
                                         widget(f"w{i:05d}", namespace, "v0")))

    await bounded(32, (lambda i=i: create(i) for i in range(count)))  # type: ignore[misc]
    return created


def desired_config_map(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{meta['name']}-data", "namespace": meta["namespace"], "ownerReferences": [{
                "apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": meta["name"], "uid": meta["uid"],
                "controller": True, "blockOwnerDeletion": True}]},
            "data": {"value": obj["spec"]["value"]}}


async def floor_writes(api: Api, widgets: list[dict[str, Any]], *, concurrency: int = 32) -> None:
    """The floor: each Widget's ConfigMap and status, applied by a bare client as fast as the
    apiserver takes them (no cache, no comparison, no watch)."""
    async def one(obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        await api.apply(f"/api/v1/namespaces/{meta['namespace']}/configmaps/{meta['name']}-data",
                        desired_config_map(obj))
        await api.apply(f"{WIDGETS}/namespaces/{meta['namespace']}/widgets/{meta['name']}/status", {
            "apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": meta["name"]},
            "status": {"observedGeneration": meta["generation"], "value": obj["spec"]["value"]}})

    await bounded(concurrency, (lambda o=o: one(o) for o in widgets))  # type: ignore[misc]


@dataclass
class Convergence:
    """Follows the Widgets of one namespace through a watch: which ones have
    status.observedGeneration equal to their generation, and when each generation was seen."""

    api: Api
    namespace: str
    generation: dict[str, int] = field(default_factory=dict)
    observed: dict[str, int] = field(default_factory=dict)
    waiters: dict[tuple[str, int], asyncio.Future[float]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    done: set[str] = field(default_factory=set)

    def converged(self) -> int:
        return len(self.done)

    async def start(self) -> None:
        listing = await self.api.request("GET", f"{WIDGETS}/namespaces/{self.namespace}/widgets")
        for obj in listing["items"]:
            self._see(obj)
        self._task = asyncio.create_task(self._watch(listing["metadata"]["resourceVersion"]))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _see(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.generation[name] = obj["metadata"]["generation"]
        observed = (obj.get("status") or {}).get("observedGeneration")
        if observed == self.generation[name]:  # counted as it changes: no pass over every Widget per event
            self.done.add(name)
        else:
            self.done.discard(name)
        if observed is not None:
            self.observed[name] = observed
            now = time.monotonic()
            for gen in range(observed, 0, -1):
                waiter = self.waiters.pop((name, gen), None)
                if waiter is None:
                    break
                if not waiter.done():
                    waiter.set_result(now)
        self.changed.set()

    def wait_observed(self, name: str, generation: int) -> asyncio.Future[float]:
        """A future of the monotonic time the watch saw ``generation`` observed."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self.observed.get(name, 0) >= generation:
            future.set_result(time.monotonic())
        else:
            self.waiters[(name, generation)] = future
        return future

    async def _watch(self, resource_version: str) -> None:
        while True:
            params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                      "timeoutSeconds": "3600"}
            async with self.api.session.get(f"{self.api.url}{WIDGETS}/namespaces/{self.namespace}/widgets",
                                            params=params) as resp:
                if resp.status != 200:
                    raise ApiError(f"watch: {resp.status}")
                async for line in resp.content:
                    event = json.loads(line)
                    obj = event["object"]
                    resource_version = obj["metadata"].get("resourceVersion", resource_version)
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._see(obj)

    async def until(self, count: int, *, deadline: float) -> None:
        """Wait until ``count`` Widgets are converged; TimeoutError at the monotonic ``deadline``."""
        while self.converged() < count:
            if self._task is not None and self._task.done():
                self._task.result()
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.converged()} of {count} Widgets converged in {self.namespace}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 1.0))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process so far."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):  # noqa: SIM115
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
