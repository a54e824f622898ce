"""Chaos on the host tier: the operator's reconcilers under crashes of everything they depend on.

    python -m hack.chaos [--rounds N] [--seed S] [--json FILE]     (``make chaos``)

Starts its own etcd + kube-apiserver (+ kube-controller-manager for garbage collection),
Headscale with its embedded DERP, a tailscaled subnet router that is also the egresses' target,
two operator processes electing a leader on a Lease, and one agent process
(``AGENT_MODE=egress``) per agent Deployment the operator writes, with the files that Deployment
would mount (its ConfigMap and key Secret, kept up to date while it runs). Nothing is shared with
other tests, so killing any of it breaks only this run.

Each round (``random.Random(seed)``; the seed is printed, ``TAILNET_CHAOS_SEED`` sets it and
``TAILNET_CHAOS_ROUNDS`` the number of rounds):

1. puts one or two changes in flight: an egress's tag changed (a pre-auth key rotation), the
   working API key's rotation made due (the operators' clock moved just past the key's
   ``nextRotationAt``, and back once it rotated: convergence then includes the new key),
   an egress created or deleted, a site's routes or an egress's ports changed;
2. after a random delay kills one of: the operator leader (SIGKILL), kube-apiserver, etcd,
   Headscale (SIGKILL), one agent (SIGKILL), or the DERP connection (every TCP connection to
   Headscale's port, which carries both the DERP relay and the control protocol, is destroyed
   with ``ss -K`` for a random while); then restarts it after a random downtime;
3. waits (bounded) until every CR is Ready for its current generation, the Tailnet's policy is
   applied, and the rendered policy equals the live one;
4. checks, after the operators' orphan sweep (run here with a short grace: :data:`SWEEP_GRACE`)
   had its chance, that nothing the operator created in Headscale is orphaned (a pre-auth key with
   an egress tag that is neither expired nor any CR's ``status.preAuthKey.id``; a node with an
   egress tag of no CR, or one Headscale should have aged out); that API keys other than the
   working key are no more than the leaders that ended while a rotation was in flight (an API key
   carries no marker the sweep could recognise: :attr:`Report.api_key_bound`); and that the Tailnet
   never went back to the bootstrap key after its first mint (the ``WorkingKeyMinted`` and
   ``WorkingKeyRejected`` Events, and the minted count).

``run_chaos`` returns a :class:`Report` (rounds survived, kills by kind, worst convergence time,
orphans and bootstrap uses found); the command prints it and exits non-zero on any failure.

What the host tier does not cover (a cluster would): the kubelet (agent processes are started
here by the driver, as a Deployment would, but without probes, restarts by the kubelet, or
NetworkPolicy), cluster DNS (the operator reads each agent's ``/status`` from its host port
instead of its Service), and a Pod's own crash/restart timings. See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hack.localenv import ControlPlane, Environment, Headscale, ManagedProcess, TailscaleNode, free_port, wait_until
from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract.endpoints import STATUS_PATH

SEED_ENV = "TAILNET_CHAOS_SEED"
ROUNDS_ENV = "TAILNET_CHAOS_ROUNDS"
KINDS = ("operator", "apiserver", "etcd", "headscale", "agent", "derp")
CHANGES = ("tag", "api-key-rotation", "egress-churn", "site-routes", "ports")
"""What is put in flight before a kill; drawn in shuffled cycles, so every kind comes up."""
NAMESPACE = "tailnet-chaos"
TAILNET = "chaos"
LEASE = "tailnet-operator"
ROUTER_TAG = "tag:chaos-router"
SITE_ROUTES = ("198.18.77.0/24", "198.18.78.0/24")
TARGET_PORT = 8080
EPHEMERAL_TIMEOUT = 70.0
"""Headscale's ``node.ephemeral.inactivity_timeout`` in the local environment."""
CONVERGENCE_BOUND = 180.0
"""Seconds every CR gets to be Ready again after a restart."""
SWEEP_GRACE = 45.0
"""The operators' orphan-sweep grace in seconds (production: 10 min): a marked key or node no CR
refers to goes once this old, so a key left by a leader that exited before storing it is expired
within a round."""
SWEEP_INTERVAL = 10.0
"""Seconds between the operators' orphan sweeps (production: 600)."""
STALE_AFTER = EPHEMERAL_TIMEOUT + 20.0
"""Seconds an owned ephemeral node may be offline before the sweep deletes it (production: 1 h)."""
ORPHAN_GRACE = SWEEP_GRACE + 2 * SWEEP_INTERVAL + 10.0
"""Seconds an orphan candidate may take to go (a reconcile in progress, then the sweep's chance)
before it counts."""
ROTATION_MARGIN = 5.0
"""Seconds past the working key's ``nextRotationAt`` the operators' clock is moved to make it due.
The clock goes back once the new key is in the status: left ahead, every later key (its expiry
written by the operator's clock, its creation time by Headscale's) would be due at once."""
OPEN_BASE = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}\n'
GROUP = "/apis/tailnet.dev/v1alpha1"
REPO = Path(__file__).resolve().parent.parent


class ChaosFailure(AssertionError):
    """An invariant did not hold; the message says which and in what round."""


@dataclass
class Report:
    seed: int
    rounds: int
    rounds_survived: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    changes: Counter[str] = field(default_factory=Counter)
    convergence: list[float] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    """Orphans that count: every one fails the run."""
    api_keys_left: list[str] = field(default_factory=list)
    """API keys minted by a leader that ended before it could store them (bounded, see api_key_bound)."""
    api_key_bound: int = 0
    """Leaders that ended (killed, or exited on a lost Lease) while a working-key rotation was in
    flight: each can leave at most one API key (its unconfirmed key lives in its memory only)."""
    bootstrap_uses: int = 0
    minted: int = 0
    rotations: int = 0
    operator_exits: int = 0
    wall_seconds: float = 0.0
    failure: str = ""

    @property
    def worst_convergence(self) -> float:
        return max(self.convergence, default=0.0)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["kills"] = dict(self.kills)
        doc["changes"] = dict(self.changes)
        doc["worst_convergence"] = round(self.worst_convergence, 1)
        return doc

    def summary(self) -> str:
        kills = ", ".join(f"{k} {self.kills[k]}" for k in KINDS if self.kills[k])
        changes = ", ".join(f"{k} {v}" for k, v in sorted(self.changes.items()))
        lines = [
            f"chaos seed {self.seed}: {self.rounds_survived}/{self.rounds} rounds survived in {self.wall_seconds:.0f}s",
            f"  kills: {kills or 'none'}",
            f"  changes in flight: {changes or 'none'}",
            f"  convergence: worst {self.worst_convergence:.1f}s, median "
            f"{sorted(self.convergence)[len(self.convergence) // 2] if self.convergence else 0.0:.1f}s",
            f"  working key: minted from the bootstrap key {self.minted}x, rotated {self.rotations}x, "
            f"bootstrap needed again {self.bootstrap_uses}x",
            f"  operator processes that exited on their own and were restarted: {self.operator_exits}",
            f"  orphans found: {len(self.orphans)}" + "".join(f"\n    {o}" for o in self.orphans),
            f"  API keys left by leaders that ended mid-rotation: {len(self.api_keys_left)} (bound "
            f"{self.api_key_bound})" + "".join(f"\n    {o}" for o in self.api_keys_left),
        ]
        if self.failure:
            lines.append(f"  FAILED: {self.failure}")
        return "\n".join(lines)


# -- the Kubernetes side, through the control plane's admin helper ---------------------------------


class Kube:
    """Small admin calls that raise ``OSError``/``HTTPError`` while the control plane is down."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            doc = self.plane.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return doc if isinstance(doc, dict) else None

    def items(self, path: str) -> list[dict[str, Any]]:
        return list((self.get(path) or {}).get("items") or [])

    def create(self, path: str, body: dict[str, Any]) -> None:
        try:
            self.plane.request("POST", path, body)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def patch(self, path: str, body: dict[str, Any]) -> None:
        self.plane.request("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str) -> None:
        try:
            self.plane.request("DELETE", path)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise


def retrying(action: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    """Run ``action`` until it stops raising (a component may be restarting)."""

    def attempt() -> Any:
        try:
            return action() or True
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code not in (409, 429):
                raise ChaosFailure(f"{what}: {exc.code} {exc.read().decode(errors='replace')}") from None
            raise

    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except ChaosFailure:
            raise
        except Exception:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.5)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def current(obj: dict[str, Any], type_: str) -> bool:
    """The condition is True for the object's current generation."""
    cond = condition(obj, type_)
    generation = obj["metadata"].get("generation")
    observed = cond.get("observedGeneration", (obj.get("status") or {}).get("observedGeneration"))
    return cond.get("status") == "True" and (observed is None or observed == generation)


# -- the operator as a process ----------------------------------------------------------------------


class ShiftedClock:
    """The real clock, with a wall-clock offset read from a file the driver moves forward."""

    def __init__(self, path: Path) -> None:
        from tailnet_agent.contract.clock import RealClock

        self.path = path
        self._real = RealClock()

    def offset(self) -> dt.timedelta:
        try:
            return dt.timedelta(seconds=float(self.path.read_text() or 0))
        except (OSError, ValueError):
            return dt.timedelta(0)

    def now(self) -> float:
        return self._real.now()

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(seconds)

    def utcnow(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC) + self.offset()


class HostAgentStatus:
    """Reads an agent's ``/status`` from the host port the driver gave it (a Service in a cluster)."""

    def __init__(self, ports_file: Path, timeout: float = 3.0) -> None:
        self.ports_file = ports_file
        self.timeout = timeout

    async def read(self, owner: Any) -> dict[str, Any] | None:
        import aiohttp

        try:
            ports = json.loads(self.ports_file.read_text())
        except (OSError, ValueError):
            return None
        port = ports.get(f"{owner.metadata.namespace}/{owner.metadata.name}")
        if port is None:
            return None
        try:
            async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session,
                        session.get(f"http://127.0.0.1:{port}{STATUS_PATH}") as resp):
                if resp.status != 200:
                    return None
                doc: Any = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None


async def run_operator(args: argparse.Namespace) -> int:
    """One operator replica: the real manager and reconcilers, leader election with short timings,
    the clock from ``--clock-file``, agents' ``/status`` from ``--ports-file``."""
    from prometheus_client import CollectorRegistry

    from tailnet_operator.controllers.setup import setup
    from tailnet_operator.names import OPERATOR
    from tailnet_operator.runtime import config as rest_config
    from tailnet_operator.runtime.controller import Request
    from tailnet_operator.runtime.events import EventRecorder
    from tailnet_operator.runtime.leaderelection import LeaderElectionConfig
    from tailnet_operator.runtime.manager import LeadershipLost, Manager, ManagerOptions

    election = LeaderElectionConfig(lease_duration=4.0, renew_deadline=3.0, retry_period=0.5, identity=args.identity)
    manager = Manager(rest_config.load(Path(args.kubeconfig)),
                      ManagerOptions(field_manager=OPERATOR, leader_election=True, leader_election_id=LEASE,
                                     leader_election_namespace=args.namespace, leader_election_config=election,
                                     graceful_shutdown_timeout=2),
                      registry=CollectorRegistry())
    clock = ShiftedClock(Path(args.clock_file))
    events = EventRecorder(manager.client, reporting_controller=OPERATOR, reporting_instance=args.identity,
                           clock=manager.clock)
    reconcilers = setup(manager, namespace=args.namespace, clock=clock, events=events,
                        agent_status=HostAgentStatus(Path(args.ports_file)))
    # a sweep within a round (docs/reliability.md, "Chaos"), on real time: the shifted clock of a
    # made-due rotation would make every key created a moment ago look older than the grace
    reconcilers.sweep.grace = dt.timedelta(seconds=SWEEP_GRACE)
    reconcilers.sweep.interval = SWEEP_INTERVAL
    reconcilers.sweep.stale_after = dt.timedelta(seconds=STALE_AFTER)
    reconcilers.sweep.clock = manager.clock

    async def follow_clock() -> None:
        """A moved clock makes rotations due: reconcile every Tailnet now, as its timer would."""
        seen = clock.offset()
        while True:
            await asyncio.sleep(0.5)
            if clock.offset() != seen:
                seen = clock.offset()
                from tailnet_operator.controllers.kinds import TAILNET as TAILNET_KIND

                for obj in manager.cache.list(TAILNET_KIND):
                    for controller in manager.controllers:
                        if controller.name == "tailnet":
                            controller.queue.add(Request("", obj["metadata"]["name"]))

    follower = asyncio.create_task(follow_clock())
    try:
        await manager.run(handle_signals=True)
    except LeadershipLost:
        return 1
    finally:
        follower.cancel()
    return 0


# -- the harness --------------------------------------------------------------------------------------


@dataclass
class Agent:
    """An agent process standing in for the pod of one agent Deployment."""

    name: str
    owner: str
    template: str
    workdir: Path
    health_port: int
    process: ManagedProcess
    listen: dict[str, int] = field(default_factory=dict)
    """(target/port) -> the local listen port given to it."""


class Harness:
    def __init__(self, env: Environment, rng: random.Random, log: Callable[[str], None]) -> None:
        self.env = env
        self.rng = rng
        self.log = log
        self.plane: ControlPlane = env.control_plane()
        self.kube = Kube(self.plane)
        self.headscale: Headscale = env.headscale("chaos-headscale")
        self.router: TailscaleNode | None = None
        self.router_ip = ""
        self.clock_file = env.root / "operator-clock"
        self.clock_file.write_text("0")
        self.ports_file = env.root / "agent-ports.json"
        self.ports_file.write_text("{}")
        self.operators: dict[str, ManagedProcess] = {}
        self.generation = 0
        self.agents: dict[str, Agent] = {}
        self.egress_tags: set[str] = set()
        self._changes: list[str] = []
        self.admin_keys: list[str] = []
        """API keys not the operator's: the driver's own and the bootstrap key."""
        self.reported: set[str] = set()
        """Orphans already reported (one that stays is reported once)."""
        self.operator_restarts = 0
        """Operators that exited on their own (e.g. leadership lost while the API was down)."""
        self.rotating_from = ""
        """The working key's id when a rotation was made due; "" when none is pending."""

    # -- setup ------------------------------------------------------------------------------------

    def start(self) -> None:
        from hack.crds import install_crds

        install_crds(self.plane.api_client())
        self.kube.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        bootstrap = self.headscale.cli("apikeys", "create", "--expiration", "24h").strip().splitlines()[-1]
        self.admin_keys = [self.headscale.api_key, bootstrap]
        self.kube.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", {
            "metadata": {"name": "bootstrap"}, "type": "Opaque",
            "data": {"apiKey": base64.b64encode(bootstrap.encode()).decode()}})
        self.kube.create(f"/api/v1/namespaces/{NAMESPACE}/configmaps", {
            "metadata": {"name": "base"}, "data": {"policy.hujson": OPEN_BASE}})
        for _ in range(2):
            self.start_operator()
        self.kube.create(f"{GROUP}/tailnets", {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "Tailnet", "metadata": {"name": TAILNET},
            "spec": {"loginURL": self.headscale.url, "caBundle": self.headscale.ca_bundle.read_text(),
                     "bootstrapKeySecretRef": {"namespace": NAMESPACE, "name": "bootstrap", "key": "apiKey"},
                     "apiKeyLifetime": "1h",
                     "policy": {"baseConfigMapRef": {"namespace": NAMESPACE, "name": "base", "key": "policy.hujson"},
                                "mode": "Apply"}}})
        self.kube.create(f"{GROUP}/tailnetsites", {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": "chaos-site"},
            "spec": {"tailnetRef": {"name": TAILNET}, "routes": [SITE_ROUTES[0]], "routerTag": ROUTER_TAG}})
        wait_until(lambda: self._owned_tag(ROUTER_TAG), timeout=120, interval=0.5,
                   what="the live policy to own the site's router tag")
        key = self.headscale.create_preauth_key(tags=[ROUTER_TAG], reusable=True)
        self.router = self.env.tailscale_node("chaos-router", self.headscale, authkey=key,
                                              advertise_routes=list(SITE_ROUTES))
        node = wait_until(lambda: self.headscale.node_by_name("chaos-router"), timeout=60, what="the router node")
        self.router_ip = next(a for a in node["ipAddresses"] if "." in a)
        for name, tag in (("eg-a", "tag:chaos-a"), ("eg-b", "tag:chaos-b")):
            self.create_egress(name, tag)
        self.converge(0)

    def _owned_tag(self, tag: str) -> bool:
        from tailnet_operator.policy import parse_hujson

        live = parse_hujson(self.headscale.api("GET", "/api/v1/policy").get("policy") or "{}")
        return tag in (live.get("tagOwners") or {})

    def start_operator(self) -> str:
        self.generation += 1
        identity = f"operator-{self.generation}"
        process = ManagedProcess(identity, [
            sys.executable, "-m", "hack.chaos", "operator", "--kubeconfig", str(self.plane.kubeconfig),
            "--namespace", NAMESPACE, "--identity", identity, "--clock-file", str(self.clock_file),
            "--ports-file", str(self.ports_file),
        ], log_dir=self.env.log_dir, run_id=self.env.run_id, cwd=REPO)
        process.start()
        self.operators[identity] = process
        return identity

    def egress_body(self, name: str, tag: str, ports: tuple[int, ...] = (TARGET_PORT,)) -> dict[str, Any]:
        return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"tailnetRef": {"name": TAILNET}, "tag": tag, "consumerNamespaces": ["chaos-consumers"],
                         "targets": [{"name": f"{name}-router", "address": self.router_ip,
                                      "ports": [{"port": p} for p in ports]}]}}

    def create_egress(self, name: str, tag: str) -> None:
        self.egress_tags.add(tag)
        retrying(lambda: self.kube.create(f"{GROUP}/namespaces/{NAMESPACE}/tailnetegresses",
                                          self.egress_body(name, tag)), f"create egress {name}")

    # -- changes in flight ------------------------------------------------------------------------------

    def change(self) -> str:
        if not self._changes:
            self._changes = list(CHANGES)
            self.rng.shuffle(self._changes)
        kind = self._changes.pop()
        egresses = f"{GROUP}/namespaces/{NAMESPACE}/tailnetegresses"
        if kind == "tag":
            name = self.rng.choice(["eg-a", "eg-b"])
            obj = retrying(lambda: self.kube.get(f"{egresses}/{name}"), f"read {name}")
            tag = str(obj["spec"]["tag"])
            new = tag[:-1] if tag.endswith("2") else f"{tag}2"
            self.egress_tags.add(new)
            retrying(lambda: self.kube.patch(f"{egresses}/{name}", {"spec": {"tag": new}}), f"retag {name}")
        elif kind == "api-key-rotation":
            tailnet = retrying(lambda: self.kube.get(f"{GROUP}/tailnets/{TAILNET}"), "read the Tailnet")
            key = (tailnet.get("status") or {}).get("apiKey") or {}
            due = _time(key.get("nextRotationAt")) or dt.datetime.now(dt.UTC)
            offset = max(0.0, (due - dt.datetime.now(dt.UTC)).total_seconds()) + ROTATION_MARGIN
            self.rotating_from = str(key.get("id") or "")
            self.clock_file.write_text(str(offset))
        elif kind == "egress-churn":
            if retrying(lambda: (self.kube.get(f"{egresses}/eg-c"),), "read eg-c")[0] is None:
                self.create_egress("eg-c", "tag:chaos-c")
            else:
                retrying(lambda: self.kube.delete(f"{egresses}/eg-c"), "delete eg-c")
        elif kind == "site-routes":
            obj = retrying(lambda: self.kube.get(f"{GROUP}/tailnetsites/chaos-site"), "read the site")
            routes = list(SITE_ROUTES) if len(obj["spec"]["routes"]) == 1 else [SITE_ROUTES[0]]
            retrying(lambda: self.kube.patch(f"{GROUP}/tailnetsites/chaos-site", {"spec": {"routes": routes}}),
                     "change the site's routes")
        else:
            obj = retrying(lambda: self.kube.get(f"{egresses}/eg-b"), "read eg-b")
            target = obj["spec"]["targets"][0]
            ports = [{"port": TARGET_PORT}] if len(target["ports"]) > 1 else [{"port": TARGET_PORT},
                                                                                {"port": TARGET_PORT + 1}]
            retrying(lambda: self.kube.patch(f"{egresses}/eg-b", {"spec": {"targets": [{**target, "ports": ports}]}}),
                     "change eg-b's ports")
        return kind

    # -- faults -------------------------------------------------------------------------------------------

    def leader(self) -> str:
        lease = self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE}") or {}
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    def _running_leader(self) -> str:
        holder = self.leader()
        if holder not in self.operators:
            raise LookupError(f"the Lease names {holder!r}, which does not run (yet to be taken over)")
        return holder

    def kill(self, kind: str, downtime: float) -> str:
        """Kill one component of ``kind``, keep it down ``downtime`` seconds, restart it; what was killed."""
        if kind == "operator":
            # Right after a leader was killed the Lease still names it until a standby takes it over
            # (one lease duration): wait for a holder that runs, as the next leader to kill.
            holder = retrying(self._running_leader, "a running leader to kill", timeout=60.0)
            process = self.operators.pop(holder, None)
            if process is None:
                raise ChaosFailure(f"the Lease names {holder!r}, which is no operator of this run")
            process.kill()
            process.stop()
            time.sleep(downtime)
            return f"operator leader {holder} -> restarted as {self.start_operator()}"
        if kind == "apiserver":
            assert self.plane.apiserver is not None
            self.plane.apiserver.kill()
            time.sleep(downtime)
            self.plane.start_apiserver()
            return "kube-apiserver"
        if kind == "etcd":
            assert self.plane.etcd is not None
            self.plane.etcd.kill()
            time.sleep(downtime)
            self.plane.start_etcd()
            return "etcd"
        if kind == "headscale":
            self.headscale.process.kill()
            time.sleep(downtime)
            self.headscale.process.start()
            wait_until(lambda: _healthy(self.headscale), timeout=60, what="Headscale /health")
            return "Headscale"
        if kind == "agent":
            if not self.agents:
                return "agent (none running)"
            agent = self.agents[self.rng.choice(sorted(self.agents))]
            agent.process.kill()
            time.sleep(downtime)
            agent.process.start()
            return f"agent {agent.name}"
        destroyed = 0
        deadline = time.monotonic() + downtime
        while True:
            destroyed += _destroy_connections(self.headscale.port)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not destroyed:
            raise ChaosFailure("ss -K destroyed no connection to Headscale: it needs root (CAP_NET_ADMIN) and a kernel "
                               "with CONFIG_INET_DIAG_DESTROY; leave the kind 'derp' out otherwise")
        return f"DERP and control connections to Headscale ({destroyed} sockets destroyed over {downtime:.1f}s)"

    # -- what the kubelet would do ------------------------------------------------------------------------

    def supervise(self) -> None:
        """Restart an operator that exited (a leader that lost its Lease exits by design), then the agents."""
        for identity, process in self.operators.items():
            if not process.running():
                process.stop()
                process.start()
                self.operator_restarts += 1
                self.log(f"    operator {identity} exited and was restarted")
        self.sync_agents()

    def sync_agents(self) -> None:
        """Start an agent for every agent Deployment, restart it when its template changes, keep its
        mounted files current, stop it when the Deployment goes. Leaves them be while the API is down."""
        try:
            deployments = self.kube.items(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
            files = {d["metadata"]["name"]: self._mounts(d) for d in deployments}
        except (OSError, urllib.error.HTTPError, ValueError):
            return
        wanted = {d["metadata"]["name"]: d for d in deployments}
        for name in list(self.agents):
            if name not in wanted:
                self.agents.pop(name).process.stop()
                self.log(f"    agent {name} stopped (its Deployment is gone)")
        for name, deployment in wanted.items():
            mounts = files[name]
            if mounts is None:
                continue
            template = json.dumps(deployment["spec"]["template"], sort_keys=True)
            agent = self.agents.get(name)
            if agent is not None and agent.template != template:
                agent.process.stop()
                self.log(f"    agent {name} restarted (its pod template changed)")
                agent = None
            if agent is None:
                agent = self._start_agent(name, deployment, mounts, template)
            else:
                self._write_mounts(agent, mounts)
            if not agent.process.running():
                agent.process.stop()
                agent.process.start()  # the Deployment's pod restarts
        ports = {f"{NAMESPACE}/{a.owner}": a.health_port for a in self.agents.values()}
        self.ports_file.write_text(json.dumps(ports))

    def _mounts(self, deployment: dict[str, Any]) -> dict[str, dict[str, str]] | None:
        """mountPath -> {file: content} from the Deployment's ConfigMap and Secret volumes."""
        spec = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        out: dict[str, dict[str, str]] = {}
        for mount in spec["containers"][0].get("volumeMounts") or []:
            volume = volumes.get(mount["name"]) or {}
            if "configMap" in volume:
                cm = self.kube.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{volume['configMap']['name']}")
                if cm is None:
                    return None
                out[mount["mountPath"]] = dict(cm.get("data") or {})
            elif "secret" in volume:
                secret = self.kube.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{volume['secret']['secretName']}")
                if secret is None:
                    return None
                out[mount["mountPath"]] = {k: base64.b64decode(v).decode()
                                           for k, v in (secret.get("data") or {}).items()}
        return out

    def _write_mounts(self, agent: Agent, mounts: dict[str, dict[str, str]]) -> None:
        for mount_path, files in mounts.items():
            folder = agent.workdir / mount_path.lstrip("/")
            folder.mkdir(parents=True, exist_ok=True)
            for key, text in files.items():
                if key.endswith(".json") and text.lstrip().startswith("["):
                    text = self._local_listen_ports(agent, text)
                path = folder / key
                if not path.exists() or path.read_text() != text:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(path)

    def _local_listen_ports(self, agent: Agent, text: str) -> str:
        """Every agent here shares 127.0.0.1: each (target, port) listens on a port of its own."""
        chosen = agent.listen
        targets = json.loads(text)
        for target in targets:
            ports = []
            for port in target.get("ports") or []:
                number = port["port"] if isinstance(port, dict) else int(port)
                key = f"{target.get('name')}/{number}"
                if key not in chosen:
                    chosen[key] = free_port()
                ports.append({"port": number, "listen": chosen[key]})
            target["ports"] = ports
        return json.dumps(targets)

    def _start_agent(self, name: str, deployment: dict[str, Any], mounts: dict[str, dict[str, str]],
                     template: str) -> Agent:
        workdir = self.env.root / "agents" / f"{name}-{time.monotonic_ns()}"
        owner = next((r["name"] for r in deployment["metadata"].get("ownerReferences") or []
                      if r.get("controller")), name)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            value = str(var.get("value") or "")
            for mount_path in mounts:
                if value.startswith(mount_path + "/"):
                    value = str(workdir / value.lstrip("/"))
            env[var["name"]] = value
        health = free_port()
        env.update({env_names.HEALTH_ADDRESS: f"127.0.0.1:{health}", env_names.BIND_ADDRESS: "127.0.0.1",
                    env_names.UDP_PORT: "0", env_names.LOG_FORMAT: "console"})
        process = ManagedProcess(f"agent-{name}", [sys.executable, "-m", "tailnet_agent"], log_dir=self.env.log_dir,
                                 run_id=self.env.run_id, env=env, cwd=REPO)
        agent = Agent(name, owner, template, workdir, health, process)
        self._write_mounts(agent, mounts)
        process.start()
        self.agents[name] = agent
        self.log(f"    agent {name} started (health 127.0.0.1:{health})")
        return agent

    # -- invariants ------------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """What keeps the system from being converged now (empty: converged)."""
        from tailnet_operator.policy import parse_hujson

        out: list[str] = []
        tailnet = self.kube.get(f"{GROUP}/tailnets/{TAILNET}")
        if tailnet is None:
            return ["the Tailnet is gone"]
        for type_ in ("Ready", "PolicyApplied"):
            if not current(tailnet, type_):
                out.append(f"Tailnet {type_}: {condition(tailnet, type_).get('message', 'not yet')}")
        if self.rotating_from:
            key_id = str((((tailnet.get("status") or {}).get("apiKey")) or {}).get("id") or "")
            if key_id == self.rotating_from:
                out.append(f"the working key {key_id} is due but not rotated yet")
            else:
                self.clock_file.write_text("0")
                self.rotating_from = ""
        egresses = self.kube.items(f"{GROUP}/namespaces/{NAMESPACE}/tailnetegresses")
        sites = self.kube.items(f"{GROUP}/tailnetsites")
        for obj in [*egresses, *sites]:
            if obj["metadata"].get("deletionTimestamp"):
                out.append(f"{obj['kind']} {obj['metadata']['name']} is still being deleted")
            elif not current(obj, "Ready"):
                out.append(f"{obj['kind']} {obj['metadata']['name']}: {condition(obj, 'Ready').get('message', '')}")
        deployments = {d["metadata"]["name"]
                       for d in self.kube.items(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")}
        if len(deployments) != len(egresses) or set(self.agents) != deployments:
            out.append(f"agents {sorted(self.agents)} for Deployments {sorted(deployments)}, {len(egresses)} egresses")
        for agent in self.agents.values():
            if not _agent_ready(agent.health_port):
                out.append(f"agent {agent.name} is not ready (/readyz)")
        policy = (tailnet.get("status") or {}).get("policy") or {}
        rendered_cm = self.kube.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{policy.get('renderedConfigMap')}")
        rendered = ((rendered_cm or {}).get("data") or {}).get("policy.hujson", "")
        live = self.headscale.api("GET", "/api/v1/policy").get("policy") or ""
        if not rendered or parse_hujson(rendered) != parse_hujson(live or "{}"):
            out.append("the rendered and the live policy differ")
        elif policy.get("appliedHash") != policy.get("renderedHash"):
            out.append("status.policy.appliedHash is not the renderedHash")
        return out

    def converge(self, round_: int) -> float:
        start = time.monotonic()
        last: list[str] = []

        def done() -> bool:
            nonlocal last
            self.supervise()
            try:
                last = self.problems()
            except Exception as exc:
                last = [f"{type(exc).__name__}: {exc}"]
            return not last

        try:
            wait_until(done, timeout=CONVERGENCE_BOUND, interval=0.5, what="convergence")
        except TimeoutError:
            raise ChaosFailure(f"round {round_}: not converged within {CONVERGENCE_BOUND:.0f}s: "
                               + "; ".join(last)) from None
        return time.monotonic() - start

    def orphans(self) -> list[str]:
        """Pre-auth keys and nodes the operator created that no CR accounts for (after a grace)."""
        found: list[str] = []

        def check() -> bool:
            nonlocal found
            self.supervise()
            found = self._orphans_now()
            return all(_identity(o) in self.reported for o in found)  # one already counted is not waited for

        with contextlib.suppress(TimeoutError):
            wait_until(check, timeout=ORPHAN_GRACE, interval=1.0, what="no orphans")
        new = [o for o in found if _identity(o) not in self.reported]
        self.reported.update(_identity(o) for o in found)
        return new

    def _orphans_now(self) -> list[str]:
        egresses = self.kube.items(f"{GROUP}/namespaces/{NAMESPACE}/tailnetegresses")
        referenced = {str(((e.get("status") or {}).get("preAuthKey") or {}).get("id")) for e in egresses}
        live_tags = {e["spec"]["tag"] for e in egresses}
        now = dt.datetime.now(dt.UTC)
        out: list[str] = []
        for key in self.headscale.api("GET", "/api/v1/preauthkey").get("preAuthKeys") or []:
            tags = set(key.get("aclTags") or [])
            if not tags & self.egress_tags:
                continue
            expiration = _time(key.get("expiration"))
            if expiration is not None and expiration <= now:
                continue
            if str(key.get("id")) not in referenced:
                out.append(f"pre-auth key {key.get('id')} {sorted(tags)} (not expired, no CR's)")
        tailnet = self.kube.get(f"{GROUP}/tailnets/{TAILNET}") or {}
        working = str((((tailnet.get("status") or {}).get("apiKey")) or {}).get("id") or "")
        for key in self.headscale.api("GET", "/api/v1/apikey").get("apiKeys") or []:
            expiration = _time(key.get("expiration"))
            if expiration is not None and expiration <= now:
                continue
            # Listed masked, "<prefix>-***" (0.29) or "hskey-api-<prefix>-***"; the key is hskey-api-<prefix>-<secret>.
            prefix = str(key.get("prefix") or "").removeprefix("hskey-api-").removesuffix("***").rstrip("-")
            if str(key.get("id")) == working or (prefix and any(prefix in k for k in self.admin_keys)):
                continue
            out.append(f"API key {key.get('id')} {prefix} (not expired, not the Tailnet's working key)")
        for node in self.headscale.nodes():
            tags = set(node.get("tags") or node.get("forcedTags") or []) | set(node.get("validTags") or [])
            if not tags & self.egress_tags:
                continue
            name = node.get("givenName") or node.get("name")
            if node.get("online") and not tags & live_tags:
                out.append(f"node {node.get('id')} {name} {sorted(tags)}: online with the tag of no CR")
            seen = _time(node.get("lastSeen"))
            if not node.get("online") and seen is not None and (now - seen).total_seconds() > EPHEMERAL_TIMEOUT + 60:
                out.append(f"node {node.get('id')} {name} {sorted(tags)}: offline since {seen:%H:%M:%S} "
                           "and not aged out")
        return out

    def bootstrap_uses(self) -> tuple[int, int, int]:
        """(mints from the bootstrap key, rejections of the working key, rotations) in Events."""
        counts: Counter[str] = Counter()
        for event in self.kube.items("/apis/events.k8s.io/v1/namespaces/default/events"):
            if (event.get("regarding") or {}).get("name") != TAILNET:
                continue
            counts[event.get("reason", "")] += int((event.get("series") or {}).get("count") or 1)
        return counts["WorkingKeyMinted"], counts["WorkingKeyRejected"], counts["WorkingKeyRotated"]

    def close(self) -> None:
        for agent in self.agents.values():
            agent.process.stop()
        for process in self.operators.values():
            process.stop()
        # The run's own components: stopped now, not when the environment closes (a test session's
        # environment outlives this run).
        if self.router is not None:
            self.router.stop()
        self.headscale.stop()
        self.plane.stop()


def _healthy(server: Headscale) -> bool:
    server.process.check_running()
    with urllib.request.urlopen(f"{server.url}/health", context=server.ssl_context(), timeout=2) as resp:
        return bool(json.loads(resp.read()).get("status") == "pass")


def _identity(orphan: str) -> str:
    """"pre-auth key 8 [...] ..." -> "pre-auth key 8": what an orphan is, without how it looks now."""
    words = orphan.split()
    return " ".join(words[:3] if words[0] in ("pre-auth", "API") else words[:2])


def unavailable_kinds() -> dict[str, str]:
    """The kinds of kill this machine cannot make, with why: the DERP kill destroys sockets with
    ``ss -K``, which needs root (CAP_NET_ADMIN) and iproute2."""
    missing = [why for ok, why in ((os.geteuid() == 0, "not root (ss -K needs CAP_NET_ADMIN)"),
                                   (shutil.which("ss") is not None, "no ss (iproute2) on PATH")) if not ok]
    return {"derp": "; ".join(missing)} if missing else {}


def _agent_ready(port: int) -> bool:
    """The agent's readiness probe, as the kubelet would run it."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _destroy_connections(port: int) -> int:
    """Destroy every TCP socket to or from 127.0.0.1:``port`` (both ends); how many went."""
    proc = subprocess.run(["ss", "-K", "-t", "-n", f"( dport = :{port} or sport = :{port} )"],
                          capture_output=True, text=True, timeout=10, check=False)
    return sum(1 for line in proc.stdout.splitlines()[1:] if line.strip())


def _time(text: Any) -> dt.datetime | None:
    if not text:
        return None
    with contextlib.suppress(ValueError):
        value = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
        if value.year > 1:
            return value
    return None


def seed_from_env() -> int:
    text = os.environ.get(SEED_ENV, "").strip()
    return int(text) if text else random.SystemRandom().randrange(2**32)


@contextlib.contextmanager
def _environment(root: Path | None) -> Iterator[Environment]:
    env = Environment(root, run_id=f"chaos-{os.getpid()}")
    try:
        yield env
    finally:
        env.close()


def run_chaos(rounds: int, seed: int, *, env: Environment, log: Callable[[str], None] = print,
              kinds: tuple[str, ...] = KINDS) -> Report:
    """Run ``rounds`` rounds with ``random.Random(seed)``; never raises for a broken invariant (the
    report's ``failure`` says which), only for a harness that cannot start."""
    rng = random.Random(seed)
    report = Report(seed=seed, rounds=rounds)
    log(f"chaos: seed {seed} ({SEED_ENV}={seed} repeats this run), {rounds} rounds, logs in {env.log_dir}")
    started = time.monotonic()
    harness = Harness(env, rng, log)
    try:
        harness.start()
        log(f"chaos: converged at start in {time.monotonic() - started:.1f}s")
        order = [kinds[i % len(kinds)] for i in range(rounds)]
        rng.shuffle(order)
        for round_ in range(1, rounds + 1):
            kind = order[round_ - 1]
            changes = [harness.change() for _ in range(rng.choice((1, 2)))]
            report.changes.update(changes)
            time.sleep(rng.uniform(0.0, 2.5))  # the kill lands somewhere in the reconciles
            downtime = rng.uniform(0.5, 4.0)
            rotating, exits = bool(harness.rotating_from), harness.operator_restarts
            what = harness.kill(kind, downtime)
            report.kills[kind] += 1
            took = harness.converge(round_)
            report.convergence.append(took)
            if rotating:
                report.api_key_bound += (kind == "operator") + harness.operator_restarts - exits
            found = harness.orphans()
            orphans = [o for o in found if not o.startswith("API key")]
            report.orphans.extend(f"round {round_}: {o}" for o in orphans)
            report.api_keys_left.extend(f"round {round_}: {o}" for o in found if o.startswith("API key"))
            minted, rejected, rotated = harness.bootstrap_uses()
            report.minted, report.rotations = minted, rotated
            report.operator_exits = harness.operator_restarts
            report.bootstrap_uses = max(0, minted - 1) + rejected
            log(f"round {round_}/{rounds}: {'+'.join(changes)} in flight, killed {what} for {downtime:.1f}s; "
                f"converged in {took:.1f}s; orphans {len(found)}; mints {minted}, rotations {rotated}")
            for orphan in found:
                log(f"    ORPHAN: {orphan}")
            if report.bootstrap_uses:
                raise ChaosFailure(f"round {round_}: the bootstrap key was needed again "
                                   f"(minted {minted}x, working key rejected {rejected}x)")
            report.rounds_survived = round_
        if report.orphans:
            report.failure = f"{len(report.orphans)} orphan(s) found"
        elif len(report.api_keys_left) > report.api_key_bound:
            report.failure = (f"{len(report.api_keys_left)} API key(s) left, more than the {report.api_key_bound} "
                              "leader(s) that ended while a working-key rotation was in flight")
    except ChaosFailure as exc:
        report.failure = str(exc)
    finally:
        harness.close()
        report.wall_seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["operator"]:
        parser = argparse.ArgumentParser(prog="hack.chaos operator")
        for flag in ("--kubeconfig", "--namespace", "--identity", "--clock-file", "--ports-file"):
            parser.add_argument(flag, required=True)
        from tailnet_operator import logs

        logs.configure("console", "info")
        return asyncio.run(run_operator(parser.parse_args(argv[1:])))
    parser = argparse.ArgumentParser(prog="hack.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get(ROUNDS_ENV, "20")))
    parser.add_argument("--seed", type=int, default=None, help=f"default ${SEED_ENV}, else random (printed)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs) even on success")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else seed_from_env()
    root = REPO / "_artifacts" / "chaos" / f"{dt.datetime.now():%Y%m%d-%H%M%S}-{seed}"
    with _environment(root) as env:
        report = run_chaos(args.rounds, seed, env=env)
    print(report.summary())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if report.failure:
        print(f"logs kept in {root / 'logs'}")
        return 1
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
