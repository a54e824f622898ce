"""Prometheus metrics of the runtime, with the names, types, labels and buckets controller-runtime uses.

Every metric family is registered on an explicit `CollectorRegistry`, so each test can use its own.
Importing this module calls `prometheus_client.disable_created_metrics()`: Go clients expose no
`*_created` series, and dashboards written for controller-runtime should see the same set here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "QUEUE_DURATION_BUCKETS",
    "RECONCILE_TIME_BUCKETS",
    "ControllerMetrics",
    "QueueMetrics",
    "RestClientMetrics",
    "WorkqueueMetrics",
]

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# -------------------------------------------------------------------------------------------------
# Workqueue
# -------------------------------------------------------------------------------------------------

QUEUE_DURATION_BUCKETS: tuple[float, ...] = (
    1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0,
)  # fmt: skip
"""Seconds; Go's `prometheus.ExponentialBuckets(10e-9, 10, 12)`, 10 ns to 1000 s."""

_QUEUE_LABELS = ("name", "controller")


@final
@dataclass(frozen=True)
class QueueMetrics:
    """The series of one named queue; what a workqueue records into.

    depth is the number of keys waiting to be handed out (client-go counts a key that was re-added
    while it is being processed, too); durations and ages are in seconds.
    """

    depth: Gauge
    adds: Counter
    queue_duration: Histogram
    work_duration: Histogram
    unfinished_work: Gauge
    longest_running_processor: Gauge
    retries: Counter


@final
class WorkqueueMetrics:
    """The `workqueue_*` metric families, registered once per registry.

    Create one per registry and call `for_queue()` for each controller's queue.
    """

    def __init__(self, *, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, _QUEUE_LABELS, registry=registry, buckets=QUEUE_DURATION_BUCKETS)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = _QUEUE_LABELS) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _QUEUE_LABELS, registry=registry)

        self._depth = gauge(
            "workqueue_depth",
            "Keys waiting in the workqueue, by queue and priority.",
            (*_QUEUE_LABELS, "priority"),
        )
        self._adds = counter("workqueue_adds_total", "Adds that put a key into the workqueue.")
        self._queue_duration = histogram(
            "workqueue_queue_duration_seconds",
            "Seconds a key waits in the workqueue before a worker takes it.",
        )
        self._work_duration = histogram(
            "workqueue_work_duration_seconds", "Seconds a worker spends on a key taken from the workqueue."
        )
        self._unfinished_work = gauge(
            "workqueue_unfinished_work_seconds",
            "Seconds of in-progress work not yet in work_duration; steady growth means stuck workers.",
        )
        self._longest_running_processor = gauge(
            "workqueue_longest_running_processor_seconds",
            "Seconds the oldest in-progress key has been worked on.",
        )
        self._retries = counter(
            "workqueue_retries_total", "Keys handed to the workqueue through AddAfter or a rate-limited add."
        )

    def for_queue(self, name: str) -> QueueMetrics:
        """The series for the queue `name`, created at zero so they are visible before the first add.

        Both the `name` and `controller` labels are `name` (controller-runtime names the queue after
        the controller); `priority` is "" because this is the classic queue without priorities.
        Two queues with the same name share their series.
        """
        labels = {"name": name, "controller": name}
        return QueueMetrics(
            depth=self._depth.labels(priority="", **labels),
            adds=self._adds.labels(**labels),
            queue_duration=self._queue_duration.labels(**labels),
            work_duration=self._work_duration.labels(**labels),
            unfinished_work=self._unfinished_work.labels(**labels),
            longest_running_processor=self._longest_running_processor.labels(**labels),
            retries=self._retries.labels(**labels),
        )


# -------------------------------------------------------------------------------------------------
# Controllers
# -------------------------------------------------------------------------------------------------

RECONCILE_TIME_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0, 25.0, 30.0,
    40.0, 50.0, 60.0,
)  # fmt: skip
"""Seconds; controller-runtime's buckets for `controller_runtime_reconcile_time_seconds`."""


@final
class ControllerMetrics:
    """The `controller_runtime_*` families plus the workqueue families, on one registry."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        labels = ("controller",)
        self._workqueue = WorkqueueMetrics(registry=registry)
        self._total = Counter("controller_runtime_reconcile_total",
                              "Reconciles per controller and result (success, error, requeue, requeue_after).",
                              ("controller", "result"), registry=registry)
        self._errors = Counter("controller_runtime_reconcile_errors_total",
                               "Reconciles that raised.", labels, registry=registry)
        self._terminal = Counter("controller_runtime_terminal_reconcile_errors_total",
                                 "Reconciles that raised a TerminalError (not retried).", labels,
                                 registry=registry)
        self._panics = Counter("controller_runtime_reconcile_panics_total",
                               "Reconciles that crashed the worker; always 0 here: workers survive every "
                               "exception, counted as errors.", labels, registry=registry)
        self._timeouts = Counter("controller_runtime_reconcile_timeouts_total",
                                 "Reconciles cancelled by the reconcile timeout.", labels, registry=registry)
        self._time = Histogram("controller_runtime_reconcile_time_seconds", "Seconds per reconcile.",
                               labels, buckets=RECONCILE_TIME_BUCKETS, registry=registry)
        self._max = Gauge("controller_runtime_max_concurrent_reconciles",
                          "Workers per controller.", labels, registry=registry)
        self._active = Gauge("controller_runtime_active_workers",
                             "Workers reconciling right now.", labels, registry=registry)
        self._last_success = Gauge("tailnet_operator_controller_last_success_timestamp_seconds",
                                   "Unix time of the controller's last reconcile that did not raise.",
                                   labels, registry=registry)

    def queue(self, name: str) -> QueueMetrics:
        return self._workqueue.for_queue(name)

    def max_concurrent(self, controller: str, workers: int) -> None:
        self._max.labels(controller).set(workers)
        for result in ("success", "error", "requeue", "requeue_after"):
            self._total.labels(controller, result)
        for family in (self._errors, self._terminal, self._panics, self._timeouts):
            family.labels(controller)

    def active_workers(self, controller: str, count: int) -> None:
        self._active.labels(controller).set(count)

    def reconciled(self, controller: str, result: str, seconds: float, *, at: float | None = None) -> None:
        """One reconcile ended with ``result``; ``at`` (Unix time) marks a success that did not raise."""
        self._total.labels(controller, result).inc()
        self._time.labels(controller).observe(seconds)
        if at is not None and result != "error":
            self._last_success.labels(controller).set(at)

    def errored(self, controller: str, *, terminal: bool = False, timeout: bool = False) -> None:
        self._errors.labels(controller).inc()
        if terminal:
            self._terminal.labels(controller).inc()
        if timeout:
            self._timeouts.labels(controller).inc()


# -------------------------------------------------------------------------------------------------
# REST client
# -------------------------------------------------------------------------------------------------


@final
class RestClientMetrics:
    """`rest_client_requests_total{code,method,host}`; code is `<error>` when no answer came."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self._requests = Counter("rest_client_requests_total",
                                 "HTTP requests to kube-apiserver, by status code, method and host.",
                                 ("code", "method", "host"), registry=registry)

    def request_done(self, *, code: str, method: str, host: str) -> None:
        self._requests.labels(code, method, host).inc()
