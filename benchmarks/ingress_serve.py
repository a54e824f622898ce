"""Ingress benchmark: the agent's ingress mode against ``tailscale serve`` on the same path.

Path: a load client on this machine -> a tailscaled "laptop" in userspace networking (its SOCKS5
proxy) -> the tailnet (direct UDP on loopback) -> (the agent, ``AGENT_MODE=ingress`` | a tailscaled
node with ``tailscale serve``) -> a backend on 127.0.0.1.

Measured in one run, every path in turn per round (so a slow phase of the machine hits all alike):
HTTP/1.1 requests with keep-alive (requests/s, p50/p99 latency) at 1 and 32 concurrent clients,
each client one connection for the whole measurement, and the bulk throughput (MB/s, one stream and
8 streams, each way) of one tcp expose against ``tailscale serve --tcp``.

Why not ``tailscale serve --https`` with the same certificate: every TLS termination in
tailscaled 1.98 (``--https``, ``--tls-terminated-tcp``) takes its certificate from
``LocalBackend.GetCertPEM``, which first requires the domain to be one of the netmap's
``DNS.CertDomains`` ("your Tailscale account does not support getting TLS certs" otherwise), and
Headscale 0.29.2 sends none; the cert directory is only read after that check (each run checks
this on the real binaries after the measurements: :func:`serve_https_probe`). So HTTPS with the
same certificate is compared with TLS passed through: the agent's tcp expose against
``tailscale serve --tcp``, both to a backend that terminates TLS with it; the agent's http expose
(TLS at the agent) has no tailscaled counterpart here; ``tailscale serve --http`` is measured as the
plain-HTTP reverse proxy it can be, beside the agent's tcp expose to the same clear backend. Two
rows without the tailnet give the ceiling of the load client and the backend. Each measurement
also records the CPU time per request of every process on the path (the laptop's proxy included).

The load client is a separate process (standard library asyncio, verified TLS against the test CA,
ALPN http/1.1); the backend is aiohttp in its own process. Everything runs on loopback; nothing
leaves the machine.

    python -m benchmarks.ingress_serve [--seconds 6] [--rounds 3] [--mib 32] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import pathcheck, paths
from benchmarks.egress import stop
from benchmarks.pathcheck import agent_check, fetch, tailscaled_check, until_direct, until_direct_tailscaled
from benchmarks.paths import COLUMNS, PathResult, throughput_round, upload
from benchmarks.record import commit, load_average, publish
from hack import versions
from hack.localenv import Environment, Headscale, TailscaleNode, free_port, wait_until
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract import environment as env_names

NAME = "web.bench.test"
"""The virtual host: the certificate's name, the SNI and Host of every HTTPS request."""
BODY = b"x" * 256
CONCURRENCY = (1, 32)
AGENT, SERVE = "bench-ingress", "bench-serve"
CPU_COLUMNS = ("load client", "laptop tailscaled", "agent", "serve tailscaled", "backend")


# -- the backend (its own process) --------------------------------------------------------------


async def serve_backend(http_port: int, https_port: int, cert: Path, key: Path) -> None:
    """aiohttp answering ``BODY`` to any GET, on ``http_port`` in clear and ``https_port`` with TLS."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    await web.TCPSite(runner, "127.0.0.1", https_port, ssl_context=context).start()
    print("listening", flush=True)
    await asyncio.Event().wait()


# -- the load client (its own process) ----------------------------------------------------------


@dataclass
class Load:
    clients: int
    seconds: float
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float


async def load(dial: paths.Dial, *, clients: int, seconds: float, host: str, tls: ssl.SSLContext | None,
               sni: str | None, target: str = "/") -> Load:
    """``clients`` keep-alive connections, each sending GET ``target`` after the previous answer, for
    ``seconds`` after all of them are connected (and through TLS); every answer must be a 200 with
    the backend's body."""
    latencies: list[float] = []
    go = asyncio.Event()
    connected = 0
    request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: bench\r\n\r\n".encode()

    async def client() -> None:
        nonlocal connected
        reader, writer = await dial()
        if tls is not None:
            await writer.start_tls(tls, server_hostname=sni)
        await one_request(reader, writer)  # warm: the first request through the whole path
        connected += 1
        if connected == clients:
            go.set()
        await go.wait()
        while time.perf_counter() < end:
            started = time.perf_counter()
            await one_request(reader, writer)
            latencies.append(time.perf_counter() - started)
        writer.close()

    async def one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status, _, rest = head.partition(b"\r\n")
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"answer {head[:200]!r}")
        length = next((int(line.split(b":", 1)[1]) for line in rest.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        if length is None:
            raise RuntimeError(f"answer without Content-Length: {head[:200]!r}")
        if await reader.readexactly(length) != BODY:
            raise RuntimeError("the body differs from the backend's")

    end = float("inf")
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.wait_for(go.wait(), 60)
    started = time.perf_counter()
    end = started + seconds
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return Load(clients=clients, seconds=round(elapsed, 2), requests=len(ordered), rps=len(ordered) / elapsed,
                p50_ms=statistics.median(ordered) * 1000,
                p99_ms=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000)


def run_load(dial: str, *, clients: int, seconds: float, host: str, ca: Path | None, sni: str | None,
             target: str = "/") -> Load:
    """One load measurement in a fresh client process."""
    argv = [sys.executable, "-m", "benchmarks.ingress_serve", "load", dial, "--clients", str(clients),
            "--seconds", str(seconds), "--host", host, "--target", target]
    if ca is not None and sni is not None:
        argv += ["--ca", str(ca), "--sni", sni]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"load client for {dial} failed: {proc.stderr[-2000:]}")
    return Load(**json.loads(proc.stdout))


# -- the measured paths -------------------------------------------------------------------------


@dataclass
class HttpPath:
    name: str
    dial: str
    host: str
    tls: bool
    runs: dict[int, list[Load]] = field(default_factory=dict)
    cpu: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    """Per run: CPU milliseconds per request of each process on the path."""
    target: str = "/"
    """The request target every request of the path asks for."""

    def median(self, clients: int, column: str) -> float:
        return float(statistics.median(float(getattr(load, column)) for load in self.runs.get(clients, [])))


def http_paths(proxy: int, agent_ip: str, serve_ip: str, ports: dict[str, int]) -> list[HttpPath]:
    def via(ip: str, port: int) -> str:
        return f"socks5:127.0.0.1:{proxy}:{ip}:{port}"

    return [
        HttpPath("agent http expose (TLS at the agent) -> HTTP backend", via(agent_ip, 443), NAME, True),
        HttpPath("agent tcp expose -> HTTPS backend (TLS passed through)", via(agent_ip, 8443), NAME, True),
        HttpPath("tailscale serve --tcp -> HTTPS backend (TLS passed through)", via(serve_ip, 8443), NAME, True),
        HttpPath("agent tcp expose -> HTTP backend (no TLS)", via(agent_ip, 80), NAME, False),
        HttpPath("tailscale serve --http -> HTTP backend (no TLS)", via(serve_ip, 80), SERVE, False),
        HttpPath("no tailnet: client -> HTTPS backend on loopback", f"tcp:127.0.0.1:{ports['https']}", NAME, True),
        HttpPath("no tailnet: client -> HTTP backend on loopback", f"tcp:127.0.0.1:{ports['http']}", NAME, False),
    ]


def exposes(ports: dict[str, int], pki: Path) -> list[dict[str, Any]]:
    def tcp(name: str, port: int, backend: int) -> dict[str, Any]:
        return {"name": name, "port": port, "backend": {"host": "127.0.0.1", "port": backend}}

    return [{"name": "web", "port": 443, "mode": "http", "backend": {"host": "127.0.0.1", "port": ports["http"]},
             "hosts": [{"name": NAME, "tls": {"certFile": str(pki / "web.crt"), "keyFile": str(pki / "web.key")}}]},
            tcp("tls", 8443, ports["https"]), tcp("plain", 80, ports["http"]), tcp("bulk", 9000, ports["bulk"])]


def serve_commands(ports: dict[str, int]) -> list[list[str]]:
    """The ``tailscale serve`` configuration: the same backends on the same tailnet ports."""
    return [["serve", "--bg", "--http=80", f"http://127.0.0.1:{ports['http']}"],
            ["serve", "--bg", "--tcp=8443", f"tcp://127.0.0.1:{ports['https']}"],
            ["serve", "--bg", "--tcp=9000", f"tcp://127.0.0.1:{ports['bulk']}"]]


# -- processes ----------------------------------------------------------------------------------


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop(proc)


def connects(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def agent_env(env: Environment, headscale: Headscale, exposes_file: Path, health: str) -> dict[str, str]:
    key_file = env.root / "ingress-auth-key"
    key_file.write_text(headscale.create_preauth_key(tags=["tag:bench-agent"], reusable=True, ephemeral=True))
    return {**os.environ, env_names.AGENT_MODE: env_names.INGRESS, env_names.CONTROL_URL: headscale.url,
            env_names.AUTH_KEY_FILE: str(key_file), env_names.HOSTNAME: AGENT, env_names.UDP_PORT: "0",
            env_names.CA_BUNDLE: str(headscale.ca_bundle), env_names.EXPOSES_FILE: str(exposes_file),
            env_names.HEALTH_ADDRESS: health, env_names.LOG_LEVEL: "warning"}


def peer_ip(laptop: TailscaleNode, hostname: str) -> str | None:
    for peer in laptop.peers():
        if peer.get("HostName") == hostname and peer.get("TailscaleIPs"):
            return str(peer["TailscaleIPs"][0])
    return None


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's reaped children (the load clients)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_load(path: HttpPath, clients: int, seconds: float, ca: Path | None, pids: dict[str, int]) -> Load:
    """One load measurement of ``path``, with the CPU each process in ``pids`` and the client spent."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = children_cpu_seconds()
    result = run_load(path.dial, clients=clients, seconds=seconds, host=path.host,
                      ca=ca if path.tls else None, sni=NAME if path.tls else None, target=path.target)
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    spent["load client"] = children_cpu_seconds() - client_before
    path.runs.setdefault(clients, []).append(result)
    path.cpu.setdefault(clients, []).append(
        {name: round(value * 1000 / max(result.requests, 1), 3) for name, value in spent.items()})
    return result


async def until_reachable(dial: paths.Dial, timeout: float = 60.0) -> None:
    """Retry a small upload until the path carries it (the peer's netmap and listeners settle)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await upload(dial, 1024)
            return
        except (ConnectionError, asyncio.IncompleteReadError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def serve_https_probe(serve: TailscaleNode, ca: CertificateAuthority, dial: paths.Dial, backend_port: int,
                      ) -> dict[str, Any]:
    """What ``tailscale serve --https`` does here with a certificate from the test CA for the node's own
    MagicDNS name placed where its cert store reads (``<statedir>/certs/<name>.crt`` and ``.key``).

    Run after the measurements: it replaces the node's serve configuration. The CLI is tried first;
    if it refuses, the same configuration is set with ``tailscale serve set-raw``. Then one TLS
    handshake from the laptop, verified against the CA, and the node's log line that explains it.
    """
    from hack import binaries

    name = str(serve.status()["Self"]["DNSName"]).rstrip(".")
    pair = ca.issue("serve-node", common_name=name, hosts=(name,))
    certs = serve.workdir / "state" / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    (certs / f"{name}.crt").write_bytes(pair.cert.read_bytes())
    (certs / f"{name}.key").write_bytes(pair.key.read_bytes())
    (certs / f"{name}.key").chmod(0o600)
    outcome: dict[str, Any] = {"dns_name": name}
    try:
        serve.cli("serve", "--bg", "--https=443", f"http://127.0.0.1:{backend_port}", timeout=20)
        outcome["cli"] = "accepted"
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        outcome["cli"] = str(exc).splitlines()[0][:300]
        config = {"TCP": {"443": {"HTTPS": True}},
                  "Web": {f"{name}:443": {"Handlers": {"/": {"Proxy": f"http://127.0.0.1:{backend_port}"}}}}}
        raw = subprocess.run([str(binaries.binary("tailscale")), f"--socket={serve.socket}", "serve", "set-raw"],
                             input=json.dumps(config), capture_output=True, text=True, timeout=20, check=False)
        outcome["set_raw"] = "accepted" if raw.returncode == 0 else raw.stderr.strip()[:300]

    async def handshake() -> str:
        context = ssl.create_default_context(cafile=str(ca.cert_path))
        _reader, writer = await dial()
        try:
            await asyncio.wait_for(writer.start_tls(context, server_hostname=name), 30)
            return "TLS handshake completed"
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            writer.close()

    outcome["handshake"] = asyncio.run(handshake())
    log = serve.process.log_path.read_text(errors="replace") if serve.process.log_path.exists() else ""
    outcome["tailscaled_log"] = [line[:300] for line in log.splitlines()
                                 if "TLS" in line or "cert" in line.lower()][-3:]
    return outcome


def loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


# -- the run ------------------------------------------------------------------------------------


def run(*, seconds: float, rounds: int, mib: int) -> dict[str, Any]:
    ports = {"http": free_port(), "https": free_port(), "bulk": free_port()}
    with Environment() as env, contextlib.ExitStack() as stack:
        pki = env.root / "ingress-pki"
        ca = CertificateAuthority(pki, "bench-ingress")
        ca.issue("web", common_name=NAME, hosts=(NAME,))
        python = sys.executable
        backend = stack.enter_context(process([python, "-m", "benchmarks.ingress_serve", "backend", str(ports["http"]),
                                     str(ports["https"]), str(pki / "web.crt"), str(pki / "web.key")],
                                    env.log_dir / "backend.log"))
        stack.enter_context(process([python, "-m", "benchmarks.paths", "serve", "127.0.0.1", str(ports["bulk"])],
                                    env.log_dir / "bulk-server.log"))
        wait_until(lambda: all(connects(p) for p in ports.values()), timeout=30, what="the backends")

        headscale = env.headscale()
        key = headscale.create_preauth_key(tags=["tag:bench-server"], reusable=True)
        laptop = env.tailscale_node("bench-laptop", headscale, authkey=key)
        serve = env.tailscale_node(SERVE, headscale, authkey=key)
        for command in serve_commands(ports):
            serve.cli(*command)
        exposes_file = env.root / "exposes.json"
        exposes_file.write_text(json.dumps(exposes(ports, pki)))
        health = f"127.0.0.1:{free_port()}"
        agent = stack.enter_context(process([python, "-m", "tailnet_agent"], env.log_dir / "agent-ingress.log",
                                            agent_env(env, headscale, exposes_file, health)))
        wait_until(lambda: fetch(f"http://{health}/readyz"), timeout=60, what="the agent's /readyz")
        agent_ip = wait_until(lambda: peer_ip(laptop, AGENT), timeout=60, what="the laptop seeing the agent")
        serve_ip = wait_until(lambda: peer_ip(laptop, SERVE), timeout=60, what="the laptop seeing the serve node")

        bulk = [(PathResult("agent tcp expose"), paths.socks5_dialer("127.0.0.1", laptop.socks5_port, agent_ip, 9000)),
                (PathResult("tailscale serve --tcp"),
                 paths.socks5_dialer("127.0.0.1", laptop.socks5_port, serve_ip, 9000))]

        async def direct_paths() -> None:
            for _, dial in bulk:
                await until_reachable(dial)
            await until_direct(bulk[0][1], f"http://{health}/metrics")
            await until_direct_tailscaled(laptop, SERVE, bulk[1][1])

        asyncio.run(direct_paths())
        checks = {"agent": agent_check(f"http://{health}/metrics", AGENT, laptop, pathcheck.DIRECT),
                  "tailscale serve": tailscaled_check(laptop, serve, pathcheck.DIRECT)}
        path_before = {name: wait_until(check, timeout=30, interval=0.5, what=f"a direct path to the {name} node")
                       for name, check in checks.items()}
        measured = http_paths(laptop.socks5_port, agent_ip, serve_ip, ports)
        pids = {"laptop tailscaled": laptop.process.pid or 0, "agent": agent.pid,
                "serve tailscaled": serve.process.pid or 0, "backend": backend.pid}
        load_before = loadavg()
        for round_ in range(rounds):
            for path in measured:
                for clients in CONCURRENCY:
                    result = measured_load(path, clients, seconds, ca.cert_path, pids)
                    print(f"round {round_ + 1} {path.name} c={clients}: {result.rps:.0f} req/s "
                          f"p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms", flush=True)

        async def bulk_rounds() -> None:
            for _, dial in bulk:
                await upload(dial, paths.MIB)
            for _ in range(rounds + 1):
                for result, dial in bulk:
                    await throughput_round(result, dial, mib=mib)

        asyncio.run(bulk_rounds())
        path_after = {name: check() for name, check in checks.items()}
        load_after = loadavg()
        https_probe = serve_https_probe(serve, ca, paths.socks5_dialer("127.0.0.1", laptop.socks5_port, serve_ip, 443),
                                        ports["http"])
        print(f"tailscale serve --https with a certificate in its cert store: {https_probe}", flush=True)
        agent_rss = rss_kib(agent.pid)
        serve_rss = rss_kib(serve.process.pid or 0)
    return {"http": [asdict(p) for p in measured], "bulk": [asdict(r) for r, _ in bulk],
            "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
            "rss_after_kib": {AGENT: agent_rss, SERVE: serve_rss}, "serve_https_probe": https_probe,
            "path_before": path_before, "path_after": path_after,
            "settings": {"seconds": seconds, "rounds": rounds, "mib": mib, "body_bytes": len(BODY)}}


def rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def tables(doc: dict[str, Any]) -> str:
    rows = ["| path | 1 client req/s | p50 ms | p99 ms | 32 clients req/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|---|---|"]
    for raw in doc["http"]:
        path = HttpPath(raw["name"], raw["dial"], raw["host"], raw["tls"],
                        {int(c): [Load(**r) for r in runs] for c, runs in raw["runs"].items()})
        cells = [f"{path.median(c, 'rps'):.0f} | {path.median(c, 'p50_ms'):.2f} | {path.median(c, 'p99_ms'):.2f}"
                 for c in CONCURRENCY]
        rows.append(f"| {path.name} | " + " | ".join(cells) + " |")
    rows += ["", "| path, 32 clients: CPU ms per request | " + " | ".join(CPU_COLUMNS) + " | sum |",
             "|---|" + "---|" * (len(CPU_COLUMNS) + 1)]
    for raw in doc["http"]:
        runs = raw["cpu"].get("32") or raw["cpu"].get(32) or []
        medians = [statistics.median(run.get(name, 0.0) for run in runs) if runs else 0.0 for name in CPU_COLUMNS]
        rows.append(f"| {raw['name']} | " + " | ".join(f"{m:.3f}" for m in medians) + f" | {sum(medians):.3f} |")
    rows += ["", "| tcp expose, bulk | 1 stream up MB/s | 1 stream down MB/s | 8 streams up MB/s "
             "| 8 streams down MB/s |", "|---|---|---|---|---|"]
    for r in doc["bulk"]:
        rows.append(f"| {r['name']} | {r['one_stream_up_mbs']:.1f} | {r['one_stream_down_mbs']:.1f} | "
                    f"{r['eight_streams_up_mbs']:.1f} | {r['eight_streams_down_mbs']:.1f} |")
    return "\n".join(rows)


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: its conditions, the checked paths, the tables and
    every round's figures."""
    settings = doc["settings"]
    lines = [
        f"### Ingress against tailscale serve, {doc['date']}, commit {doc['commit']} (Headscale "
        f"{doc['headscale']}, tailscaled {doc['tailscale']})", "",
        f"Medians of {settings['rounds']} rounds, {settings['seconds']:g} s per load measurement, "
        f"{settings['body_bytes']}-byte answers, {settings['mib']} MiB per bulk measurement (medians of "
        f"{settings['rounds'] + 1} bulk rounds). {load_average(doc['loadavg_before'], doc['loadavg_after'])} "
        f"of the measurements, on {doc['cpus']} CPUs.", "",
        "Both ingress nodes were checked direct at both ends before and after the measurements (the "
        "agent's UDP counters and the laptop's entry for it; the laptop's and the serve node's entries "
        "for each other):", ""]
    lines += [f"- {name}: before: {doc['path_before'][name]}; after: {doc['path_after'][name]}"
              for name in doc["path_after"]]
    lines += ["", tables(doc), "", "Requests/s at 32 clients, rounds in order:", ""]
    for raw in doc["http"]:
        runs = raw["runs"].get("32") or raw["runs"].get(32) or []
        lines.append(f"- {raw['name']}: " + ", ".join(f"{run['rps']:.0f}" for run in runs))
    lines += ["", "Bulk samples (MB/s, rounds in order):", "",
              "| tcp expose, bulk | " + " | ".join(c.replace("_mbs", "").replace("_", " ") for c in COLUMNS) + " |",
              "|---|---|---|---|---|"]
    for r in doc["bulk"]:
        lines.append(f"| {r['name']} | " + " | ".join(", ".join(f"{v:.1f}" for v in r["samples"].get(c, []))
                                                   for c in COLUMNS) + " |")
    rss = doc["rss_after_kib"]
    lines += ["", f"RSS after the run: agent {rss[AGENT] / 1024:.0f} MiB, the serve node's tailscaled "
              f"{rss[SERVE] / 1024:.0f} MiB (neither has a memory limit; GOMEMLIMIT unset).", "",
              f"`tailscale serve --https` with a certificate in its cert store, checked after the "
              f"measurements: {doc['serve_https_probe']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    backend = commands.add_parser("backend", help="run the HTTP and HTTPS backend")
    backend.add_argument("http_port", type=int)
    backend.add_argument("https_port", type=int)
    backend.add_argument("cert", type=Path)
    backend.add_argument("key", type=Path)
    client = commands.add_parser("load", help="one load measurement; JSON on stdout")
    client.add_argument("dial", help="tcp:HOST:PORT or socks5:PROXY_HOST:PROXY_PORT:HOST:PORT")
    client.add_argument("--clients", type=int, default=1)
    client.add_argument("--seconds", type=float, default=8.0)
    client.add_argument("--host", required=True)
    client.add_argument("--target", default="/", help="the request target (default /)")
    client.add_argument("--ca", type=Path, default=None, help="TLS, verified against this CA")
    client.add_argument("--sni", default=None)
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per load measurement (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every path; medians reported (default 3)")
    parser.add_argument("--mib", type=int, default=32, help="MiB per bulk measurement (default 32)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    if args.command == "backend":
        asyncio.run(serve_backend(args.http_port, args.https_port, args.cert, args.key))
        return 0
    if args.command == "load":
        tls = None
        if args.ca is not None:
            tls = ssl.create_default_context(cafile=str(args.ca))
            tls.set_alpn_protocols(["http/1.1"])
        result = asyncio.run(load(paths.parse_dial(args.dial), clients=args.clients, seconds=args.seconds,
                                  host=args.host, tls=tls, sni=args.sni, target=args.target))
        print(json.dumps(asdict(result)))
        return 0
    doc = run(seconds=args.seconds, rounds=args.rounds, mib=args.mib)
    doc |= {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "headscale": versions.HEADSCALE,
            "tailscale": versions.TAILSCALE}
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc, name="ingress-serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
