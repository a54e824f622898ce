"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's protocol.

The protocol (client-go `tools/leaderelection`):

* **Campaign.** Every `retry_period` seconds, jittered up to +120 %, try to take the Lease:
  create it when it is missing; leave it alone while another holder is current; otherwise
  write ourselves in with a PUT carrying the resourceVersion, so one of several racing
  candidates wins and the others get 409.
* **Current** means `observed_time + lease_duration > now`, where `observed_time` is *our*
  monotonic clock reading when *we* last saw the Lease spec change. The holder's `renewTime` is
  never compared with our clock, so clock skew between hosts does not matter.
* **Lead.** Renew every `retry_period` seconds, first with a blind PUT on the last version we
  wrote (the fast path), then with GET + PUT (the slow path). Renewal attempts are retried
  for at most `renew_deadline` seconds; after that, or as soon as another holder is seen in
  the Lease, leadership is lost: `wait_lost()` returns and `run()` returns.
* **Release.** When `run()` is cancelled while leading, the Lease is written with an empty
  holder and `leaseDurationSeconds: 1`, so a standby takes over within one retry period
  instead of a full lease duration.

This gives no fencing: a paused leader can act for up to `lease_duration` after it was
replaced. Whoever runs `run()` must stop working the moment `wait_lost()` returns.
"""

from __future__ import annotations

import asyncio
import copy
import random
import socket
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Protocol, final

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from tailnet_operator.types import JSON

from .clock import Clock, RealClock
from .errors import KubeError, NotFound
from .kinds import LEASE, Resource

__all__ = [
    "ElectionMetrics",
    "LeaderElectionConfig",
    "LeaderElectionMetrics",
    "LeaderElectionUnhealthy",
    "LeaderElector",
    "LeaseRecord",
    "default_identity",
]


JITTER_FACTOR = 1.2
"""Campaign waits are `retry_period * (1 + random() * JITTER_FACTOR)` seconds, as client-go's."""

log = structlog.get_logger("leaderelection")


def default_identity() -> str:
    """`<hostname>_<uuid4>`, controller-runtime's identity: unique even for two processes per pod."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


# -------------------------------------------------------------------------------------------------
# Configuration and the Lease record
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LeaderElectionConfig:
    """Timings of the election; every default is controller-runtime's unless noted.

    Raises ValueError unless `lease_duration > renew_deadline > 1.2 * retry_period > 0`.
    """

    lease_duration: float = 15.0
    """Seconds a standby waits after it last saw the Lease change before it takes over."""
    renew_deadline: float = 10.0
    """Seconds the leader keeps retrying a renewal before it gives leadership up."""
    retry_period: float = 2.0
    """Seconds between renewals and (plus jitter) between campaign attempts."""
    identity: str = field(default_factory=default_identity)
    """This candidate's holderIdentity; default `<hostname>_<uuid4>`."""
    release_on_cancel: bool = True
    """Release the Lease when `run()` is cancelled while leading. controller-runtime defaults to
    False; here the manager cancels the elector only after its controllers have stopped."""
    health_tolerance: float = 20.0
    """Seconds past `lease_duration` without a renewal before `check_health` fails (the value
    kube-controller-manager gives client-go's HealthzAdaptor)."""

    def __post_init__(self) -> None:
        if self.retry_period <= 0:
            raise ValueError("retry_period must be positive")
        if self.renew_deadline <= JITTER_FACTOR * self.retry_period:
            raise ValueError("renew_deadline must be greater than 1.2 * retry_period")
        if self.lease_duration <= self.renew_deadline:
            raise ValueError("lease_duration must be greater than renew_deadline")
        if not self.identity:
            raise ValueError("identity must not be empty")

    @property
    def request_timeout(self) -> float:
        """Seconds one API request may take: `max(renew_deadline / 2, 1)`, as controller-runtime's
        leader-election client, so one hung request cannot eat the whole renew deadline."""
        return max(self.renew_deadline / 2, 1.0)


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of a Lease spec; times are MicroTime strings (RFC 3339, µs, UTC)."""

    holder_identity: str
    lease_duration_seconds: int
    acquire_time: str | None
    renew_time: str | None
    lease_transitions: int

    @classmethod
    def from_spec(cls, spec: JSON) -> LeaseRecord:
        return cls(
            holder_identity=str(spec.get("holderIdentity") or ""),
            lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            lease_transitions=int(spec.get("leaseTransitions") or 0),
        )

    def to_spec(self) -> JSON:
        spec: JSON = {
            "holderIdentity": self.holder_identity,
            "leaseDurationSeconds": self.lease_duration_seconds,
            "leaseTransitions": self.lease_transitions,
        }
        if self.acquire_time is not None:
            spec["acquireTime"] = self.acquire_time
        if self.renew_time is not None:
            spec["renewTime"] = self.renew_time
        return spec


_NO_RECORD = LeaseRecord("", 0, None, None, 0)


class LeaseClient(Protocol):
    """The part of the API client leader election needs (``Client`` is one; tests pass a fake)."""

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON: ...

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON: ...

    async def replace(self, resource: Resource, body: JSON) -> JSON: ...


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime: `2026-11-29T13:45:00.123456Z`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -------------------------------------------------------------------------------------------------
# Metrics
# -------------------------------------------------------------------------------------------------


class ElectionMetrics(Protocol):
    """What the elector records; `LeaderElectionMetrics` is the Prometheus implementation."""

    def set_leading(self, name: str, leading: bool) -> None: ...

    def slowpath(self, name: str) -> None: ...


@final
class LeaderElectionMetrics:
    """`leader_election_master_status{name}` (1 while leading) and
    `leader_election_slowpath_total{name}` (renewals that needed a GET), as client-go's.

    Registers both families on `registry`: create one per registry and share it between electors.
    """

    def __init__(self, *, registry: CollectorRegistry) -> None:
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self._status = Gauge("leader_election_master_status",
                             "1 while this process holds the named Lease, 0 otherwise.",
                             ["name"], registry=registry)
        self._slowpath = Counter("leader_election_slowpath_total",
                                 "Renewals that fell back to GET + PUT because the blind PUT failed.",
                                 ["name"], registry=registry)

    def set_leading(self, name: str, leading: bool) -> None:
        self._status.labels(name=name).set(1 if leading else 0)
        self._slowpath.labels(name=name)  # scraped at 0 before the first slow path

    def slowpath(self, name: str) -> None:
        self._slowpath.labels(name=name).inc()


class _NoMetrics:
    def set_leading(self, name: str, leading: bool) -> None:
        pass

    def slowpath(self, name: str) -> None:
        pass


class LeaderElectionUnhealthy(RuntimeError):
    """We hold the Lease on record but have not renewed it for too long (deadlock, partition)."""


# -------------------------------------------------------------------------------------------------
# The elector
# -------------------------------------------------------------------------------------------------


@final
class LeaderElector:
    """Campaigns for, holds and releases the Lease `namespace/name` (see the module doc).

    Usage: run `run()` as a task, `await wait_leading()` before starting work, and stop that
    work the moment `wait_lost()` returns. Cancel `run()` to step down gracefully.
    """

    def __init__(self, client: LeaseClient, *, name: str, namespace: str,
                 config: LeaderElectionConfig | None = None, metrics: ElectionMetrics | None = None,
                 clock: Clock | None = None) -> None:
        self.name = name
        self.namespace = namespace
        self.config = config or LeaderElectionConfig()
        self._client = client
        self._metrics: ElectionMetrics = metrics or _NoMetrics()
        self._metrics.set_leading(name, False)  # the series exist from the start
        self._clock: Clock = clock or RealClock()
        self._lease: JSON | None = None  # the last Lease object read or written, for its resourceVersion
        self._observed_spec: JSON | None = None
        self._observed = _NO_RECORD
        self._observed_time = 0.0
        self._reported_leader = ""
        self._leading = asyncio.Event()
        self._lost = asyncio.Event()
        self._log = log.bind(lease=f"{namespace}/{name}", identity=self.config.identity)

    # -- public state ---------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        return self.config.identity

    @property
    def is_leader(self) -> bool:
        """True from acquiring the Lease until losing or releasing it."""
        return self._leading.is_set()

    @property
    def leader(self) -> str:
        """The holder we last observed in the Lease; "" when none or not yet read."""
        return self._observed.holder_identity

    async def wait_leading(self) -> None:
        """Return once this candidate leads (at once if it already does)."""
        await self._leading.wait()

    async def wait_lost(self) -> None:
        """Return once leadership, after being acquired, was lost (not released)."""
        await self._lost.wait()

    def check_health(self) -> None:
        """A /healthz check: raises when the Lease names us but we have not renewed it for
        `lease_duration + health_tolerance` seconds (client-go's HealthzAdaptor). Standbys pass."""
        if not self._holds_record():
            return
        since = self._clock.now() - self._observed_time
        if since > self.config.lease_duration + self.config.health_tolerance:
            raise LeaderElectionUnhealthy(
                f"lease {self.namespace}/{self.name} not renewed for {since:.1f}s")

    def check_ready(self) -> None:
        """A /readyz check: raises when the Lease names us but we have not renewed it for longer
        than `renew_deadline`, when the leader gives up by its own rule and a standby may soon
        take over. A standby passes: it is a warm spare (caches synced) ready to lead, which the
        PodDisruptionBudget and the Deployment's availability count on (docs/decisions.md)."""
        if not self._holds_record():
            return
        since = self._clock.now() - self._observed_time
        if since > self.config.renew_deadline:
            raise LeaderElectionUnhealthy(
                f"leading on lease {self.namespace}/{self.name} but not renewed for {since:.1f}s")

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, then lead until leadership is lost; returns only then (after `wait_lost()`
        fires). Cancelling it stops the campaign or steps down, releasing the Lease if
        `release_on_cancel`; the release is shielded from a second cancellation."""
        try:
            await self._acquire()
            self._became_leader()
            await self._renew_until_lost()
        except asyncio.CancelledError:
            if self._leading.is_set() and self.config.release_on_cancel:
                await self._release_shielded()
            raise
        finally:
            self._leading.clear()
            self._metrics.set_leading(self.name, False)
        self._lost.set()

    async def _acquire(self) -> None:
        self._log.info("attempting to acquire the lease")
        while not await self._try_acquire_or_renew():
            self._report_transition()
            await self._clock.sleep(self.config.retry_period * (1 + random.random() * JITTER_FACTOR))

    def _became_leader(self) -> None:
        self._report_transition()
        self._leading.set()
        self._metrics.set_leading(self.name, True)
        self._log.info("acquired the lease", transitions=self._observed.lease_transitions)

    async def _renew_until_lost(self) -> None:
        while await self._renew_within_deadline():
            await self._clock.sleep(self.config.retry_period)
        self._report_transition()
        self._leading.clear()
        self._metrics.set_leading(self.name, False)
        self._log.warning("lost the lease", holder=self._observed.holder_identity)

    async def _renew_within_deadline(self) -> bool:
        """Retry renewing every retry_period for at most renew_deadline seconds.

        Gives up early once the Lease names someone else: they hold it for a full lease
        duration, which is longer than the deadline, so retrying cannot succeed.
        """
        try:
            async with asyncio.timeout(self.config.renew_deadline):
                while not await self._try_acquire_or_renew():
                    if not self._holds_record():
                        return False
                    await self._clock.sleep(self.config.retry_period)
                return True
        except TimeoutError:
            self._log.warning("could not renew within the deadline", deadline=self.config.renew_deadline)
            return False

    # -- one attempt ----------------------------------------------------------------------------

    async def _try_acquire_or_renew(self) -> bool:
        """One attempt to take or renew the Lease; True when the Lease now names us."""
        now = micro_time(self._clock.utcnow())
        ours = LeaseRecord(self.identity, max(1, int(self.config.lease_duration)), now, now, 0)
        if self._holds_record() and self._lease_current() and self._lease is not None:
            fast = replace(ours, acquire_time=self._observed.acquire_time,
                           lease_transitions=self._observed.lease_transitions)
            if await self._write(fast, create=False):
                return True
            self._metrics.slowpath(self.name)
            self._log.info("blind renewal failed, reading the lease")
        try:
            lease = await self._request(self._client.get(LEASE, self.name, self.namespace))
        except NotFound:
            return await self._write(ours, create=True)
        except (KubeError, TimeoutError) as exc:
            self._log.warning("could not read the lease", error=str(exc) or type(exc).__name__)
            return False
        self._observe(lease)
        if self._observed.holder_identity and self._lease_current() and not self._holds_record():
            return False
        if self._holds_record():
            ours = replace(ours, acquire_time=self._observed.acquire_time,
                           lease_transitions=self._observed.lease_transitions)
        else:
            ours = replace(ours, lease_transitions=self._observed.lease_transitions + 1)
        return await self._write(ours, create=False)

    async def _write(self, record: LeaseRecord, *, create: bool) -> bool:
        """Create the Lease, or PUT it on the resourceVersion last seen; True on success."""
        try:
            if create:
                body: JSON = {"apiVersion": LEASE.api_version, "kind": LEASE.kind,
                              "metadata": {"name": self.name, "namespace": self.namespace},
                              "spec": record.to_spec()}
                stored = await self._request(self._client.create(LEASE, body, self.namespace))
            else:
                assert self._lease is not None
                body = copy.deepcopy(self._lease)
                body["spec"] = {**body.get("spec", {}), **record.to_spec()}
                stored = await self._request(self._client.replace(LEASE, body))
        except (KubeError, TimeoutError) as exc:
            self._log.info("could not write the lease", create=create, error=str(exc) or type(exc).__name__)
            return False
        self._observe(stored)
        return True

    async def _request(self, awaitable: Awaitable[JSON]) -> JSON:
        async with asyncio.timeout(self.config.request_timeout):
            result: JSON = await awaitable
            return result

    def _observe(self, lease: JSON) -> None:
        """Remember the Lease; restart the expiry clock only when its spec changed."""
        self._lease = lease
        spec = lease.get("spec") or {}
        if spec != self._observed_spec:
            self._observed_spec = spec
            self._observed = LeaseRecord.from_spec(spec)
            self._observed_time = self._clock.now()

    def _holds_record(self) -> bool:
        return self._observed.holder_identity == self.identity

    def _lease_current(self) -> bool:
        return self._observed_time + self.config.lease_duration > self._clock.now()

    def _report_transition(self) -> None:
        holder = self._observed.holder_identity
        if holder != self._reported_leader:
            self._reported_leader = holder
            self._log.info("new leader observed", holder=holder or None)

    # -- release --------------------------------------------------------------------------------

    async def _release_shielded(self) -> None:
        task = asyncio.ensure_future(self._release())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self._log.warning("cancelled again while releasing; the release continues in the background")

    async def _release(self) -> None:
        """Write an empty holder with leaseDurationSeconds 1, but only on a Lease that still
        names us (read first: the last renewal may have landed without us seeing its answer)."""
        try:
            async with asyncio.timeout(self.config.renew_deadline):
                lease = await self._client.get(LEASE, self.name, self.namespace)
                self._observe(lease)
                if not self._holds_record():
                    return
                now = micro_time(self._clock.utcnow())
                released = LeaseRecord("", 1, now, now, self._observed.lease_transitions)
                body = copy.deepcopy(lease)
                body["spec"] = {**body.get("spec", {}), **released.to_spec()}
                self._observe(await self._client.replace(LEASE, body))
        except (KubeError, TimeoutError) as exc:
            self._log.warning("could not release the lease; it expires on its own",
                              error=str(exc) or type(exc).__name__)
            return
        self._log.info("released the lease")
