"""Controllers: watches that turn events into keys, a workqueue, and workers that reconcile.

The :class:`Reconciler` contract, in the order the worker applies it:

* raising :class:`TerminalError` logs and counts the error and does **not** requeue;
* raising any other exception requeues the key with the rate limiter's backoff
  (5 ms doubling to 1000 s per key, within a 10 qps / 100 burst bucket);
* returning ``Result(requeue_after=s)`` with ``s > 0`` requeues after ``s`` seconds;
* returning ``Result(requeue=True)`` requeues with backoff;
* otherwise the key is done and its backoff forgotten.

An exception never ends a worker. Level-based: reconcile reads the world (the cache), never
the event that woke it, so running it twice changes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from tailnet_operator.types import JSON

from ..cache import NotYetCached, SharedCache
from ..cache.informer import DeletedFinalStateUnknown
from ..client.ownwrite import OwnWrite, explains, recording
from ..clock import Clock, RealClock
from ..errors import KubeError
from ..kinds import Resource
from ..metrics import ControllerMetrics
from .predicates import Predicate
from .workqueue import RateLimitingQueue, ShutDown

log = structlog.get_logger("controller")

UNFINISHED_WORK_INTERVAL = 0.5
"""Seconds between updates of the unfinished-work gauges (client-go's 500 ms)."""


@dataclass(frozen=True, order=True)
class Request:
    """The object to reconcile: ``namespace`` is ``""`` for cluster-scoped kinds."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


@dataclass(frozen=True)
class Result:
    """What to do with the key after a successful reconcile. The default: nothing."""

    requeue_after: float = 0.0
    """Seconds until the key is reconciled again; 0 means not on a timer."""
    requeue: bool = False
    """Requeue with the rate limiter's backoff (when ``requeue_after`` is 0)."""


class TerminalError(Exception):
    """A failure that retrying cannot fix (bad input the user must change): no requeue."""


class Reconciler(Protocol):
    async def reconcile(self, request: Request) -> Result: ...


Mapper = Callable[[JSON], Iterable[Request]]
"""Maps a watched object to the requests it should wake."""


def request_for(obj: JSON) -> Request:
    meta = obj.get("metadata", {})
    return Request(str(meta.get("namespace") or ""), str(meta["name"]))


def self_mapper(obj: JSON) -> list[Request]:
    """The primary kind's mapping: an object wakes its own request."""
    return [request_for(obj)]


def owner_mapper(owner: Resource, *, only_controller: bool = True) -> Mapper:
    """Map an object to its owner of kind ``owner`` (the controller owner by default).

    A namespaced object's owner is in its namespace, unless the owner kind is cluster-scoped.
    """

    def mapper(obj: JSON) -> list[Request]:
        meta = obj.get("metadata", {})
        namespace = str(meta.get("namespace") or "") if owner.namespaced else ""
        return [
            Request(namespace, str(ref["name"]))
            for ref in meta.get("ownerReferences") or []
            if ref.get("kind") == owner.kind
            and str(ref.get("apiVersion", "")).split("/")[0] == (owner.group or "v1").split("/")[0]
            and (ref.get("controller") or not only_controller)
        ]

    return mapper


@dataclass(frozen=True)
class Watch:
    resource: Resource
    mapper: Mapper
    predicates: Sequence[Predicate]
    namespace: str | None = None
    labels: Mapping[str, str] | None = None


Hold = Callable[[Request, Resource, "JSON | None", JSON], bool]
"""Takes the change ``old`` -> ``new`` of a request being reconciled, to judge when the reconcile
ends (True), or leaves it to be queued now (False)."""


class _Handler:
    """Informer event handler: filter with predicates, map to requests, enqueue (or ``hold`` the
    change for a request being reconciled: see ``ControllerOptions.ignore_own_writes``)."""

    def __init__(self, watch: Watch, enqueue: Callable[[Request], None], hold: Hold | None = None) -> None:
        self._watch = watch
        self._enqueue = enqueue
        self._hold = hold

    def on_add(self, obj: JSON) -> None:
        if all(p.create(obj) for p in self._watch.predicates):
            self._map(obj, None, obj)

    def on_update(self, old: JSON, new: JSON) -> None:
        if all(p.update(old, new) for p in self._watch.predicates):
            self._map(new, old, new)
            if self._watch.mapper is not self_mapper:
                self._map(old, old, new)  # an owner or mapping that changed still hears about the old one

    def on_delete(self, obj: JSON | DeletedFinalStateUnknown) -> None:
        final = obj.obj if isinstance(obj, DeletedFinalStateUnknown) else obj
        if all(p.delete(final) for p in self._watch.predicates):
            for request in self._watch.mapper(final):
                self._enqueue(request)

    def _map(self, obj: JSON, old: JSON | None, new: JSON) -> None:
        for request in self._watch.mapper(obj):
            if self._hold is None or not self._hold(request, self._watch.resource, old, new):
                self._enqueue(request)


@dataclass
class _Running:
    """One reconcile in progress: the writes it made, and the changes to its objects seen meanwhile."""

    writes: list[OwnWrite] = field(default_factory=list)
    held: list[tuple[Resource, JSON | None, JSON]] = field(default_factory=list)

    def unexplained(self) -> int:
        """How many held changes its own writes do not explain."""
        return sum(not explains(self.writes, *change) for change in self.held)


DEFAULT_WORKERS = 4
"""Concurrent reconciles by default. The queue never hands one key to two workers, so more
workers only let slow reconciles (a Headscale call) of different objects overlap."""

APISERVER_WORKERS = 32
"""Workers for a controller whose reconciles wait on kube-apiserver alone (cache reads, a few
writes): a worker is a coroutine, so the limit is what the apiserver takes in flight. 32 is
what the runtime benchmark's bare-client floor keeps in flight; at N = 1,000 Widgets (two
writes each, one after the other) the cold start fell from 8 to 32 workers and no further
at 64 (docs/benchmarks.md). Not the default: reconciles that call Headscale would load it
eight times as much."""


@dataclass
class ControllerOptions:
    """Per-controller settings."""

    workers: int = DEFAULT_WORKERS
    """Concurrent reconciles (MaxConcurrentReconciles). Default 4 (:data:`DEFAULT_WORKERS`)."""
    reconcile_timeout: float = 0.0
    """Seconds one reconcile may run before it is cancelled and counted as a timeout; 0: no limit."""
    ignore_own_writes: bool = False
    """Do not queue a request again for the events of the writes its own reconcile made (the
    answer, or the watch event of the same resourceVersion, whichever reaches the cache first).
    A change to one of the request's objects seen while it is reconciled is held until the
    reconcile ends, and queues it then unless a write of that reconcile stored it and it changes
    nothing that write did not send (:func:`..client.ownwrite.only_written`): a change someone
    else made meanwhile still queues it, as does every deletion. A reconcile woken by its own
    writes alone would find them done and write nothing. Off by default: a reconciler that makes
    one step per pass and relies on its write to wake it for the next (adds a finalizer and
    returns) must return ``Result(requeue=True)`` instead before it turns this on."""


class Controller:
    """One reconciler fed by watches on the shared cache.

    Build it with :meth:`for_`, :meth:`owns` and :meth:`watches` before the manager starts;
    ``run()`` blocks until cancelled and drains in-flight reconciles on the way out.

    ``namespace`` and ``labels`` scope a watch: its informer lists and watches only that
    namespace and only objects carrying those labels (equality), so the cache holds no more of
    an owned kind than the controller needs. Reads of that kind are served from that scope
    unless another watch made an informer of all namespaces and no labels, which then serves
    them; either way a reconcile woken by an added or changed object reads at least that
    version of it (see :mod:`..cache`).
    """

    def __init__(self, name: str, reconciler: Reconciler, cache: SharedCache, *,
                 options: ControllerOptions | None = None, metrics: ControllerMetrics | None = None,
                 clock: Clock | None = None) -> None:
        self.name = name
        self.reconciler = reconciler
        self.options = options or ControllerOptions()
        self._cache = cache
        self._clock = clock or RealClock()
        self._metrics = metrics
        self.queue: RateLimitingQueue[Request] = RateLimitingQueue(
            clock=self._clock, metrics=metrics.queue(name) if metrics else None)
        self._log = log.bind(controller=name)
        self._active = 0
        self._stopping = False
        self._for: Resource | None = None
        self._running: dict[Request, _Running] = {}
        self.own_writes_dropped = 0
        """Reconciles not queued again because every change seen during them was their own
        writes (``ignore_own_writes``)."""

    # -- building ------------------------------------------------------------------------------

    def for_(self, resource: Resource, *predicates: Predicate, namespace: str | None = None,
             labels: Mapping[str, str] | None = None) -> Controller:
        """Reconcile every object of ``resource`` (the primary kind; once per controller)."""
        _check_watch(self.name, "for_", resource, predicates)
        if self._for is not None:
            raise ValueError(f"controller {self.name}: for_() was already called with {self._for}")
        self._for = resource
        return self.watches(resource, self_mapper, *predicates, namespace=namespace, labels=labels)

    def owns(self, resource: Resource, *predicates: Predicate, owner: Resource | None = None,
             only_controller: bool = True, namespace: str | None = None,
             labels: Mapping[str, str] | None = None) -> Controller:
        """Reconcile the owner when an object of ``resource`` changes.

        ``owner`` defaults to the kind given to :meth:`for_` (call that first). Only the
        controller owner counts unless ``only_controller`` is False.
        """
        _check_watch(self.name, "owns", resource, predicates)
        if owner is not None and not isinstance(owner, Resource):
            raise TypeError(f"controller {self.name}: owns(owner=...) takes a Resource, not {owner!r}")
        owner = owner or self._for
        if owner is None:
            raise ValueError(f"controller {self.name}: call for_() before owns(), or pass owner=")
        return self.watches(resource, owner_mapper(owner, only_controller=only_controller), *predicates,
                            namespace=namespace, labels=labels)

    def watches(self, resource: Resource, mapper: Mapper, *predicates: Predicate,
                namespace: str | None = None, labels: Mapping[str, str] | None = None) -> Controller:
        """Reconcile whatever ``mapper`` returns for each changed object of ``resource``."""
        _check_watch(self.name, "watches", resource, predicates)
        if isinstance(mapper, Resource) or not callable(mapper):
            raise TypeError(f"controller {self.name}: watches({resource}, ...): the mapper must be a function "
                            f"of the object returning Requests, not {mapper!r}")
        watch = Watch(resource, mapper, predicates, namespace, labels)
        self._cache.add_handler(resource, _Handler(watch, self.queue.add, self._hold), namespace, labels=labels)
        return self

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile until cancelled, or until ``shutdown()`` and the in-flight reconciles end."""
        if self._metrics:
            self._metrics.max_concurrent(self.name, self.options.workers)
            self._metrics.active_workers(self.name, 0)
        try:
            async with asyncio.TaskGroup() as group:
                helpers = [group.create_task(self.queue.run(), name=f"{self.name} queue"),
                           group.create_task(self._update_gauges(), name=f"{self.name} gauges")]
                workers = [group.create_task(self._worker(), name=f"{self.name} worker {index}")
                           for index in range(self.options.workers)]
                await asyncio.gather(*workers)
                for task in helpers:
                    task.cancel()
        finally:
            self.queue.shutdown()

    def shutdown(self) -> None:
        """Take no new keys; ``run()`` returns once the reconciles in progress have finished."""
        self._stopping = True
        self.queue.shutdown()

    async def _update_gauges(self) -> None:
        while True:
            self.queue.update_unfinished_work()
            await self._clock.sleep(UNFINISHED_WORK_INTERVAL)

    async def _worker(self) -> None:
        while True:
            try:
                request = await self.queue.get()
            except ShutDown:
                return
            if self._stopping:
                self.queue.done(request)
                return
            try:
                await self._reconcile_handler(request)
            finally:
                self.queue.done(request)

    async def _reconcile_handler(self, request: Request) -> None:
        reconcile_id = uuid.uuid4().hex[:12]
        started = self._clock.now()
        self._set_active(+1)
        outcome = "error"
        with structlog.contextvars.bound_contextvars(controller=self.name, object=str(request),
                                                     reconcile_id=reconcile_id):
            try:
                result = await self._reconcile(request)
            except asyncio.CancelledError:
                raise
            except NotYetCached as pending:
                outcome = "requeue"
                self._cache.when_fetched(pending, lambda: self.queue.add(request))
            except TerminalError as exc:
                self.queue.forget(request)
                self._count_error(terminal=True)
                self._log.error("reconcile failed; not retrying", object=str(request), error=str(exc))
            except Exception as exc:
                self.queue.add_rate_limited(request)
                self._count_error(timeout=isinstance(exc, TimeoutError))
                self._log.warning("reconcile failed; retrying with backoff", object=str(request),
                                  error=str(exc) or type(exc).__name__, exc_info=not _expected(exc))
            else:
                outcome = self._requeue(request, result)
            finally:
                self._set_active(-1)
                if self._metrics:
                    self._metrics.reconciled(self.name, outcome, self._clock.now() - started,
                                             at=self._clock.utcnow().timestamp())

    def _hold(self, request: Request, resource: Resource, old: JSON | None, new: JSON) -> bool:
        """Keep a change of ``request``'s objects until its reconcile in progress ends (False when
        none is, or ``ignore_own_writes`` is off: then it is queued now)."""
        running = self._running.get(request)
        if running is None:
            return False
        running.held.append((resource, old, new))
        return True

    async def _reconcile(self, request: Request) -> Result:
        """Run the reconciler; with ``ignore_own_writes``, record its writes and queue the request
        again at the end only for a change they do not explain. The queue holds the request as
        being processed until the worker is done, so that add marks it to run once more."""
        if not self.options.ignore_own_writes:
            return await self._run_reconciler(request)
        running = self._running[request] = _Running()
        try:
            with recording(running.writes):
                return await self._run_reconciler(request)
        finally:
            del self._running[request]
            if running.unexplained():
                self.queue.add(request)
            elif running.held:
                self.own_writes_dropped += 1

    async def _run_reconciler(self, request: Request) -> Result:
        if self.options.reconcile_timeout > 0:
            async with asyncio.timeout(self.options.reconcile_timeout):
                return await self.reconciler.reconcile(request)
        return await self.reconciler.reconcile(request)

    def _requeue(self, request: Request, result: Result) -> str:
        if result.requeue_after > 0:
            self.queue.forget(request)
            self.queue.add_after(request, result.requeue_after)
            return "requeue_after"
        if result.requeue:
            self.queue.add_rate_limited(request)
            return "requeue"
        self.queue.forget(request)
        return "success"

    def _set_active(self, delta: int) -> None:
        self._active += delta
        if self._metrics:
            self._metrics.active_workers(self.name, self._active)

    def _count_error(self, *, terminal: bool = False, timeout: bool = False) -> None:
        if self._metrics:
            self._metrics.errored(self.name, terminal=terminal, timeout=timeout)


def _check_watch(controller: str, method: str, resource: object, predicates: Sequence[object]) -> None:
    """Refuse a wrong argument while the controller is being set up.

    Predicates are only called when events arrive, so a Resource passed where a predicate
    belongs (``owns(CONFIG_MAP, WIDGET)`` meaning the owner) would otherwise fail on every event
    of that kind, in the informer's handler, long after setup.
    """
    if not isinstance(resource, Resource):
        raise TypeError(f"controller {controller}: {method}() takes a Resource first, not {resource!r}")
    for index, predicate in enumerate(predicates, start=1):
        if isinstance(predicate, Resource):
            hint = " (the owner kind goes in owner=...)" if method == "owns" else ""
            raise TypeError(f"controller {controller}: {method}({resource}, ...): predicate {index} is the "
                            f"Resource {predicate}, not a Predicate{hint}")
        missing = [m for m in ("create", "update", "delete") if not callable(getattr(predicate, m, None))]
        if missing:
            raise TypeError(f"controller {controller}: {method}({resource}, ...): predicate {index} "
                            f"({predicate!r}) is not a Predicate: it has no {', '.join(missing)}()")


def _expected(exc: Exception) -> bool:
    """API and transport errors are routine and logged without a traceback."""
    return isinstance(exc, KubeError)


__all__ = [
    "APISERVER_WORKERS",
    "DEFAULT_WORKERS",
    "Controller",
    "ControllerOptions",
    "Mapper",
    "Reconciler",
    "Request",
    "Result",
    "TerminalError",
    "owner_mapper",
    "request_for",
    "self_mapper",
]
