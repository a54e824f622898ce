"""Agent disruptions under continuous load, shared by ``e2e/test_agent_disruption.py`` (the claims)
and ``benchmarks/disruption.py`` (the table).

A load sends short requests one after another, a new connection each, every :data:`INTERVAL`
seconds with a :data:`DEADLINE` each: egress from a client pod in a consumer namespace to a site
host through the egress target's Service; ingress from a tailscaled "laptop" on the host to an
http expose (HTTPS, certificate from a Secret) and a tcp expose, by the ingress's MagicDNS name.
A disruption is applied while the load runs and waited for by its conditions (the Deployment
settled, the key rotated, Headscale healthy); the load then runs until :data:`SETTLE` requests in
a row after the disruption succeeded, and stops.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime as dt
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from e2e.cluster import (
    EGRESSES,
    HOSTS,
    HTTP_SERVER,
    INGRESSES,
    OPEN_BASE,
    SITES,
    SLEEPER,
    TAILNETS,
    ClusterUnderTest,
    PythonSession,
    admit_tenant,
    apply,
    condition,
    get_json,
    kubectl,
    namespace,
    operator_logs,
    python_pod,
    remove_tailnet,
    wait_pod_running,
)
from e2e.operator import tailnet_object
from hack.https_client import request, tunnel
from hack.localenv import Headscale, SiteHost, TailscaleNode, wait_until
from hack.localenv._pki import CertificateAuthority
from tailnet_operator.resources.ingress import record_name

INTERVAL = 0.02
"""Seconds from the start of one request to the start of the next (when the first took less)."""
DEADLINE = 2.0
"""A request answered later than this is lost."""
WARM = 10
"""Requests in a row that succeed before a disruption is applied."""
SETTLE = 50
"""Requests in a row that succeed after a disruption before the load stops."""
FIRST_FAILURES = 30
"""Failed requests a stream keeps the time and error of."""
ZONE = "disrupt.e2e.internal"
WEB_PORT, ECHO_PORT = 8080, 9000
OPERATOR_DEPLOYMENT = "tailnet-operator"
OPERATOR_PODS = "app.kubernetes.io/name=tailnet-operator,app.kubernetes.io/component=controller-manager"


# -- what a load measured ---------------------------------------------------------------------

Sample = tuple[float, float, bool]
"""(start, end, answered in time) of one request, in seconds on the load's clock."""


@dataclass
class Tally:
    sent: int
    lost: int
    longest_gap_s: float
    """The longest time between two successful answers (from the load's start and to its end)."""
    how: dict[str, int] = field(default_factory=dict)
    """How the lost requests failed, where the load tells (the ingress load: :data:`HUNG`, the
    error's type, ``wrong answer``); a request answered in time but past the deadline is ``late``."""
    failures: list[str] = field(default_factory=list)
    """The first failed requests, each with when it started (on the load's clock, ``time.monotonic``)
    and its error (an OSError with its errno's name, as ``OSError EHOSTUNREACH``)."""


def tally(samples: list[Sample], failures: Mapping[str, int] | None = None,
          first_failures: Sequence[str] = ()) -> Tally:
    if not samples:
        return Tally(0, 0, 0.0)
    done = sorted(end for _, end, ok in samples if ok)
    edges = [samples[0][0], *done, max(end for _, end, _ in samples)]
    gap = max((b - a for a, b in itertools.pairwise(edges)), default=0.0)
    lost = sum(1 for *_, ok in samples if not ok)
    how = {k: v for k, v in (failures or {}).items() if v}
    if how and (late := lost - sum(how.values())) > 0:
        how["late"] = late
    return Tally(len(samples), lost, round(gap, 3), how, list(first_failures))


def streak(samples: list[Sample]) -> int:
    """Successful requests at the end, in a row."""
    count = 0
    for *_, ok in reversed(samples):
        if not ok:
            break
        count += 1
    return count


class Load(Protocol):
    def streak(self) -> int:
        """The fewest successful requests in a row at the end, over the load's streams."""
    def sent(self) -> int: ...
    def stop(self) -> dict[str, Tally]:
        """Stop and tally each stream."""


# -- egress: a client pod ---------------------------------------------------------------------

EGRESS_LOAD = """
import errno, json, socket, sys, threading, time
host, port, interval, deadline, keep = {host!r}, {port}, {interval}, {deadline}, {keep}
samples, failures, first, stop = [], {{}}, [], threading.Event()

def one():
    start = time.monotonic()
    how = None
    try:
        with socket.create_connection((host, port), timeout=deadline) as conn:
            conn.sendall(b"GET /load HTTP/1.0\\r\\nHost: load\\r\\n\\r\\n")
            data = b""
            while time.monotonic() - start < deadline:
                conn.settimeout(max(0.001, deadline - (time.monotonic() - start)))
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            if not (data.startswith(b"HTTP/1.0 200") and data.endswith(b"path /load\\n")):
                how = "wrong answer"
    except socket.timeout:
        how = "hung"
    except OSError as exc:
        how = type(exc).__name__
        if exc.errno in errno.errorcode:
            how += " " + errno.errorcode[exc.errno]
        if len(first) < keep:
            first.append(f"{{start:.3f}} {{how}}: {{exc}}"[:300])
    end = time.monotonic()
    if how is None and end - start > deadline:
        how = "late"
    if how is not None:
        failures[how] = failures.get(how, 0) + 1
    samples.append((round(start, 4), round(end, 4), how is None))
    time.sleep(max(0.0, start + interval - time.monotonic()))

def run():
    while not stop.is_set():
        one()

worker = threading.Thread(target=run)
worker.start()
for line in sys.stdin:
    if line.strip() == "stop":
        stop.set()
        worker.join()
        print(json.dumps({{"samples": samples, "failures": failures, "first": first}}), flush=True)
        break
    streak = 0
    for s in reversed(samples[:]):
        if not s[2]:
            break
        streak += 1
    print(json.dumps([len(samples), streak]), flush=True)
"""


class EgressLoad:
    """HTTP GETs from the consumer's client pod through the target's Service."""

    def __init__(self, cluster: ClusterUnderTest, consumer: str, pod: str, host: str, port: int) -> None:
        code = EGRESS_LOAD.format(host=host, port=port, interval=INTERVAL, deadline=DEADLINE,
                                  keep=FIRST_FAILURES)
        self.session = PythonSession(cluster, consumer, pod, code)

    def _status(self) -> list[int]:
        result: list[int] = json.loads(self.session.ask("status"))
        return result

    def streak(self) -> int:
        return self._status()[1]

    def sent(self) -> int:
        return self._status()[0]

    def stop(self) -> dict[str, Tally]:
        try:
            answer = json.loads(self.session.ask("stop", 60))
        finally:
            self.session.close()
        samples = [(float(a), float(b), bool(ok)) for a, b, ok in answer["samples"]]
        return {"http": tally(samples, answer["failures"], answer["first"])}


# -- ingress: a laptop on the host ------------------------------------------------------------

HUNG = "hung"
"""An ingress request with no answer within the deadline: its SYN dropped, as the agent's TCP stack did
to a SYN from a source port whose old connection it held in TIME-WAIT until it let such a SYN end the
TIME-WAIT (docs/decisions.md, "No request hangs on a source port the agent closed first")."""


CUT = ("IncompleteReadError", "ConnectionResetError", "wrong answer")
"""How a request whose connection was open when a shared address moved fails: the laptop sends its
next packets to the new replica, which knows nothing of the connection (docs/decisions.md). Through
the laptop's proxy it ends in an error, or with no or part of the answer (``wrong answer``)."""


class IngressLoad:
    """Requests from the laptop (its HTTP proxy, CONNECT by MagicDNS name) to an https expose and
    a tcp expose, each its own stream, in a thread with its own event loop."""

    def __init__(self, laptop: TailscaleNode, name: str, sni: str, ca: Path) -> None:
        self.laptop, self.name, self.sni, self.ca = laptop, name, sni, ca
        self.samples: dict[str, list[Sample]] = {"https": [], "tcp": []}
        self.failures: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in self.samples}
        """Per stream, how its failed requests failed: ``hung`` (no answer within the deadline) or the
        error's type (a refused CONNECT is a ``ConnectionError``)."""
        self.first_failures: dict[str, list[str]] = {name: [] for name in self.samples}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _https(self) -> bool:
        answer = await request(await tunnel(self.laptop.http_proxy_port, self.name, 443), ca=self.ca, sni=self.sni,
                               path="/load")
        return answer.status == 200 and b"hello from web" in answer.body

    async def _tcp(self) -> bool:
        reader, writer = await tunnel(self.laptop.http_proxy_port, self.name, WEB_PORT)
        try:
            writer.write(b"GET /load HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
        return b" 200 " in data.split(b"\r\n", 1)[0] and b"hello from web" in data

    async def _stream(self, name: str, one: Callable[[], Any]) -> None:
        samples, failures, first = self.samples[name], self.failures[name], self.first_failures[name]
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            start = loop.time()
            how = ""
            try:
                ok = bool(await asyncio.wait_for(one(), DEADLINE))
                if not ok:
                    how = "wrong answer"
            except TimeoutError:
                ok, how = False, HUNG
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                ok, how = False, type(exc).__name__
                if len(first) < FIRST_FAILURES:
                    first.append(f"{start:.3f} {how}: {exc}"[:300])
            if how:
                failures[how] += 1
                if how in (HUNG, "wrong answer") and len(first) < FIRST_FAILURES:
                    first.append(f"{start:.3f} {how}")
            end = loop.time()
            samples.append((start, end, ok and end - start <= DEADLINE))
            await asyncio.sleep(max(0.0, start + INTERVAL - loop.time()))

    async def _run(self) -> None:
        await asyncio.gather(self._stream("https", self._https), self._stream("tcp", self._tcp))

    def streak(self) -> int:
        return min(streak(list(s)) for s in self.samples.values())

    def sent(self) -> int:
        return min(len(s) for s in self.samples.values())

    def stop(self) -> dict[str, Tally]:
        self._stop.set()
        self._thread.join(timeout=DEADLINE * 3)
        return {name: tally(list(s), self.failures[name], self.first_failures[name])
                for name, s in self.samples.items()}


# -- what is disrupted ------------------------------------------------------------------------

@dataclass
class Subject:
    """An egress or ingress and its agent Deployment."""

    cluster: ClusterUnderTest
    operator_namespace: str
    namespace: str
    kind: str
    name: str
    selector: str
    deployment: str
    key_record: tuple[str, str]
    """(namespace, name) of the Secret that records the pre-auth key (its creation and expiry)."""
    hostname: str | None = None
    """Ingress only: the name its node must carry."""

    def get(self) -> dict[str, Any]:
        obj: dict[str, Any] = get_json(self.cluster, "-n", self.namespace, self.kind, self.name)
        return obj

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(self.cluster, "-n", self.namespace, "pods", "-l",
                                               self.selector)["items"]
        return items

    def replicas(self) -> int:
        return int(get_json(self.cluster, "-n", self.namespace, "deployment", self.deployment)["spec"]["replicas"])

    def settled(self) -> bool:
        """Every replica updated, ready and available, no other pod (a terminating one) left, the CR Ready."""
        deployment = get_json(self.cluster, "-n", self.namespace, "deployment", self.deployment)
        want, status = deployment["spec"]["replicas"], deployment.get("status") or {}
        if status.get("observedGeneration") != deployment["metadata"]["generation"]:
            return False
        if not all(status.get(k) == want for k in ("replicas", "updatedReplicas", "readyReplicas",
                                                   "availableReplicas")):
            return False
        pods = self.pods()
        if len(pods) != want or not all(condition(p, "Ready") == "True" for p in pods):
            return False
        return condition(self.get(), "Ready") == "True"

    def named(self) -> bool:
        """Ingress: its node's name and its MagicDNS name (both FQDNs) begin with the label
        spec.hostname, not a suffixed one (an egress: always)."""
        if self.hostname is None:
            return True
        status = self.get().get("status") or {}
        node = ((status.get("node") or {}).get("name") or "").split(".")[0]
        magic = (status.get("magicDNSName") or "").split(".")[0]
        return node == self.hostname and magic == self.hostname

    def wait_steady(self, timeout: float = 240) -> None:
        try:
            wait_until(lambda: self.settled() and self.named(), timeout=timeout,
                       what=f"{self.kind} {self.namespace}/{self.name} settled, Ready and named")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.explain()}") from exc

    def explain(self) -> str:
        """The CR's status, the namespace's objects and events, the agents' and the operator's logs."""
        status = kubectl(self.cluster, "-n", self.namespace, "get", self.kind, self.name, "-o",
                         "jsonpath={.status}", check=False)
        objects = kubectl(self.cluster, "-n", self.namespace, "get", "deployments,pods,services", "-o", "wide",
                          check=False)
        events = kubectl(self.cluster, "-n", self.namespace, "get", "events", "--sort-by=.lastTimestamp",
                         check=False)
        agents = kubectl(self.cluster, "-n", self.namespace, "logs", "-l", self.selector, "--tail=30", "--prefix",
                         check=False)
        return (f"status: {status}\n{objects}\nevents:\n{events[-3000:]}\nagent logs:\n{agents}\n"
                f"operator logs:\n{operator_logs(self.cluster, self.operator_namespace, 80)}")

    def key_id(self) -> str:
        return str(((self.get().get("status") or {}).get("preAuthKey") or {}).get("id") or "")


def age_key(cluster: ClusterUnderTest, ns: str, secret: str, hours: float) -> None:
    """Make a stored pre-auth key look ``hours`` older: its recorded creation and expiry move back,
    so the operator rotates it past half its lifetime."""
    notes = get_json(cluster, "-n", ns, "secret", secret)["metadata"]["annotations"]
    shift = dt.timedelta(hours=hours)
    created = dt.datetime.fromisoformat(notes["tailnet.dev/key-created"]) - shift
    expires = dt.datetime.fromisoformat(notes["tailnet.dev/key-expires"]) - shift
    kubectl(cluster, "-n", ns, "annotate", "--overwrite", "secret", secret,
            f"tailnet.dev/key-created={created.isoformat()}", f"tailnet.dev/key-expires={expires.isoformat()}")


def _replaced(subject: Subject, old: set[str]) -> bool:
    return subject.settled() and not old & {p["metadata"]["uid"] for p in subject.pods()}


def rollout(subject: Subject, _: Headscale) -> None:
    """``kubectl rollout restart`` of the agent Deployment; done when every old pod is gone."""
    old = {p["metadata"]["uid"] for p in subject.pods()}
    kubectl(subject.cluster, "-n", subject.namespace, "rollout", "restart", f"deployment/{subject.deployment}")
    wait_until(lambda: _replaced(subject, old), timeout=240, what="the agent rolled out, the old pods gone")


def delete_pod(subject: Subject, _: Headscale) -> None:
    """Delete one agent pod (gracefully, as an eviction would); done when its successor is ready."""
    pod = subject.pods()[0]["metadata"]
    kubectl(subject.cluster, "-n", subject.namespace, "delete", "pod", pod["name"], "--wait=false")
    wait_until(lambda: _replaced(subject, {pod["uid"]}), timeout=240, what="the deleted agent pod replaced")


def schedulable_nodes(cluster: ClusterUnderTest) -> list[str]:
    """Nodes a pod can be scheduled on: not cordoned, no NoSchedule or NoExecute taint."""
    nodes = get_json(cluster, "nodes")["items"]
    return [n["metadata"]["name"] for n in nodes if not n["spec"].get("unschedulable")
            and not any(t.get("effect") in ("NoSchedule", "NoExecute") for t in n["spec"].get("taints") or ())]


def drain_node(subject: Subject, _: Headscale) -> None:
    """``kubectl drain`` of the node an agent pod runs on, for the agent's pods (evictions, which
    its PodDisruptionBudget gates; the load's client stays); done when every agent pod of that
    node is replaced elsewhere. The node is uncordoned afterwards."""
    pods = subject.pods()
    node = pods[0]["spec"]["nodeName"]
    on_node = {p["metadata"]["uid"] for p in pods if p["spec"].get("nodeName") == node}
    kubectl(subject.cluster, "cordon", node)
    try:
        kubectl(subject.cluster, "drain", node, f"--pod-selector={subject.selector}", "--ignore-daemonsets",
                "--delete-emptydir-data", "--timeout=240s", timeout=260)
        wait_until(lambda: _replaced(subject, on_node), timeout=240, what=f"the agent pods of {node} replaced")
    finally:
        kubectl(subject.cluster, "uncordon", node, check=False)


def rotate_key(subject: Subject, _: Headscale) -> None:
    """Age the stored pre-auth key past half its lifetime; done when the CR reports a new key."""
    old = subject.key_id()
    age_key(subject.cluster, *subject.key_record, hours=13)
    wait_until(lambda: subject.key_id() not in ("", old), timeout=120, what="the pre-auth key rotated")


def restart_operator(subject: Subject, _: Headscale) -> None:
    """``kubectl rollout restart`` of the operator; done when its new pods alone are ready."""
    ns, cluster = subject.operator_namespace, subject.cluster
    before = {p["metadata"]["uid"] for p in get_json(cluster, "-n", ns, "pods", "-l",
                                                     OPERATOR_PODS)["items"]}
    kubectl(cluster, "-n", ns, "rollout", "restart", f"deployment/{OPERATOR_DEPLOYMENT}")

    def done() -> bool:
        deployment = get_json(cluster, "-n", ns, "deployment", OPERATOR_DEPLOYMENT)
        status, want = deployment.get("status") or {}, deployment["spec"]["replicas"]
        pods = get_json(cluster, "-n", ns, "pods", "-l", OPERATOR_PODS)["items"]
        return (status.get("observedGeneration") == deployment["metadata"]["generation"]
                and status.get("updatedReplicas") == want and status.get("availableReplicas") == want
                and len(pods) == want and not before & {p["metadata"]["uid"] for p in pods})

    wait_until(done, timeout=240, what="the operator restarted")


def restart_headscale(_: Subject, headscale: Headscale) -> None:
    """Stop and start Headscale on the same port and database; done when it is healthy."""
    headscale.restart()


DISRUPTIONS: dict[str, Callable[[Subject, Headscale], None]] = {
    "rollout": rollout, "pod deleted": delete_pod, "node drained": drain_node, "key rotation": rotate_key,
    "operator restart": restart_operator, "Headscale restart": restart_headscale}


@dataclass
class Outcome:
    disruption: str
    streams: dict[str, Tally]
    done_s: float
    """From the disruption's start to its conditions met (rollout done, key rotated, ...)."""
    named_s: float | None = None
    """Ingress: from the disruption's start to the node named spec.hostname again."""
    notes: dict[str, Any] = field(default_factory=dict)
    recovered: bool = True
    """False when the load did not answer :data:`SETTLE` in a row within ``recovery`` seconds of
    the disruption's end (only when :func:`disrupt` was told a load may not recover)."""


def disrupt(subject: Subject, headscale: Headscale, what: str, load: Callable[[], Load], *,
            recovery: float | None = None) -> Outcome:
    """Apply one disruption of :data:`DISRUPTIONS` under a load started just before it.

    The load must recover (180 s), unless ``recovery`` is given: then it gets that long, and an
    outcome that did not recover is returned with what the load measured until then."""
    subject.wait_steady()
    running = load()
    try:
        wait_until(lambda: running.streak() >= WARM, timeout=120, interval=0.5,
                   what="the load to succeed before the disruption")
        start = time.monotonic()
        DISRUPTIONS[what](subject, headscale)
        done = time.monotonic() - start
        named: float | None = None
        if subject.hostname is not None:
            try:
                wait_until(subject.named, timeout=180, interval=0.5, what="the ingress named spec.hostname again")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}\n{subject.explain()}") from exc
            named = time.monotonic() - start
        wait_until(subject.settled, timeout=240, interval=0.5, what="the agent settled after the disruption")
        mark = running.sent()
        recovered = True
        try:
            wait_until(lambda: running.streak() >= SETTLE and running.sent() - mark >= SETTLE,
                       timeout=recovery or 180, interval=0.5,
                       what=f"{SETTLE} requests in a row answered after the disruption")
        except TimeoutError:
            if recovery is None:
                raise
            recovered = False
    except BaseException:
        running.stop()
        raise
    return Outcome(what, running.stop(), round(done, 1), None if named is None else round(named, 1),
                   notes={"started": round(start, 3)}, recovered=recovered)


OLD_SHAPE = "maxUnavailable 1 and no surge, no preStop, no drain, no name hand-over"
"""The agent Deployment and operator as they were before the availability work (issue 24); see
:func:`old_shape`."""


@contextmanager
def old_shape(subject: Subject) -> Iterator[Subject]:
    """The subject's agent as it rolled before the availability work, for a baseline: the operator
    stopped (so nothing re-applies the Deployment, renames a node or rotates a key), the Deployment
    rolling with ``maxUnavailable: 1`` and no surge, without its preStop, with no drain
    (``TAILNET_DRAIN_TIMEOUT=0``: open connections are reset at SIGTERM) and a 30 s grace period.
    The agent's readiness warm-up and its logout stay this commit's. Yields the subject with no
    name to wait for; afterwards the operator runs again and re-applies the Deployment."""
    cluster, ns = subject.cluster, subject.operator_namespace
    replicas = int(get_json(cluster, "-n", ns, "deployment", OPERATOR_DEPLOYMENT)["spec"]["replicas"])
    kubectl(cluster, "-n", ns, "scale", f"deployment/{OPERATOR_DEPLOYMENT}", "--replicas=0")
    try:
        wait_until(lambda: not get_json(cluster, "-n", ns, "pods", "-l", OPERATOR_PODS)["items"], timeout=120,
                   what="the operator stopped")
        patch = [{"op": "replace", "path": "/spec/strategy",
                  "value": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}},
                 {"op": "replace", "path": "/spec/template/spec/terminationGracePeriodSeconds", "value": 30},
                 {"op": "remove", "path": "/spec/template/spec/containers/0/lifecycle"}]
        kubectl(subject.cluster, "-n", subject.namespace, "patch", "deployment", subject.deployment, "--type=json",
                "-p", json.dumps(patch))
        kubectl(subject.cluster, "-n", subject.namespace, "set", "env", f"deployment/{subject.deployment}",
                "-c", "agent", "TAILNET_DRAIN_TIMEOUT=0")
        baseline = replace(subject, hostname=None)
        baseline.wait_steady()
        yield baseline
    finally:
        kubectl(cluster, "-n", ns, "scale", f"deployment/{OPERATOR_DEPLOYMENT}", f"--replicas={replicas}")
        wait_until(lambda: _has_pre_stop(subject), timeout=180, what="the operator's Deployment back (preStop)")
        subject.wait_steady()


def _has_pre_stop(subject: Subject) -> bool:
    spec = get_json(subject.cluster, "-n", subject.namespace, "deployment", subject.deployment)["spec"]
    return "lifecycle" in spec["template"]["spec"]["containers"][0]


# -- the worlds -------------------------------------------------------------------------------

TailscaleStarter = Callable[..., TailscaleNode]
"""``(hostname, headscale, *, authkey=..., advertise_routes=..., site_router=...)`` as
``Environment.tailscale_node`` and the ``tailscale_nodes`` fixtures take it."""


def _tailnet(ns: str, headscale: Headscale, name: str, policy: str, **spec: Any) -> list[dict[str, Any]]:
    """A Tailnet ``name`` in Apply mode over the base ``policy``, with its bootstrap Secret and base
    ConfigMap in ``ns`` (``<name>-bootstrap``, ``<name>-policy``)."""
    secret, base = f"{name}-bootstrap", f"{name}-policy"
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
             "stringData": {"apiKey": headscale.api_key}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": base, "namespace": ns},
             "data": {"policy.hujson": policy}},
            tailnet_object(name, headscale, ns, secret=secret, **spec,
                           policy={"baseConfigMapRef": {"namespace": ns, "name": base, "key": "policy.hujson"},
                                   "mode": "Apply"})]


def _remove_tailnet(cluster: ClusterUnderTest, ns: str, name: str) -> None:
    remove_tailnet(cluster, name)
    kubectl(cluster, "-n", ns, "delete", f"secret/{name}-bootstrap", f"configmap/{name}-policy", check=False)


@dataclass
class EgressWorld:
    subject: Subject
    consumer: str
    host: SiteHost
    body: dict[str, Any]

    @property
    def service(self) -> str:
        return f"site-web.{self.subject.namespace}.svc"

    def load(self) -> EgressLoad:
        return EgressLoad(self.subject.cluster, self.consumer, "client", self.service, WEB_PORT)

    def scale(self, replicas: int) -> None:
        self.body["spec"]["replicas"] = replicas
        apply(self.subject.cluster, [self.body])
        wait_until(lambda: self.subject.replicas() == replicas, timeout=60, what=f"the Deployment at {replicas}")
        self.subject.wait_steady()


@contextmanager
def egress_world(cluster: ClusterUnderTest, ns: str, headscale: Headscale, image: str,
                 site_host: Callable[[], SiteHost], tailscale: TailscaleStarter) -> Iterator[EgressWorld]:
    """An egress with an HTTP and an echo target on a site host behind a tailscaled subnet router,
    and a client pod in its consumer namespace."""
    suffix = uuid.uuid4().hex[:6]
    name = f"disrupt-{suffix}"
    router_tag, tag = f"tag:site-{suffix}", f"tag:egress-{suffix}"
    host = site_host()
    host.serve_http(WEB_PORT)
    host.serve_echo(ECHO_PORT)
    apply(cluster, [*_tailnet(ns, headscale, name, OPEN_BASE), {
        "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": name},
        "spec": {"tailnetRef": {"name": name}, "routes": [host.subnet], "routerTag": router_tag}}])
    tailscale(f"router-{suffix}", headscale, authkey=headscale.create_preauth_key(tags=[router_tag]),
              advertise_routes=[host.subnet], site_router=True)
    try:
        with namespace(cluster, "consumer") as consumer:
            apply(cluster, [python_pod("client", consumer, image, SLEEPER)])
            wait_pod_running(cluster, consumer, "client")
            body = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"tailnetRef": {"name": name}, "tag": tag, "consumerNamespaces": [consumer],
                             "replicas": 1, "targets": [
                                 {"name": "site-web", "address": host.address,
                                  "ports": [{"port": WEB_PORT, "name": "http"}]},
                                 {"name": "site-echo", "address": host.address,
                                  "ports": [{"port": ECHO_PORT, "name": "echo"}]}]}}
            apply(cluster, [body])
            subject = Subject(cluster, ns, ns, EGRESSES, name, f"tailnet.dev/egress={name}",
                              f"{name}-egress-agent", (ns, f"{name}-auth-key"))
            subject.wait_steady()
            yield EgressWorld(subject, consumer, host, body)
    finally:
        kubectl(cluster, "-n", ns, "delete", EGRESSES, name, "--wait=true", "--timeout=90s", check=False)
        kubectl(cluster, "delete", SITES, name, "--wait=true", "--timeout=30s", check=False)
        _remove_tailnet(cluster, ns, name)


OPEN_CONNECTIONS = """
import socket, sys
conns = []
for _ in range({count}):
    conn = socket.create_connection(({host!r}, {port}), timeout=30)
    conn.sendall(b"*")
    assert conn.recv(1) == b"*"
    conns.append(conn)
print(len(conns), flush=True)
sys.stdin.readline()
"""


@contextmanager
def open_connections(world: EgressWorld, count: int) -> Iterator[int]:
    """``count`` connections from the client pod through the echo target, each echoed once, held
    open until the block ends; yields how many are open."""
    code = OPEN_CONNECTIONS.format(count=count, host=f"site-echo.{world.subject.namespace}.svc", port=ECHO_PORT)
    session = PythonSession(world.subject.cluster, world.consumer, "client", code)
    try:
        yield int(session.read_line(timeout=300))
    finally:
        session.close()


@dataclass
class IngressWorld:
    subject: Subject
    laptop: TailscaleNode
    sni: str
    ca: Path
    shared_address: str | None = None
    """The address the ingress's replicas share (the load goes there), or None: one replica, by name."""

    def load(self) -> IngressLoad:
        if self.shared_address is not None:
            return IngressLoad(self.laptop, self.shared_address, self.sni, self.ca)
        magic = str(self.subject.get()["status"]["magicDNSName"]).rstrip(".")
        return IngressLoad(self.laptop, magic, self.sni, self.ca)

    def load_by_address(self) -> IngressLoad:
        """A load to the tailnet address of the node the agent runs as now, for the old shape
        (:func:`old_shape`): with the operator stopped no name follows a new node, so a client
        that looked the ingress up before a disruption keeps its address; a new pod is a new node
        with another address."""
        hostname = self.subject.hostname or self.subject.name
        address = wait_until(lambda: _online_address(self.laptop, hostname), timeout=120,
                             what=f"one online peer {hostname} in the laptop's netmap")
        return IngressLoad(self.laptop, address, self.sni, self.ca)


def _online_address(laptop: TailscaleNode, hostname: str) -> str | None:
    """The IPv4 address of the one online peer that registered as ``hostname``, else None."""
    online = [p for p in laptop.peers() if p.get("HostName") == hostname and p.get("Online")]
    if len(online) != 1:
        return None
    return next((ip for ip in online[0].get("TailscaleIPs") or () if ":" not in ip), None)


SHARED_ADDRESS = "198.19.250.10"
"""An ingress's shared address in the disruption runs: inside the local node's cluster range, whose
``unreachable`` route keeps a packet the laptop would send from the host on this machine, and used by
nothing of the node's (node 198.19.0.x, pods 198.19.64.0/24, Services 198.19.128.0/24)."""


def _tls_secret(ns: str, name: str, ca: CertificateAuthority, host: str) -> dict[str, Any]:
    pair = ca.issue(name, common_name=host, hosts=(host,))
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                     "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}}


@contextmanager
def ingress_world(cluster: ClusterUnderTest, ns: str, headscale: Headscale, image: str, workdir: Path,
                  tailscale: TailscaleStarter, *, shared: bool = False) -> Iterator[IngressWorld]:
    """An ingress in a tenant namespace with a tcp expose and an https expose (certificate from a
    Secret) of one backend Service, and a laptop whose tag the policy grants the ingress. ``shared``:
    two replicas behind :data:`SHARED_ADDRESS`, which the policy grants the laptop too and the laptop
    accepts routes to."""
    suffix = uuid.uuid4().hex[:6]
    name = f"disrupt-{suffix}"
    tag, laptop_tag = f"tag:ingress-{suffix}", f"tag:laptop-{suffix}"
    destinations = [tag, f"{SHARED_ADDRESS}/32"] if shared else [tag]
    policy = json.dumps({"tagOwners": {tag: [], laptop_tag: []},
                         "grants": [{"src": [laptop_tag], "dst": destinations, "ip": ["*"]}]})
    apply(cluster, _tailnet(ns, headscale, name, policy + "\n",
                            dns={"hostsConfigMap": {"namespace": HOSTS[0], "name": HOSTS[1]}, "zones": [ZONE]}))
    wait_until(lambda: condition(get_json(cluster, TAILNETS, name), "PolicyApplied") == "True", timeout=120,
               what="the Tailnet's policy applied (it owns the laptop's tag)")
    laptop = tailscale(f"laptop-{suffix}", headscale, authkey=headscale.create_preauth_key(tags=[laptop_tag]),
                       accept_routes=shared)
    sni = f"web-{suffix}.{ZONE}"
    ca = CertificateAuthority(workdir / f"ca-{suffix}", f"disrupt-{suffix}")
    try:
        with namespace(cluster, "tenant", {"pod-security.kubernetes.io/enforce": "restricted"}) as tenant:
            admit_tenant(cluster, name, tenant, [tag], [f"*.{ZONE}"],
                         [f"{SHARED_ADDRESS}/32"] if shared else None)
            apply(cluster, [
                python_pod("web", tenant, image, HTTP_SERVER, labels={"app": "web"}, port=WEB_PORT),
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": tenant},
                 "spec": {"selector": {"app": "web"}, "ports": [{"port": WEB_PORT, "targetPort": WEB_PORT}]}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": "tailnet-operator", "namespace": tenant},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "tailnet-operator-tenant"},
                 "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": ns}]},
                _tls_secret(tenant, "web-tls", ca, sni)])
            wait_pod_running(cluster, tenant, "web")
            backend = {"service": "web", "port": WEB_PORT}
            apply(cluster, [{
                "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
                "metadata": {"name": name, "namespace": tenant},
                "spec": {"tailnetRef": {"name": name}, "tag": tag, "hostname": name,
                         "dnsTemplate": "{hostname}." + ZONE,
                         **({"replicas": 2, "sharedAddress": SHARED_ADDRESS} if shared else {}),
                         "exposes": [{"name": "raw", "port": WEB_PORT, "backend": backend},
                                     {"name": "web", "mode": "http", "port": 443, "backend": backend,
                                      "hosts": [{"name": sni, "tls": {"secretName": "web-tls"}}]}]}}])
            # Replicas sharing an address are each their own node: one of them carries the hostname.
            subject = Subject(cluster, ns, tenant, INGRESSES, name, f"tailnet.dev/ingress={name}",
                              f"{name}-ingress-agent", (ns, record_name(tenant, name)),
                              hostname=None if shared else name)
            subject.wait_steady()
            if shared:
                wait_until(lambda: any(f"{SHARED_ADDRESS}/32" in (p.get("PrimaryRoutes") or ())
                                       for p in laptop.peers()), timeout=120,
                           what="the laptop routing the shared address to a replica")
            yield IngressWorld(subject, laptop, sni, ca.cert_path, SHARED_ADDRESS if shared else None)
            kubectl(cluster, "-n", tenant, "delete", INGRESSES, name, "--wait=true", "--timeout=90s", check=False)
    finally:
        _remove_tailnet(cluster, ns, name)
