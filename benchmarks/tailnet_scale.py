"""The agent at tailnet scale: the agent against tailscaled (userspace) on one tailnet of
``--sizes`` peers under the policy benchmark's ``--rules``-rule policy (up to ``--full-policy-max``
peers; above, the open policy of :func:`open_policy`, see there why).

Real Headscale on 127.0.0.1. The peers are registered with the agent's own control client
(:mod:`tailnet_agent.control`): a Noise connection per machine key, a register with a pre-auth key,
and one non-streaming map request that reports a disco key, an endpoint and a home DERP region, as
a node does before it polls; then the connection is closed, so the peers are offline nodes in
everyone's netmap. Half of them belong to the users the policy's groups name, half carry the
policy's ``tag:svc-N`` tags (the first ten). The two measured clients carry ``tag:bench-client`` and every
``tag:svc-N``, so the policy's grants all apply to them; a rule lets every node reach them (each sees
the whole tailnet) and one lets them reach ``tag:bench-server``, a tailscaled in front of a
sink/source server (its own process) on 127.0.0.1.

Each round starts a fresh agent (``AGENT_MODE=egress``, DERP only: ``TAILNET_UDP_PORT=off``) and a
fresh tailscaled (``--tun=userspace-networking``, ``TS_DEBUG_ALWAYS_USE_DERP``), waits until both
hold every peer (the agent's trace, ``tailscale status``), and measures:

* RSS of each process once both hold the full netmap and have carried a connection, and after the round;
* map update: ``--updates`` new peers registered one after another; the time from the register
  request to the peer being in each client's netmap (the agent's trace records when it applied the
  message; tailscaled is asked with LocalAPI ``whois`` every 10 ms), then ``--updates`` more
  without polling for each client's CPU time per update (less its idle rate, taken before; the
  window ends 3 s after both hold them, tailscaled asked only every 2 s);
* connection setup (connect + one byte echoed, to the server's tailnet address over DERP, through the
  agent's egress listener and tailscaled's SOCKS5 listener in alternating batches) while new peers
  register (up to ``--stream-rate`` a second, four at once), each a map update for both;
* the agent's own time per message (decode, the netmap's projection onto the data plane, the filter
  compile), from the trace.

The agent runs as ``python -m benchmarks.agent_trace``: the agent's own entry point with a
trace around the control client's message handler and the node's netmap steps (timings and the node
keys each message added, one JSON line per message). Nothing leaves 127.0.0.0/8.

    python -m benchmarks.tailnet_scale [--sizes 200,1000] [--full-policy-max 200] [--rounds 3] [--json F] [--doc F]

``--from-json F`` renders an earlier run's JSON, ``--from-log F`` the per-round lines of a run that
was stopped before it wrote its JSON (medians only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import paths
from benchmarks.agent_trace import TRACE
from benchmarks.ingress_serve import connects, process, until_reachable
from benchmarks.pathcheck import fetch
from benchmarks.policy import base_policy
from benchmarks.record import commit, write_section
from benchmarks.runtime.harness import cpu_seconds, percentile, rss_mib
from hack import versions
from hack.localenv import Environment, Headscale, TailscaleNode, free_port, wait_until
from tailnet_agent.contract import environment as env_names

SECTION = "tailnet-scale"
"""The doc's markers: ``<!-- bench:SECTION:begin -->`` and ``...:end -->``."""
CLIENT_TAG, SERVER_TAG, PEER_TAG = "tag:bench-client", "tag:bench-server", "tag:bench-peer"
TAGGED_SERVICES = 10
"""Services whose tag the tagged peers carry (the clients carry every service's tag, so each grant
has them as its destination whatever the peers carry)."""
JOIN_TIMEOUT = 1200.0
"""Seconds a client may take to join and hold its first netmap."""
REGION = 999
"""The embedded DERP region of the local Headscale (hack/localenv)."""


# -- the tailnet --------------------------------------------------------------------------------


def scale_policy(rules: int) -> tuple[str, int, int]:
    """The policy benchmark's base of ``rules`` rules with the benchmark's tags and rules added;
    returns the policy's JSON, its number of teams and of services."""
    from tailnet_operator.policy import parse_hujson

    doc: dict[str, Any] = dict(parse_hujson(base_policy(rules)))
    teams, services = max(1, rules // 40), max(1, rules // 10)
    doc["tagOwners"] = {**doc["tagOwners"], **{tag: ["group:team-0"] for tag in (CLIENT_TAG, SERVER_TAG, PEER_TAG)}}
    doc["acls"] = [*doc["acls"], {"action": "accept", "src": ["*"], "dst": [f"{CLIENT_TAG}:*"]},
                   {"action": "accept", "src": [CLIENT_TAG], "dst": [f"{SERVER_TAG}:*"]}]
    return json.dumps(doc), teams, services


def open_policy(policy: str) -> str:
    """The policy's groups and tag owners with one rule that lets everyone reach everyone.

    Headscale holds it while peers register, and it is the measured policy at sizes above
    ``--full-policy-max``: Headscale 0.29 rebuilds its peer map on every node change by testing
    every pair of nodes against every rule (``PolicyManager.BuildPeerMap``), so under 2,000 rules a
    client joining 400 nodes waited 66 s for its first map here, and the cost grows with the square
    of the nodes.
    Under this policy the first rule matches every pair."""
    doc = json.loads(policy)
    return json.dumps({"groups": doc["groups"], "tagOwners": doc["tagOwners"],
                       "acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]})


@dataclass
class Peer:
    """One registered peer: its control client."""

    client: Any


class Registrar:
    """Registers peers with the agent's control client, spread over the policy's users and tags."""

    def __init__(self, headscale: Headscale, teams: int, services: int) -> None:
        self.headscale = headscale
        lifetime = dt.timedelta(hours=12)

        def user_key(team: int) -> str:
            user = headscale.create_user(f"alice{team}@example.internal")["id"]
            return headscale.create_preauth_key(user_id=user, reusable=True, lifetime=lifetime)

        def tag_key(service: int) -> str:
            return headscale.create_preauth_key(tags=[f"tag:svc-{service}", PEER_TAG], reusable=True,
                                                lifetime=lifetime)

        with ThreadPoolExecutor(8) as pool:
            self.user_keys = list(pool.map(user_key, range(teams)))
            self.tag_keys = list(pool.map(tag_key, range(min(services, TAGGED_SERVICES))))
        self.count = 0

    def key(self, index: int) -> str:
        """Even peers belong to a team's user, odd ones carry a service tag."""
        keys = self.user_keys if index % 2 == 0 else self.tag_keys
        return keys[index // 2 % len(keys)]

    async def register(self) -> Peer:
        """Register the next peer and report its endpoint, disco key and home region."""
        from tailnet_agent.control.client import CAPABILITY_VERSION, ControlClient, ControlOptions
        from tailnet_agent.control.controlconn import ControlConnection

        index, self.count = self.count, self.count + 1
        hs = self.headscale
        client = ControlClient(ControlOptions(url=hs.url, auth_key=self.key(index), hostname=f"peer-{index}",
                                              ca_bundle=hs.ca_bundle, ephemeral=False))
        client.preferred_derp = REGION
        client.endpoints = [(f"127.0.0.9:{10000 + index % 50000}", 1)]
        conn = await ControlConnection.open(hs.url, client.keys.machine, capability_version=CAPABILITY_VERSION,
                                            ca_bundle=hs.ca_bundle)
        pump = asyncio.create_task(conn.run())
        try:
            await client.register(conn)
            body = {**client.map_request(), "Stream": False, "OmitPeers": True, "KeepAlive": False}
            resp = await conn.request("POST", "/machine/map", body)
            if resp.status != 200:
                raise RuntimeError(f"map request of peer-{index} answered {resp.status}")
        finally:
            await conn.aclose()
            await asyncio.gather(pump, return_exceptions=True)
        return Peer(client)

    async def grow(self, total: int, *, concurrency: int = 96, progress: Callable[[int], None] | None = None) -> None:
        """Register peers until ``total`` are registered."""
        pending = total - self.count
        queue = iter(range(pending))

        async def worker() -> None:
            for i in queue:
                await self.register()
                if progress is not None and (i + 1) % 500 == 0:
                    progress(total - pending + i + 1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def read_trace(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


# -- one round ----------------------------------------------------------------------------------


@dataclass
class Side:
    """One client's figures in one round."""

    peers: int = 0
    rss_ready_mib: float = 0.0
    rss_after_mib: float = 0.0
    update_ms: list[float] = field(default_factory=list)
    """Register request to the new peer in this client's netmap, per update."""
    cpu_per_update_ms: float = 0.0
    setup_ms: list[float] = field(default_factory=list)


@dataclass
class Round:
    size: int
    round: int
    loadavg: float
    agent: Side
    tailscaled: Side
    trace: dict[str, Any] = field(default_factory=dict)
    """The agent's own timings (ms) from its trace: the full netmap's and the updates' medians."""
    stream: dict[str, float] = field(default_factory=dict)


async def localapi_status(node: TailscaleNode, path: str) -> int:
    """The HTTP status tailscaled's LocalAPI answers ``GET path``."""
    reader, writer = await asyncio.open_unix_connection(str(node.socket))
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: local-tailscaled.sock\r\n\r\n".encode())
        await writer.drain()
        return int((await reader.readline()).split()[1])
    finally:
        writer.close()


async def until_seen(check: Callable[[], Any], deadline: float, interval: float = 0.005) -> float:
    """Poll the async ``check`` until true; the wall time it first was."""
    while time.monotonic() < deadline:
        if await check():
            return time.time()
        await asyncio.sleep(interval)
    raise TimeoutError("a registered peer did not reach the client in time")


async def tailscaled_holds(node: TailscaleNode, keys: Sequence[str], deadline: float, interval: float = 2.0) -> None:
    """Wait until tailscaled holds every peer of ``keys``: Headscale may send it a change seconds after
    the agent got it. Asked every ``interval`` s, so the asking costs it next to nothing."""
    pending = list(keys)
    while True:
        pending = [key for key in pending if await localapi_status(node, f"/localapi/v0/whois?addr={key}") != 200]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tailscaled does not hold {pending[0]} in time")
        await asyncio.sleep(interval)


async def agent_applied(trace: Path, key: str, deadline: float) -> float:
    """When the agent applied the message that added the peer with node key ``key`` (its trace)."""
    while time.monotonic() < deadline:
        if (seen := next((line["t"] for line in read_trace(trace) if key in line["added"]), None)) is not None:
            return float(seen)
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the agent did not apply {key} in time")


async def cpu_rates(pids: Sequence[int], seconds: float) -> list[float]:
    """CPU seconds per second of each process over ``seconds`` (what it spends idle)."""
    before = [cpu_seconds(pid) for pid in pids]
    await asyncio.sleep(seconds)
    return [(cpu_seconds(pid) - b) / seconds for pid, b in zip(pids, before, strict=True)]


STEPS = ("peer_specs", "set_peers", "disco_peers", "project_peers", "upsert_peers", "remove_peers", "disco_update",
         "filter_rules", "set_filter")
"""The netmap steps the agent's trace may time (:mod:`benchmarks.agent_trace`)."""


def trace_summary(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The agent's own timings (ms): the last full netmap's steps, and the medians of the messages
    after it (updates)."""
    fulls = [line for line in lines if line.get("full")]
    if not fulls:
        return {}
    full = fulls[-1]
    after = lines[lines.index(full) + 1:]
    # Steps of the agent that wrote the trace (an earlier agent had other ones).
    present = {step for line in lines for step in line}
    steps = ("ms", "cpu_ms", "on_netmap", *(step for step in STEPS if step in present))
    out: dict[str, Any] = {"filter_rules_count": full.get("filter_count", 0), "updates": len(after)}
    out["full"] = {step: round(float(full.get(step, 0.0)), 2) for step in steps}
    out["full"]["decode"] = round(float(full["ms"]) - float(full.get("on_netmap", 0.0)), 2)
    if after:
        out["update"] = {step: round(statistics.median(float(line.get(step, 0.0)) for line in after), 2)
                         for step in steps}
        out["update"]["decode"] = round(statistics.median(
            float(line["ms"]) - float(line.get("on_netmap", 0.0)) for line in after), 2)
    return out


@contextlib.contextmanager
def agent_process(env: Environment, headscale: Headscale, key: str, target: str, port: int, listen: int,
                  name: str, trace: Path) -> Iterator[tuple[int, str]]:
    key_file = env.root / f"{name}-auth-key"
    key_file.write_text(key)
    health = f"127.0.0.1:{free_port()}"
    config = {**os.environ, env_names.AGENT_MODE: env_names.EGRESS, env_names.CONTROL_URL: headscale.url,
              env_names.AUTH_KEY_FILE: str(key_file), env_names.HOSTNAME: name, env_names.UDP_PORT: "off",
              env_names.CA_BUNDLE: str(headscale.ca_bundle), env_names.BIND_ADDRESS: "127.0.0.1",
              env_names.TARGETS: json.dumps([{"name": "bench", "address": target,
                                              "ports": [{"port": port, "listen": listen}]}]),
              env_names.HEALTH_ADDRESS: health, env_names.LOG_LEVEL: "warning", TRACE: str(trace)}
    with process([sys.executable, "-m", "benchmarks.agent_trace"], env.log_dir / f"{name}.log",
                 config) as proc:
        wait_until(lambda: fetch(f"http://{health}/readyz"), timeout=JOIN_TIMEOUT, what="the agent's /readyz")
        yield proc.pid, health


async def measure_round(env: Environment, headscale: Headscale, registrar: Registrar, *, size: int, rnd: int,
                        client_key: str, target: str, port: int, updates: int, setups: int,
                        stream_rate: float) -> Round:
    expected = registrar.count + 2  # every peer, the server, the other client
    name = f"scale-{size}-{rnd}"
    trace = env.root / f"{name}-agent.trace"
    listen = free_port()
    node = await asyncio.to_thread(env.tailscale_node, f"{name}-ts", headscale,
                                   env={"TS_DEBUG_ALWAYS_USE_DERP": "true"})
    # Headscale takes minutes for a first map at thousands of peers under 2,000 rules.
    await asyncio.to_thread(node.up, client_key, timeout=JOIN_TIMEOUT)
    try:
        with agent_process(env, headscale, client_key, target, port, listen, f"{name}-agent", trace) as (pid, _):
            return await _measure(registrar, node, pid, trace, size=size, rnd=rnd, expected=expected,
                                  dials=(paths.tcp_dialer("127.0.0.1", listen),
                                         paths.socks5_dialer("127.0.0.1", node.socks5_port, target, port)),
                                  updates=updates, setups=setups, stream_rate=stream_rate)
    finally:
        with contextlib.suppress(RuntimeError):
            await asyncio.to_thread(node.cli, "logout")  # its key is ephemeral: Headscale deletes it
        await asyncio.to_thread(node.stop)


async def _measure(registrar: Registrar, node: TailscaleNode, pid: int, trace: Path, *, size: int, rnd: int,
                   expected: int, dials: tuple[paths.Dial, paths.Dial], updates: int, setups: int,
                   stream_rate: float) -> Round:
    agent, ts = Side(), Side()
    ts_pid = node.process.pid
    assert ts_pid is not None, "tailscaled is running"
    deadline = time.monotonic() + 600

    def ts_peers() -> int:
        return len(node.status().get("Peer") or {})

    # Both hold the whole tailnet before anything is measured.
    while (agent_peers := max((line["peers"] for line in read_trace(trace)), default=0)) < expected or \
            (ts_count := await asyncio.to_thread(ts_peers)) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers after 600 s: agent {agent_peers}, tailscaled {ts_count}, expected {expected}")
        await asyncio.sleep(1)
    agent.peers, ts.peers = agent_peers, ts_count
    for dial in dials:
        await until_reachable(dial)
    await asyncio.sleep(3)
    agent.rss_ready_mib, ts.rss_ready_mib = rss_mib(pid), rss_mib(ts_pid)
    idle = await cpu_rates((pid, ts_pid), 5.0)  # before any update: Headscale may send one late
    full_lines = len(read_trace(trace))

    # Map updates, one at a time: the time until each client holds the new peer.
    for _ in range(updates):
        sent = time.time()
        key = str((await registrar.register()).client.keys.node.public)
        deadline = time.monotonic() + 120

        async def in_tailscaled(key: str = key) -> bool:
            return await localapi_status(node, f"/localapi/v0/whois?addr={key}") == 200

        ts.update_ms.append((await until_seen(in_tailscaled, deadline, interval=0.01) - sent) * 1000)
        agent.update_ms.append((await agent_applied(trace, key, deadline) - sent) * 1000)
        await asyncio.sleep(0.5)  # the next update is measured alone

    # The CPU they cost, without LocalAPI polls: the same number of updates, less the idle rate.
    before, started = (cpu_seconds(pid), cpu_seconds(ts_pid)), time.monotonic()
    keys = [str((await registrar.register()).client.keys.node.public) for _ in range(updates)]
    await agent_applied(trace, keys[-1], time.monotonic() + 120)
    await tailscaled_holds(node, keys, time.monotonic() + 120)
    await asyncio.sleep(3)
    spent = cpu_seconds(pid) - before[0], cpu_seconds(ts_pid) - before[1]
    elapsed = time.monotonic() - started
    agent.cpu_per_update_ms = max(0.0, spent[0] - idle[0] * elapsed) * 1000 / max(updates, 1)
    ts.cpu_per_update_ms = max(0.0, spent[1] - idle[1] * elapsed) * 1000 / max(updates, 1)

    # Setup while endpoint changes stream.
    before_stream = len(read_trace(trace))
    stop_stream = asyncio.Event()
    sent_moves = 0

    async def stream() -> None:
        """A new peer every 1/rate s (at most four registering at once): Headscale sends no update
        for an offline peer's endpoint change, a new peer reaches every client."""
        nonlocal sent_moves
        busy: set[asyncio.Task[Peer]] = set()
        while not stop_stream.is_set():
            busy = {task for task in busy if not task.done()}
            if len(busy) < 4:
                busy.add(asyncio.create_task(registrar.register()))
                sent_moves += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_stream.wait(), 1 / stream_rate)
        await asyncio.gather(*busy)

    streamer = asyncio.create_task(stream())
    started = time.monotonic()
    try:
        batch = max(1, setups // 4)
        for _ in range(max(1, setups // batch)):
            agent.setup_ms += [t * 1000 for t in await paths.setup_times(dials[0], batch)]
            ts.setup_ms += [t * 1000 for t in await paths.setup_times(dials[1], batch)]
    finally:
        stop_stream.set()
        await streamer
    seconds = time.monotonic() - started
    streamed = len(read_trace(trace)) - before_stream
    agent.rss_after_mib, ts.rss_after_mib = rss_mib(pid), rss_mib(ts_pid)
    lines = read_trace(trace)
    return Round(size=size, round=rnd, loadavg=os.getloadavg()[0], agent=agent, tailscaled=ts,
                 trace=trace_summary(lines[:full_lines]) | {"update_messages": trace_summary(lines).get("update")},
                 stream={"seconds": round(seconds, 1), "peers_added": sent_moves,
                         "agent_messages": streamed})


# -- the run ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def tailnet(rules: int) -> AsyncIterator[tuple[Environment, Headscale, Registrar, str, str, int]]:
    """Headscale with the policy, the registrar, the client key, and the server (its tailnet
    address and port) behind which the sink/source server runs in its own process."""
    with Environment() as env:
        headscale = env.headscale()
        policy, teams, services = scale_policy(rules)
        registrar = Registrar(headscale, teams, services)
        headscale.api("PUT", "/api/v1/policy", {"policy": open_policy(policy)})
        client_key = headscale.create_preauth_key(tags=[CLIENT_TAG, *(f"tag:svc-{s}" for s in range(services))],
                                                  reusable=True, ephemeral=True, lifetime=dt.timedelta(hours=12))
        port = free_port()
        with process([sys.executable, "-m", "benchmarks.paths", "serve", "127.0.0.1", str(port)],
                     env.log_dir / "sink.log"):
            wait_until(lambda: connects(port), timeout=30, what="the sink/source server")
            yield env, headscale, registrar, client_key, policy, port


async def run(sizes: list[int], rounds: int, *, rules: int, full_policy_max: int, updates: int, setups: int,
              stream_rate: float) -> dict[str, Any]:
    load_before = os.getloadavg()
    results: list[Round] = []
    registration: dict[int, float] = {}
    policies: dict[int, str] = {}
    async with tailnet(rules) as (env, headscale, registrar, client_key, policy, port):
        server = None
        for size in sizes:
            started = time.monotonic()
            headscale.api("PUT", "/api/v1/policy", {"policy": open_policy(policy)})
            await registrar.grow(size, progress=lambda n: print(f"registered {n}", flush=True))
            measured = policy if size <= full_policy_max else open_policy(policy)
            headscale.api("PUT", "/api/v1/policy", {"policy": measured})
            policies[size] = f"{rules:,} rules" if size <= full_policy_max else "open"
            registration[size] = time.monotonic() - started
            print(f"{size} peers registered in {registration[size]:.0f} s", flush=True)
            if server is None:
                key = headscale.create_preauth_key(tags=[SERVER_TAG], reusable=True)
                server = await asyncio.to_thread(env.tailscale_node, "bench-server", headscale, authkey=key)
            target = await asyncio.to_thread(server.ipv4)
            for rnd in range(rounds):
                result = await measure_round(env, headscale, registrar, size=size, rnd=rnd, client_key=client_key,
                                             target=target, port=port, updates=updates, setups=setups,
                                             stream_rate=stream_rate)
                print(json.dumps(summary_line(result)), flush=True)
                results.append(result)
    return {"date": dt.date.today().isoformat(), "commit": commit(), "cpus": os.cpu_count(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rules": rules,
            "updates": updates, "setups": setups, "stream_rate": stream_rate,
            "registration_s": registration, "policies": policies, "full_policy_max": full_policy_max,
            "rounds": [asdict(r) for r in results]}


def summary_line(r: Round) -> dict[str, Any]:
    def side(s: Side) -> dict[str, Any]:
        return {"peers": s.peers, "rss": [round(s.rss_ready_mib, 1), round(s.rss_after_mib, 1)],
                "update_p50": round(statistics.median(s.update_ms), 1) if s.update_ms else None,
                "cpu_update": round(s.cpu_per_update_ms, 1),
                "setup_p50": round(statistics.median(s.setup_ms), 2) if s.setup_ms else None}

    return {"size": r.size, "round": r.round, "load": r.loadavg, "agent": side(r.agent),
            "tailscaled": side(r.tailscaled), "trace": r.trace, "stream": r.stream}


# -- the report ---------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    """The median of the values that are numbers (NaN marks a figure a round could not give)."""
    known = [v for v in values if v == v]
    return float(statistics.median(known)) if known else float("nan")


def side_figures(side: dict[str, Any]) -> dict[str, float]:
    """One client's figures in one round, from its JSON."""
    return {"rss_ready": side["rss_ready_mib"], "rss_after": side["rss_after_mib"],
            "update_p50": _median(side["update_ms"]),
            # 0: the idle rate, taken over 5 s, exceeded what the window spent (a late update in it).
            "cpu_update": side["cpu_per_update_ms"] or float("nan"),
            "setup_p50": _median(side["setup_ms"]),
            "setup_p99": side.get("setup_p99_ms", percentile(side["setup_ms"], 0.99))}


def rounds_from_log(text: str) -> list[dict[str, Any]]:
    """Rounds as their progress lines give them (a run stopped before its JSON): medians only,
    so each side's setup p99 is unknown (NaN)."""
    rounds = []
    for line in text.splitlines():
        if not line.startswith('{"size"'):
            continue
        doc = json.loads(line)

        def side(s: dict[str, Any]) -> dict[str, Any]:
            return {"peers": s["peers"], "rss_ready_mib": s["rss"][0], "rss_after_mib": s["rss"][1],
                    "update_ms": [s["update_p50"]], "cpu_per_update_ms": s["cpu_update"],
                    "setup_ms": [s["setup_p50"]], "setup_p99_ms": float("nan")}

        rounds.append({"size": doc["size"], "round": doc["round"], "loadavg": doc["load"],
                       "agent": side(doc["agent"]), "tailscaled": side(doc["tailscaled"]),
                       "trace": doc["trace"], "stream": doc["stream"]})
    return rounds


COLUMNS = (("rss_ready", "RSS, full netmap MiB", 1), ("rss_after", "RSS after the round MiB", 1),
           ("update_p50", "new peer visible p50 ms", 0), ("cpu_update", "CPU per update ms", 1),
           ("setup_p50", "setup p50 ms", 1), ("setup_p99", "setup p99 ms", 1))


def size_table(rounds: Sequence[dict[str, Any]]) -> list[str]:
    """Rows agent / tailscaled: the median of the rounds, every round's figure in brackets."""
    lines = ["| client | peers held | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for name, label in (("agent", "agent"), ("tailscaled", "tailscaled userspace")):
        figures = [side_figures(r[name]) for r in rounds]
        peers = sorted({r[name]["peers"] for r in rounds})
        cells = []
        for key, _, digits in COLUMNS:
            values = [f[key] for f in figures]
            shown = ", ".join("-" if v != v else f"{v:.{digits}f}" for v in values)
            middle = _median(values)
            cells.append("-" if middle != middle else f"**{middle:.{digits}f}** ({shown})")
        held = f"{peers[0]:,}" if len(peers) == 1 else f"{peers[0]:,}-{peers[-1]:,}"
        lines.append(f"| {label} | {held} | " + " | ".join(cells) + " |")
    return lines


def goals(rounds: Sequence[dict[str, Any]]) -> list[str]:
    """Each goal at one size: met or missed, on the medians of the rounds."""
    agent = [side_figures(r["agent"]) for r in rounds]
    ts = [side_figures(r["tailscaled"]) for r in rounds]
    out = []
    for key, goal in (("rss_after", "RSS"), ("cpu_update", "map update (CPU per update)"), ("setup_p50", "setup p50")):
        a, t = _median([f[key] for f in agent]), _median([f[key] for f in ts])
        if a != a or t != t:
            out.append(f"{goal} ≤ tailscaled's: not measured (no round gave the figure for both)")
            continue
        out.append(f"{goal} ≤ tailscaled's: {'met' if a <= t else 'missed'} ({a:.1f} against {t:.1f}, "
                   f"{a / t:.2f}x)")
    return out


def agent_steps(rounds: Sequence[dict[str, Any]]) -> list[str]:
    """The agent's own time per message (medians of the rounds), full netmap and update."""
    names = (("decode", "decode the message into the netmap"), ("peer_specs", "project the peers"),
             ("set_peers", "data plane set_peers"), ("disco_peers", "disco's peers"),
             ("project_peers", "project the changed peers"), ("upsert_peers", "data plane upsert_peers"),
             ("remove_peers", "data plane remove_peers"), ("disco_update", "disco's changed peers"),
             ("filter_rules", "project the filter"), ("set_filter", "data plane set_filter (compile)"),
             ("ms", "whole message (wall)"), ("cpu_ms", "whole message (CPU)"))
    lines = ["| step | full netmap ms | one update ms |", "|---|---|---|"]
    for key, label in names:
        full = _median([float(r["trace"].get("full", {}).get(key, float("nan"))) for r in rounds])
        update = _median([float((r["trace"].get("update_messages") or {}).get(key, float("nan"))) for r in rounds])
        if full != full and update != update:
            continue  # a step this run's agent does not have
        lines.append(f"| {label} | {'-' if full != full else f'{full:.1f}'} | "
                     f"{'-' if update != update else f'{update:.1f}'} |")
    return lines


def report(doc: dict[str, Any]) -> str:
    rounds = doc["rounds"]
    sizes = sorted({r["size"] for r in rounds})
    round_loads = ", ".join(f"{r['loadavg']:.1f}" for r in rounds)
    loads = (f"load average {', '.join(f'{x:.1f}' for x in doc['loadavg_before'])} before the run, "
             f"{', '.join(f'{x:.1f}' for x in doc['loadavg_after'])} after (each round's 1-minute figure: "
             f"{round_loads})") if doc["loadavg_before"] else f"1-minute load average at each round: {round_loads}"
    out = [f"### The agent at tailnet scale, {doc['date']} (commit {doc['commit']})", "",
           f"Headscale {versions.HEADSCALE} with embedded DERP and tailscaled {versions.TAILSCALE} on 127.0.0.1, "
           f"{doc['cpus']} cores; {loads}. "
           f"Policy (in each heading): the policy benchmark's {doc['rules']:,}-rule base with the benchmark's tags "
           "and two rules, or `open`: its groups and tag owners with one rule that lets everyone reach everyone, "
           "since Headscale 0.29 tests every pair of nodes against every rule on each change (below). "
           f"{len(rounds) // max(len(sizes), 1)} rounds per size, "
           "each with a fresh agent and tailscaled; cells are the median of the rounds, every round's figure "
           f"in brackets. Map update: {doc['updates']} new peers per round. Setup: {doc['setups']} connections "
           f"per client over DERP while new peers register (up to {doc['stream_rate']:g} a second, four at once).", ""]
    for size in sizes:
        at = [r for r in rounds if r["size"] == size]
        filter_rules = sorted({r["trace"].get("filter_rules_count", 0) for r in at})
        streamed = [r["stream"] for r in at]
        registered = float(doc["registration_s"].get(str(size), doc["registration_s"].get(size, 0)))
        policy = doc["policies"].get(str(size), doc["policies"].get(size, ""))
        out += [f"#### {size:,} peers, policy: {policy}", "",
                f"Registered in {registered:.0f} s "
                f"(cumulative). Filter rules as received: {', '.join(f'{n:,}' for n in filter_rules)}. "
                "During the setup measurement the agent applied "
                f"{', '.join(str(s['agent_messages']) for s in streamed)} map messages "
                f"({', '.join(str(s['peers_added']) for s in streamed)} peers registered meanwhile).", "",
                *size_table(at), "", *[f"- {g}" for g in goals(at)], "",
                "The agent's own time per map message (its trace):", "", *agent_steps(at), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="200,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rules", type=int, default=2000)
    parser.add_argument("--full-policy-max", type=int, default=200,
                        help="sizes above this are measured under the open policy (see open_policy)")
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--setups", type=int, default=200)
    parser.add_argument("--stream-rate", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None)
    parser.add_argument("--section", default=SECTION, help=f"the doc's markers (default {SECTION})")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: render the tables of an earlier run's --json")
    parser.add_argument("--from-log", type=Path, default=None,
                        help="measure nothing: render the rounds of a stopped run's output (medians only)")
    parser.add_argument("--log-commit", default=None, help="with --from-log: the commit the stopped run measured")
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    elif args.from_log:
        text = args.from_log.read_text()
        rounds = rounds_from_log(text)
        doc = {"date": dt.date.today().isoformat(), "commit": f"{args.log_commit or commit()}, rounds of a stopped run",
               "cpus": os.cpu_count(), "loadavg_before": [], "loadavg_after": [], "rules": args.rules,
               "updates": args.updates, "setups": args.setups, "stream_rate": args.stream_rate,
               "full_policy_max": args.full_policy_max, "rounds": rounds,
               "registration_s": {int(m.split()[0]): float(m.split()[-2]) for m in text.splitlines()
                                  if m.endswith(" s") and " peers registered in " in m},
               "policies": {r["size"]: f"{args.rules:,} rules" if r["size"] <= args.full_policy_max else "open"
                            for r in rounds}}
    else:
        doc = asyncio.run(run([int(s) for s in args.sizes.split(",")], args.rounds, rules=args.rules,
                              full_policy_max=args.full_policy_max,
                              updates=args.updates, setups=args.setups, stream_rate=args.stream_rate))
    if args.json and not (args.from_json or args.from_log):
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    text = report(doc)
    print(text)
    if args.doc:
        write_section(args.doc, f"<!-- bench:{args.section}:begin -->", f"<!-- bench:{args.section}:end -->", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
