"""Gateway routing benchmark: what an HTTPRoute's path rules cost the agent per request.

Path: a load client on this machine -> a tailscaled "laptop" in userspace networking (its SOCKS5
proxy) -> the tailnet (direct UDP on loopback) -> the agent (``AGENT_MODE=ingress``) -> the
ingress benchmark's aiohttp backend on 127.0.0.1 (256-byte answers). HTTP/1.1 with keep-alive in
plaintext, as the ingress benchmark's plain rows: requests/s, p50/p99 latency at 1 and 32 clients
(each client one connection), and the CPU time per request of every process on the path.

One agent process serves both rows, two plaintext http exposes on two tailnet ports, both to the
same backend port, so the build, the limits, the backend and the laptop are the same and only the
routing differs:

* routed (port 80): a Gateway with one ``HTTP`` listener on port 80 for ``routes.bench.test`` and
  one HTTPRoute of 20 rules (the issue's figure), ``PathPrefix`` ``/r00`` ... ``/r19``, translated
  by the operator's own code (``gatewayapi.as_ingress``, then ``ingress.exposes_document``); the
  requests ask for ``/r19/bench``. A host serves at most ``PATHS_MAX`` paths: the translation
  refuses a route of one rule more (``TooManyPaths``), which each run checks and states;
* plain (port 8080): a TailnetIngress plaintext http expose, one host, no paths
  (``exposes_document`` as well): the agent forwards without choosing a route.

The rule hit, and why it is the worst case of this table (``tailnet_agent.forward.http.routes``):
``choose`` walks every route of the host for every request, with no early exit, and keeps the
first of the best-ranked matches (longest path in elements, then in characters, Exact, method,
headers, query; ties go to the route listed first, which is the translation's rule order). The
rules rank alike (one element, four characters, Prefix, no other match), so ``/r19``, the last
rule, is the last the walk reaches and the last in the precedence order: a request for
``/r19/bench`` is compared with every rule before the only match. Since the walk never stops
early, any one rule of this table costs the same walk; ``/r19`` would also be the worst for a
first-match walk. What costs more is a request several rules match (each match is ranked
against the best so far): the run times the routing decision alone on the same routes and on 20
nested prefixes that all match one request, beside the end-to-end rows.

Why a Service per rule: the translation names backends by Service (``<service>.bench.svc``), which
nothing resolves here, so each backend host is replaced by 127.0.0.1 (the Service ports are the
real ports); nothing else of the document is changed. The last rule names the backend; the others
name Services on a port nothing listens on. A request any other rule took would get 502, one no
rule took 404 (``unmatchedPaths: NotFound``), so the load client, which requires a 200 with the
backend's body for every request, verifies every measured request's route; before measuring, the
parsed exposes are checked with the agent's own ``choose`` and one request per outcome (200, 502,
404) goes through the tailnet. The agent's path is checked direct at both ends before and after.

    python -m benchmarks.gateway_routing [--seconds 6] [--rounds 5] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import timeit
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import paths
from benchmarks.ingress_serve import (
    AGENT,
    BODY,
    CONCURRENCY,
    HttpPath,
    Load,
    agent_env,
    connects,
    loadavg,
    measured_load,
    peer_ip,
    process,
)
from benchmarks.pathcheck import DIRECT, PathNotAsClaimed, agent_check, agent_udp, fetch
from benchmarks.record import commit, load_average, publish
from hack import versions
from hack.localenv import Environment, free_port, wait_until
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.exposes import Expose, Route, VirtualHost, parse_exposes
from tailnet_agent.forward.http.routes import Forward, choose, decide
from tailnet_operator.api.ingress import PATHS_MAX, TailnetIngress
from tailnet_operator.resources import gatewayapi as gw
from tailnet_operator.resources.ingress import exposes_document

NAMESPACE = "bench"
ROUTED_HOST, PLAIN_HOST = "routes.bench.test", "plain.bench.test"
ROUTED_PORT, PLAIN_PORT = 80, 8080
RULES = 20
"""The rules of the routed row's HTTPRoute (at most PATHS_MAX)."""
HIT = RULES - 1
TARGET = f"/r{HIT:02d}/bench"
"""What every routed request asks for: under the last rule's prefix."""
MISROUTED = f"/r{HIT - 1:02d}/bench"
CPU_COLUMNS = ("load client", "laptop tailscaled", "agent", "backend")
ROUTED = f"routed: HTTPRoute, {RULES} PathPrefix rules, GET {TARGET}"
PLAIN = "plain: TailnetIngress http expose, no paths, GET /"


# -- the exposes, by the operator's translation ---------------------------------------------------


def flat_paths(count: int = RULES) -> list[str]:
    """``/r00`` ... : distinct one-element prefixes, as a route's rules usually are."""
    return [f"/r{k:02d}" for k in range(count)]


def nested_paths(count: int = RULES) -> list[str]:
    """``/r00``, ``/r00/r01``, ...: distinct prefixes that all match the longest."""
    return ["/" + "/".join(f"r{j:02d}" for j in range(k + 1)) for k in range(count)]


def service_of(k: int, hit: int) -> str:
    return "backend" if k == hit else f"decoy-{k:02d}"


def gateway_plan(prefixes: list[str], *, hit: int, backend_port: int, closed_port: int) -> gw.GatewayPlan:
    """The Gateway and its one HTTPRoute (rule ``k`` to its own Service; rule ``hit``'s is the
    backend, the others' are on ``closed_port``) through :func:`gatewayapi.as_ingress`."""
    gateway = gw.GatewayObject.model_validate({
        "metadata": {"name": "routes", "namespace": NAMESPACE, "uid": "bench-gateway"},
        "spec": {"gatewayClassName": "tailnet",
                 "listeners": [{"name": "http", "port": ROUTED_PORT, "protocol": "HTTP", "hostname": ROUTED_HOST}]}})
    rules = [{"matches": [{"path": {"type": "PathPrefix", "value": prefix}}],
              "backendRefs": [{"name": service_of(k, hit), "port": backend_port if k == hit else closed_port}]}
             for k, prefix in enumerate(prefixes)]
    route = gw.RouteObject.model_validate({
        "metadata": {"name": "routes", "namespace": NAMESPACE, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"parentRefs": [{"name": "routes"}], "hostnames": [ROUTED_HOST], "rules": rules}})
    plan = gw.as_ingress(gateway, [route], "bench", tag="tag:bench-agent", hostname=AGENT,
                         services=lambda ns, name: {"spec": {}}, certificates=lambda ns, name: "not found",
                         labels=lambda ns: None)
    if plan.ingress is None:
        raise RuntimeError(f"as_ingress refuses it: {plan.accepted.reason}: {plan.accepted.message}")
    return plan


def refusal(count: int = PATHS_MAX + 1) -> str:
    """What the translation says of a route of ``count`` rules (one more than a host serves)."""
    try:
        gateway_plan(flat_paths(count), hit=count - 1, backend_port=1, closed_port=2)
    except RuntimeError as exc:
        return str(exc)
    return f"{count} rules are served"


def plain_ingress(backend_port: int) -> TailnetIngress:
    """The TailnetIngress of the plain row: one plaintext http expose, one host, no paths."""
    return TailnetIngress.model_validate({
        "metadata": {"name": "plain", "namespace": NAMESPACE},
        "spec": {"tailnetRef": {"name": "bench"}, "tag": "tag:bench-agent", "hostname": AGENT,
                 "exposes": [{"name": "plain", "port": PLAIN_PORT, "mode": "http", "plaintext": True,
                              "backend": {"service": "backend", "port": backend_port},
                              "hosts": [{"name": PLAIN_HOST}]}]}})


def on_loopback(node: Any) -> Any:
    """The exposes document with every backend host (``<service>.<namespace>.svc``) replaced by
    127.0.0.1: only backends have a ``host``; ports, paths and hosts stay as translated."""
    if isinstance(node, list):
        return [on_loopback(item) for item in node]
    if isinstance(node, dict):
        return {k: ("127.0.0.1" if k == "host" and str(v).endswith(f".{NAMESPACE}.svc") else on_loopback(v))
                for k, v in node.items()}
    return node


def exposes(backend_port: int, closed_port: int) -> list[dict[str, Any]]:
    """The agent's exposes file: the Gateway's exposes and the TailnetIngress's, as translated."""
    plan = gateway_plan(flat_paths(), hit=HIT, backend_port=backend_port, closed_port=closed_port)
    assert plan.ingress is not None
    documents = [exposes_document(plan.ingress, []), exposes_document(plain_ingress(backend_port), [])]
    return [entry for document in documents for entry in on_loopback(json.loads(document))]


# -- what each row claims, checked ----------------------------------------------------------------


def host_of_port(parsed: Sequence[Expose], port: int, name: str) -> tuple[Expose, VirtualHost]:
    for expose in parsed:
        for host in expose.hosts:
            if expose.port == port and host.name == name:
                return expose, host
    raise PathNotAsClaimed(f"no host {name} on port {port} in the exposes file")


def routing_claims(parsed: Sequence[Expose], backend_port: int) -> dict[str, str]:
    """Both rows' claims about the parsed exposes file, checked with the agent's own ``choose``:
    the routed host has the rules in order, ``TARGET`` chooses the last and only it reaches the
    backend, and a request no rule matches gets 404; the plain host has no routes."""
    _, routed = host_of_port(parsed, ROUTED_PORT, ROUTED_HOST)
    if [r.path for r in routed.routes] != flat_paths() or routed.fallback:
        raise PathNotAsClaimed(f"the routed host has {[r.path for r in routed.routes]}, fallback {routed.fallback}")
    chosen = choose(routed.routes, TARGET)
    to_backend = [r.path for r in routed.routes if reaches(r, backend_port)]
    if chosen is None or chosen is not routed.routes[-1] or to_backend != [chosen.path]:
        raise PathNotAsClaimed(f"{TARGET} chooses {chosen and chosen.path}; routes to the backend {to_backend}")
    plain_expose, plain = host_of_port(parsed, PLAIN_PORT, PLAIN_HOST)
    if plain.routes or (plain_expose.backend.host, plain_expose.backend.port) != ("127.0.0.1", backend_port):
        raise PathNotAsClaimed(f"the plain host has routes {plain.routes} or another backend {plain_expose.backend}")
    return {"routed": f"{len(routed.routes)} rules {routed.routes[0].path} ... {routed.routes[-1].path}, "
                      f"{TARGET} chooses {chosen.path} (rule {len(routed.routes) - 1}), the only one to the backend; "
                      "no match: 404",
            "plain": "no routes; every request to the expose's backend, the same port"}


def reaches(route: Route, backend_port: int) -> bool:
    return any((w.backend.host, w.backend.port) == ("127.0.0.1", backend_port) for w in route.weighted)


async def answer(dial: paths.Dial, host: str, target: str) -> tuple[int, bytes]:
    """Status and body of one GET over a fresh connection (``Connection: close``)."""
    reader, writer = await dial()
    writer.write(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(-1), 30)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


LIVE = ((ROUTED_PORT, ROUTED_HOST, TARGET, 200), (ROUTED_PORT, ROUTED_HOST, MISROUTED, 502),
        (ROUTED_PORT, ROUTED_HOST, "/elsewhere", 404), (PLAIN_PORT, PLAIN_HOST, "/", 200))
"""Requests through the tailnet before measuring: the hit rule reaches the backend, another rule
a Service nothing listens on, no rule 404; the plain row the backend."""


async def live_claims(proxy: int, agent_ip: str) -> list[str]:
    out = []
    for port, host, target, want in LIVE:
        status, body = await answer(paths.socks5_dialer("127.0.0.1", proxy, agent_ip, port), host, target)
        if status != want or (want == 200 and body != BODY):
            raise PathNotAsClaimed(f"GET {target} (Host {host}, port {port}): {status} {body[:120]!r}, want {want}")
        out.append(f"port {port} GET {target}: {status}")
    return out


async def until_direct(proxy: int, agent_ip: str, metrics_url: str, timeout: float = 30.0) -> None:
    """Plain-row requests until the agent's metrics show WireGuard going both ways over UDP (a
    refused connect is retried: the laptop's netmap and the agent's listeners settle first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await answer(paths.socks5_dialer("127.0.0.1", proxy, agent_ip, PLAIN_PORT), PLAIN_HOST, "/")
        udp = await asyncio.to_thread(agent_udp, metrics_url)
        if udp.packets_out and udp.packets_in:
            return
        await asyncio.sleep(0.5)
    raise PathNotAsClaimed(f"no direct path from the agent within {timeout:.0f} s (see its log)")


# -- the route choice alone ------------------------------------------------------------------------


def choice_costs(backend_port: int, closed_port: int, number: int = 20000) -> dict[str, float]:
    """Microseconds per routing decision in this process, on routes parsed from translated
    documents: the routed row's (its hit, and the first rule), as many nested prefixes one request
    matches all of (the selection's costliest shape), and the plain row's host without routes."""
    parsed = parse_exposes(json.dumps(exposes(backend_port, closed_port)))
    _, routed = host_of_port(parsed, ROUTED_PORT, ROUTED_HOST)
    plain_expose, plain = host_of_port(parsed, PLAIN_PORT, PLAIN_HOST)
    nested_plan = gateway_plan(nested_paths(), hit=HIT, backend_port=backend_port, closed_port=closed_port)
    assert nested_plan.ingress is not None
    [nested] = [h for e in parse_exposes(exposes_document(nested_plan.ingress, [])) for h in e.hosts]
    headers = [("Host", ROUTED_HOST), ("User-Agent", "bench")]
    cases = {f"{RULES} rules, GET {TARGET} (the routed row)": (routed, TARGET),
             f"{RULES} rules, GET /r00/bench": (routed, "/r00/bench"),
             f"{RULES} nested prefixes, all matching GET {nested_paths()[-1]}": (nested, nested_paths()[-1]),
             "no paths, GET / (the plain row)": (plain, "/")}
    out = {}
    for name, (host, target) in cases.items():
        def once(host: Any = host, target: str = target) -> object:
            return decide(host, plain_expose.backend, method="GET", target=target, authority=ROUTED_HOST,
                          headers=headers, port=ROUTED_PORT, scheme="http")
        if not isinstance(once(), Forward):
            raise RuntimeError(f"{name}: not forwarded")
        out[name] = round(min(timeit.repeat(once, number=number, repeat=3)) / number * 1e6, 2)
    return out


# -- the run ---------------------------------------------------------------------------------------


def rows(proxy: int, agent_ip: str) -> list[HttpPath]:
    def via(port: int) -> str:
        return f"socks5:127.0.0.1:{proxy}:{agent_ip}:{port}"

    return [HttpPath(ROUTED, via(ROUTED_PORT), ROUTED_HOST, False, target=TARGET),
            HttpPath(PLAIN, via(PLAIN_PORT), PLAIN_HOST, False, target="/")]


def measure(measured: list[HttpPath], *, seconds: float, rounds: int, pids: dict[str, int]) -> None:
    """Per round and concurrency, the rows one after the other (their order reversed every other
    round), so that the two measurements of a pair are seconds apart and a slow phase of the
    machine hits both alike."""
    for round_ in range(rounds):
        for clients in CONCURRENCY:
            for path in measured if round_ % 2 == 0 else measured[::-1]:
                result = measured_load(path, clients, seconds, None, pids)
                print(f"round {round_ + 1} {path.name} c={clients}: {result.rps:.0f} req/s "
                      f"p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms", flush=True)


def run(*, seconds: float, rounds: int) -> dict[str, Any]:
    ports = {"http": free_port(), "https": free_port()}
    closed_port = free_port()  # the 19 other rules' Services: nothing listens there
    with Environment() as env, contextlib.ExitStack() as stack:
        pki = env.root / "pki"
        CertificateAuthority(pki, "bench-routing").issue("web", common_name=PLAIN_HOST, hosts=(PLAIN_HOST,))
        python = sys.executable
        backend = stack.enter_context(process(  # ingress_serve's backend; its TLS port is not used here
            [python, "-m", "benchmarks.ingress_serve", "backend", str(ports["http"]), str(ports["https"]),
             str(pki / "web.crt"), str(pki / "web.key")], env.log_dir / "backend.log"))
        wait_until(lambda: all(connects(p) for p in ports.values()), timeout=30, what="the backend")
        headscale = env.headscale()
        laptop = env.tailscale_node("bench-laptop", headscale,
                                    authkey=headscale.create_preauth_key(tags=["tag:bench-server"], reusable=True))
        exposes_file = env.root / "exposes.json"
        exposes_file.write_text(json.dumps(exposes(ports["http"], closed_port), indent=1))
        claims = routing_claims(parse_exposes(exposes_file.read_text()), ports["http"])
        health = f"127.0.0.1:{free_port()}"
        agent = stack.enter_context(process([python, "-m", "tailnet_agent"], env.log_dir / "agent-ingress.log",
                                            agent_env(env, headscale, exposes_file, health)))
        wait_until(lambda: fetch(f"http://{health}/readyz"), timeout=60, what="the agent's /readyz")
        agent_ip = wait_until(lambda: peer_ip(laptop, AGENT), timeout=60, what="the laptop seeing the agent")
        metrics = f"http://{health}/metrics"
        asyncio.run(until_direct(laptop.socks5_port, agent_ip, metrics))
        check = agent_check(metrics, AGENT, laptop, DIRECT)
        path_before = wait_until(check, timeout=30, interval=0.5, what="a direct path to the agent")
        live = asyncio.run(live_claims(laptop.socks5_port, agent_ip))
        measured = rows(laptop.socks5_port, agent_ip)
        pids = {"laptop tailscaled": laptop.process.pid or 0, "agent": agent.pid, "backend": backend.pid}
        load_before = loadavg()
        measure(measured, seconds=seconds, rounds=rounds, pids=pids)
        load_after = loadavg()
        path_after = check()
    costs = choice_costs(ports["http"], closed_port)
    return {"http": [asdict(p) for p in measured], "claims": claims, "live": live, "choice_us": costs,
            "over_limit": refusal(),
            "path_before": path_before, "path_after": path_after, "loadavg_before": load_before,
            "loadavg_after": load_after, "cpus": os.cpu_count(),
            "settings": {"seconds": seconds, "rounds": rounds, "body_bytes": len(BODY), "rules": RULES}}


# -- the section -----------------------------------------------------------------------------------


def as_path(raw: dict[str, Any]) -> HttpPath:
    return HttpPath(raw["name"], raw["dial"], raw["host"], raw["tls"],
                    {int(c): [Load(**r) for r in runs] for c, runs in raw["runs"].items()},
                    {int(c): runs for c, runs in raw["cpu"].items()}, raw.get("target", "/"))


def cpu_median(path: HttpPath, clients: int, column: str) -> float:
    runs = path.cpu.get(clients) or []
    return float(statistics.median(run.get(column, 0.0) for run in runs)) if runs else 0.0


def tables(doc: dict[str, Any]) -> str:
    measured = [as_path(raw) for raw in doc["http"]]
    lines = ["| row | 1 client req/s | p50 ms | p99 ms | 32 clients req/s | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for path in measured:
        cells = [f"{path.median(c, 'rps'):.0f} | {path.median(c, 'p50_ms'):.2f} | {path.median(c, 'p99_ms'):.2f}"
                 for c in CONCURRENCY]
        lines.append(f"| {path.name} | " + " | ".join(cells) + " |")
    lines += ["", "| row: CPU ms per request | clients | " + " | ".join(CPU_COLUMNS) + " | sum |",
              "|---|---|" + "---|" * (len(CPU_COLUMNS) + 1)]
    for path in measured:
        for clients in CONCURRENCY:
            medians = [cpu_median(path, clients, column) for column in CPU_COLUMNS]
            lines.append(f"| {path.name} | {clients} | " + " | ".join(f"{m:.3f}" for m in medians)
                         + f" | {sum(medians):.3f} |")
    return "\n".join(lines)


def paired(routed: HttpPath, plain: HttpPath, clients: int) -> list[float]:
    """Per round, the routed row's requests/s over the plain row's (measured seconds apart)."""
    return [r.rps / p.rps for r, p in zip(routed.runs.get(clients, []), plain.runs.get(clients, []), strict=True)]


def ratios(doc: dict[str, Any]) -> str:
    """The routed row against the plain row: the median of the per-round ratios (each pair measured
    seconds apart), and the differences of the medians."""
    routed, plain = (as_path(raw) for raw in doc["http"])
    parts = []
    for clients in CONCURRENCY:
        cpu = cpu_median(routed, clients, "agent") - cpu_median(plain, clients, "agent")
        rps = statistics.median(paired(routed, plain, clients))
        p50 = routed.median(clients, "p50_ms") - plain.median(clients, "p50_ms")
        each = ", ".join(f"{x:.2f}" for x in paired(routed, plain, clients))
        parts.append(f"at {clients} client{'s' if clients > 1 else ''} {rps:.2f}x the plain row's requests/s "
                     f"(per round: {each}), p50 {p50:+.2f} ms, agent CPU {cpu * 1000:+.0f} µs per request")
    return "Routed against plain: " + "; ".join(parts) + "."


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: conditions, what each row was checked to be, the
    tables, every round, and the route choice alone."""
    settings = doc["settings"]
    first, last = flat_paths()[0], flat_paths()[-1]
    lines = [
        f"### The cost of routing, {doc['date']}, commit {doc['commit']} (Headscale {doc['headscale']}, "
        f"tailscaled {doc['tailscale']})", "",
        f"One agent, two plaintext http exposes to the same backend port: a Gateway (one `HTTP` listener, port "
        f"{ROUTED_PORT}) with one HTTPRoute of {settings['rules']} `PathPrefix` rules `{first}` ... `{last}`, "
        f"translated by `as_ingress` and `exposes_document`, asked `{TARGET}`; and a TailnetIngress http expose "
        f"without paths (port {PLAIN_PORT}), asked `/`. `{last}` is the rule the agent's `choose` reaches last, "
        "and the last in its precedence order (the rules rank alike; a tie goes to the rule listed first); "
        "`choose` walks all rules for every request, so every rule of this table costs the same walk. Medians of "
        f"{settings['rounds']} rounds, the two rows measured one after the other at each concurrency (their "
        f"order reversed every other round), {settings['seconds']:g} s per load measurement, HTTP/1.1 keep-alive, "
        f"{settings['body_bytes']}-byte answers. "
        f"{load_average(doc['loadavg_before'], doc['loadavg_after'])} of the measurements, on {doc['cpus']} CPUs.", "",
        "Checked before measuring: the exposes file with the agent's `choose` (routed: "
        f"{doc['claims']['routed']}; plain: {doc['claims']['plain']}); through the tailnet: "
        f"{', '.join(doc['live'])} (the other rules name a Service nothing listens on, so every measured request, "
        f"each required to be a 200 with the backend's body, went by `{last}`). The agent's path, direct at both "
        f"ends: before: {doc['path_before']}; after: {doc['path_after']}.", "",
        f"A host serves at most {PATHS_MAX} paths: {doc.get('over_limit') or doc.get('twenty_rules')}.", "",
        tables(doc), "", ratios(doc), "", "Requests/s, rounds in order:", ""]
    for raw in doc["http"]:
        for clients in CONCURRENCY:
            runs = raw["runs"].get(str(clients)) or raw["runs"].get(clients) or []
            lines.append(f"- {raw['name']}, {clients} client{'s' if clients > 1 else ''}: "
                         + ", ".join(f"{run['rps']:.0f}" for run in runs))
    lines += ["", "The routing decision alone (`routes.decide`, in the benchmark's process, best of 3):", "",
              "| host, request | µs per decision |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in doc["choice_us"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per load measurement (default 6)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over both rows; medians reported (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    doc = run(seconds=args.seconds, rounds=args.rounds)
    doc |= {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "headscale": versions.HEADSCALE,
            "tailscale": versions.TAILSCALE}
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc, name="gateway-routing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
