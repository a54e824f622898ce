"""The operator's own metrics, beside the controller-runtime families of :mod:`runtime.metrics`.

* ``tailnet_operator_build_info{version,revision,python_version}``: always 1.
* :class:`HeadscaleMetrics`: requests to the Headscale API, their duration and their errors, by
  method and path, with IDs in the path replaced by ``{id}`` so the label set stays bounded.
* :class:`StateCollector`: computed at each scrape from the shared cache, like
  kube-state-metrics: a state-set gauge per object and condition, the reason of each condition,
  and the expiry of every working API key and pre-auth key the operator recorded in status. The
  standby replica has synced caches too, so both replicas export the same state.

Everything registers on the manager's registry; nothing touches the global one.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tailnet_operator import __version__
from tailnet_operator.types import JSON

__all__ = [
    "CONDITION_STATUSES",
    "HEADSCALE_DURATION_BUCKETS",
    "HeadscaleMetrics",
    "StateCollector",
    "normalize_path",
    "register_build_info",
]

CONDITION_STATUSES = ("True", "False", "Unknown")

HEADSCALE_DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; one attempt, connect to last byte (the client's timeout is 10 s)."""

_VERBS = frozenset({"expire", "check"})


def register_build_info(registry: CollectorRegistry, *, revision: str | None = None) -> Gauge:
    """``tailnet_operator_build_info`` = 1, labelled with the version, revision and Python version.

    The revision comes from ``TAILNET_OPERATOR_REVISION`` (set at image build time) or is ``unknown``.
    """
    gauge = Gauge("tailnet_operator_build_info",
                  "Always 1; the labels name the running version, its source revision and the Python version.",
                  ("version", "revision", "python_version"), registry=registry)
    gauge.labels(__version__, revision or os.environ.get("TAILNET_OPERATOR_REVISION", "unknown"),
                 platform.python_version()).set(1)
    return gauge


def normalize_path(path: str) -> str:
    """``/api/v1/node/17/routes?x=1`` -> ``/api/v1/node/{id}/routes``: a bounded label value."""
    parts = path.split("?", 1)[0].split("/")
    if len(parts) > 4 and parts[4] and parts[4] not in _VERBS:
        parts[4] = "{id}"
    return "/".join(parts)


@final
class HeadscaleMetrics:
    """``tailnet_operator_headscale_requests_total``, ``..._request_duration_seconds`` and
    ``..._request_errors_total``; a :class:`~tailnet_operator.headscale.RequestObserver`.

    An error is an attempt with no HTTP answer (code ``<error>``) or a non-2xx answer; retries
    are attempts of their own.
    """

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self._requests = Counter("tailnet_operator_headscale_requests_total",
                                 "Attempts of requests to the Headscale API, by method, path and status code "
                                 "(<error> when no answer came back).",
                                 ("method", "path", "code"), registry=registry)
        self._duration = Histogram("tailnet_operator_headscale_request_duration_seconds",
                                   "Seconds per attempt of a request to the Headscale API.",
                                   ("method", "path"), buckets=HEADSCALE_DURATION_BUCKETS, registry=registry)
        self._errors = Counter("tailnet_operator_headscale_request_errors_total",
                               "Attempts to the Headscale API that got no answer or a non-2xx answer.",
                               ("method", "path"), registry=registry)

    def request_done(self, *, method: str, path: str, code: str, seconds: float) -> None:
        label = normalize_path(path)
        self._requests.labels(method, label, code).inc()
        self._duration.labels(method, label).observe(seconds)
        if not code.startswith("2"):
            self._errors.labels(method, label).inc()


Lister = Callable[[str], Sequence[JSON]]
"""Lists the cached objects of one kind (by kind name); raises when that kind is not cached."""


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@final
class StateCollector(Collector):
    """State of the project's objects, read from the cache at scrape time.

    ``kinds`` are the kinds to report; ``lister(kind)`` returns their cached objects.
    """

    def __init__(self, lister: Lister, kinds: Iterable[str]) -> None:
        self._lister = lister
        self._kinds = tuple(kinds)

    def _objects(self) -> Iterator[tuple[str, JSON]]:
        for kind in self._kinds:
            try:
                objects = self._lister(kind)
            except Exception:  # not cached (yet): report nothing rather than fail the scrape
                continue
            for obj in objects:
                yield kind, obj

    def collect(self) -> Iterator[Metric]:
        condition = GaugeMetricFamily(
            "tailnet_operator_resource_condition",
            "State-set of each condition of each object: 1 for its current status, 0 for the other two.",
            labels=("kind", "namespace", "name", "condition", "status"))
        reason = GaugeMetricFamily(
            "tailnet_operator_resource_condition_reason",
            "1 for the current reason of each condition of each object.",
            labels=("kind", "namespace", "name", "condition", "reason"))
        working_key = GaugeMetricFamily(
            "tailnet_operator_working_key_expiry_timestamp_seconds",
            "Unix time at which the Tailnet's working Headscale API key expires (rotated at half its lifetime).",
            labels=("tailnet",))
        preauth_key = GaugeMetricFamily(
            "tailnet_operator_preauth_key_expiry_timestamp_seconds",
            "Unix time at which the agent's pre-auth key expires (rotated at half its lifetime).",
            labels=("kind", "namespace", "name"))
        for kind, obj in self._objects():
            meta = obj.get("metadata") or {}
            namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
            status = obj.get("status") or {}
            for cond in status.get("conditions") or []:
                ctype, current = str(cond.get("type", "")), str(cond.get("status", "Unknown"))
                for value in CONDITION_STATUSES:
                    condition.add_metric([kind, namespace, name, ctype, value], 1.0 if current == value else 0.0)
                reason.add_metric([kind, namespace, name, ctype, str(cond.get("reason") or "")], 1.0)
            if kind == "Tailnet":
                expires = _timestamp((status.get("apiKey") or {}).get("expiresAt"))
                if expires is not None:
                    working_key.add_metric([name], expires)
            else:
                expires = _timestamp((status.get("preAuthKey") or {}).get("expiresAt"))
                if expires is not None:
                    preauth_key.add_metric([kind, namespace, name], expires)
        yield from (condition, reason, working_key, preauth_key)

    def describe(self) -> Iterator[Metric]:
        return iter(())
