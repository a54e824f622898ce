"""Egress benchmark: the agent against tailscaled's userspace networking on the same path.

Path: a client on this machine -> (agent egress listener | tailscaled SOCKS5) -> the tailnet
(DERP, or a direct UDP path where the client supports one) -> a tailscaled peer in userspace
networking -> a sink/source server on 127.0.0.1 behind it.

Measured in one run: one stream and 8 parallel streams (MB/s, upload and download), connection
setup time through the whole path (p50, p99 of connect + one byte echoed), and the agent's RSS
when ready, after the throughput rounds, and with 100 open connections. Throughput is measured in
rounds that take every path in turn (so a slow phase of the machine hits all paths alike); the
table gives the median of the rounds, the JSON every sample. The sink/source server runs in a
process of its own, and every row's path (DERP or direct) is checked on both of its ends before and
after the measurements (:mod:`benchmarks.pathcheck`). Everything runs on loopback; nothing leaves
the machine. ``--doc`` writes the section between the ``bench:egress`` markers.

With ``--kernel-peer`` the peer is a tailscaled on a TUN device in a reachable network namespace
(``site_host(reachable=True)``, inside 198.18.0.0/15) and the sink/source server runs there, on the
peer's own TCP stack: the userspace peer costs more CPU per MiB than the agent, so against it no
client can show how much faster it is. Headscale then listens on the namespace's gateway address,
only the direct rows are measured, and the section goes between the ``bench:egress-kernel-peer``
markers.

    python -m benchmarks.egress [--mib 32] [--rounds 3] [--setups 200] [--kernel-peer] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import pathcheck, paths
from benchmarks.pathcheck import fetch
from benchmarks.paths import COLUMNS, MIB, Dial, PathResult, setup_round, throughput_round, upload
from benchmarks.record import commit, load_average, publish
from hack import versions
from hack.localenv import Environment, Headscale, TailscaleNode, free_port, wait_until
from tailnet_agent.contract import environment as env_names


def socks5_dialer(node: TailscaleNode, host: str, port: int) -> Dial:
    """Dial through a local tailscaled's SOCKS5 listener (its userspace netstack)."""
    return paths.socks5_dialer("127.0.0.1", node.socks5_port, host, port)


def tcp_dialer(port: int) -> Dial:
    return paths.tcp_dialer("127.0.0.1", port)


async def measure_all(results: list[tuple[PathResult, Dial]], *, mib: int, rounds: int, setups: int) -> None:
    """Rounds that take every path in turn, then the setup times of each."""
    for _, dial in results:
        await upload(dial, MIB)  # warm up: handshakes, paths
    for _ in range(rounds):
        for result, dial in results:
            await throughput_round(result, dial, mib=mib)
    for result, dial in results:
        await setup_round(result, dial, setups=setups)


def pid_of(node: TailscaleNode) -> int:
    """The pid of ``node``'s running tailscaled."""
    pid = node.process.pid
    if pid is None:
        raise RuntimeError(f"tailscaled {node.hostname} is not running")
    return pid


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- the agent ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_agent(env: Environment, headscale: Headscale, target_ip: str, port: int,
                        listen: int, *, direct: bool) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    """The agent as its own process (AGENT_MODE=egress), its listener on 127.0.0.1:``listen``;
    DERP only unless ``direct``."""
    key_file = env.root / "agent-auth-key"
    key_file.write_text(headscale.create_preauth_key(tags=["tag:bench-agent"], reusable=True, ephemeral=True))
    config = {
        **os.environ,
        env_names.AGENT_MODE: env_names.EGRESS,
        env_names.CONTROL_URL: headscale.url,
        env_names.AUTH_KEY_FILE: str(key_file),
        env_names.HOSTNAME: "bench-agent-direct" if direct else "bench-agent-derp",
        env_names.UDP_PORT: "0" if direct else "off",
        env_names.CA_BUNDLE: str(headscale.ca_bundle),
        env_names.TARGETS: json.dumps([{"name": "bench", "address": target_ip,
                                        "ports": [{"port": port, "listen": listen}]}]),
        env_names.BIND_ADDRESS: "127.0.0.1",
        env_names.HEALTH_ADDRESS: f"127.0.0.1:{free_port()}",
        env_names.LOG_LEVEL: "warning",
    }
    log = (env.log_dir / f"agent-{'direct' if direct else 'derp'}.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any measurement
        [sys.executable, "-m", "tailnet_agent"], env=config, stdout=log, stderr=subprocess.STDOUT)
    try:
        health = config[env_names.HEALTH_ADDRESS]
        wait_until(lambda: fetch(f"http://{health}/readyz"), timeout=60, what="the agent's /readyz")
        yield proc, f"http://{health}/metrics"
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, up to 15 s to exit, then SIGKILL (and reap it)."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(15)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


async def held_connections_rss(pid: int, dial: Dial, connections: int) -> int:
    """RSS (KiB) of process ``pid`` while ``connections`` connections through it are open."""
    held = []
    for _ in range(connections):
        reader, writer = await dial()
        writer.write(b"E\x01")
        await reader.readexactly(1)
        held.append(writer)
    busy = rss_kib(pid)
    for writer in held:
        writer.close()
    return busy


# -- the run ------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The sink/source server (``paths.py serve``) in a process of its own on 127.0.0.1:``port``,
    so that the measuring client's event loop never serves as well."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(paths.__file__)), "serve", "127.0.0.1", str(port)],
            stdout=subprocess.PIPE, stderr=out)
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"listening":
                raise RuntimeError(f"the sink/source server did not start (see {log})")
            yield proc
        finally:
            stop(proc)


@dataclass
class Peer:
    """The far end of every row: Headscale, the tailscaled peer, and the server behind it."""

    headscale: Headscale
    node: TailscaleNode
    target: str
    """The address the rows dial (the peer's tailnet address)."""
    port: int
    server_pid: int
    kernel: bool


SERVER_TAG = "tag:bench-server"


@contextlib.contextmanager
def peer_side(env: Environment, *, kernel: bool) -> Iterator[Peer]:
    """Headscale, the peer and the sink/source server (a process of its own). In userspace (the
    default) the server is on 127.0.0.1 and the peer forwards its tailnet address there; with
    ``kernel`` the peer runs on a TUN device in a reachable network namespace and the server
    listens there, reached through the peer's kernel TCP."""
    if not kernel:
        port = free_port()
        with serving(port, env.log_dir / "sink-source.log") as server:
            headscale = env.headscale()
            node = env.tailscale_node("bench-server", headscale, authkey=headscale.create_preauth_key(
                tags=[SERVER_TAG], reusable=True))
            yield Peer(headscale, node, node.ipv4(), port, server.pid, kernel)
        return
    host = env.site_host(reachable=True)
    headscale = env.headscale(address=host.gateway)
    port = 9000
    sink = host.run("sink-source", [sys.executable, "-u", str(Path(paths.__file__)), "serve", "0.0.0.0", str(port)])

    def listening() -> bool:
        sink.check_running()
        return "listening" in sink.log_tail()

    wait_until(listening, timeout=10, what="the sink/source server on the peer's host")
    node = env.tailscale_node("bench-server", headscale, authkey=headscale.create_preauth_key(
        tags=[SERVER_TAG], reusable=True), host=host)
    if sink.pid is None:
        raise RuntimeError("the sink/source server is not running")
    yield Peer(headscale, node, node.ipv4(), port, sink.pid, kernel)


@dataclass
class Measured:
    """One row: its result, how it is dialled, and how its path is checked (both ends)."""

    result: PathResult
    dial: Dial
    check: Callable[[], str]
    pid: int


async def run(mib: int, rounds: int, setups: int, *, agent: bool = True,
              kernel_peer: bool = False) -> list[PathResult]:
    """Every row measured in one run; with ``kernel_peer`` only the direct ones, against a kernel-mode peer."""
    with Environment() as env, peer_side(env, kernel=kernel_peer) as far:
        headscale, peer, target, port = far.headscale, far.node, far.target, far.port
        server_key = headscale.create_preauth_key(tags=[SERVER_TAG], reusable=True)
        measured = []
        if not kernel_peer:
            derp_client = env.tailscale_node("bench-derp", headscale, authkey=server_key,
                                             env={"TS_DEBUG_ALWAYS_USE_DERP": "true"})
            measured.append(Measured(PathResult("tailscaled userspace, DERP"), socks5_dialer(derp_client, target, port),
                                     pathcheck.tailscaled_check(derp_client, peer, pathcheck.DERP),
                                     pid_of(derp_client)))
            await upload(measured[0].dial, 64 * 1024)  # both ends learn of each other
        direct_client = env.tailscale_node("bench-direct", headscale, authkey=server_key)
        measured.append(Measured(PathResult("tailscaled userspace, direct"), socks5_dialer(direct_client, target, port),
                                 pathcheck.tailscaled_check(direct_client, peer, pathcheck.DIRECT),
                                 pid_of(direct_client)))
        await upload(measured[-1].dial, 64 * 1024)
        await pathcheck.until_direct_tailscaled(direct_client, peer.hostname, measured[-1].dial)
        async with contextlib.AsyncExitStack() as stack:
            if agent:
                agents = [("agent, DERP", False), ("agent, direct", True)][1 if kernel_peer else 0:]
                for name, direct in agents:
                    listen = free_port()
                    process, metrics = await stack.enter_async_context(
                        running_agent(env, headscale, target, port, listen, direct=direct))
                    hostname = "bench-agent-direct" if direct else "bench-agent-derp"
                    claim = pathcheck.DIRECT if direct else pathcheck.DERP
                    measured.append(Measured(PathResult(name), tcp_dialer(listen),
                                             pathcheck.agent_check(metrics, hostname, peer, claim), process.pid))
                    await upload(measured[-1].dial, 64 * 1024)
                    if direct:
                        await pathcheck.until_direct(measured[-1].dial, metrics)
            for row in measured:
                row.result.extra["path_before"] = await asyncio.to_thread(row.check)
                row.result.extra["rss_ready_kib"] = rss_kib(row.pid)
            await measure_all([(row.result, row.dial) for row in measured], mib=mib, rounds=rounds, setups=setups)
            for row in measured:
                row.result.extra["path_after"] = await asyncio.to_thread(row.check)
                row.result.extra["rss_after_kib"] = rss_kib(row.pid)
                row.result.extra["rss_100_connections_kib"] = await held_connections_rss(row.pid, row.dial, 100)
    return [row.result for row in measured]


def table(results: list[PathResult]) -> str:
    rows = ["| path | 1 stream up MB/s | 1 stream down MB/s | 8 streams up MB/s | 8 streams down MB/s "
            "| setup p50 ms | setup p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {r.one_stream_up_mbs:.1f} | {r.one_stream_down_mbs:.1f} | "
                    f"{r.eight_streams_up_mbs:.1f} | {r.eight_streams_down_mbs:.1f} | {r.setup_p50_ms:.1f} | "
                    f"{r.setup_p99_ms:.1f} |")
    return "\n".join(rows)


def ratios(results: list[PathResult], numerator: str, denominator: str) -> dict[str, float]:
    """``numerator`` / ``denominator`` per throughput column (medians), by path name."""
    by_name = {r.name: r for r in results}
    if numerator not in by_name or denominator not in by_name:
        return {}
    top, bottom = by_name[numerator], by_name[denominator]
    return {c: round(getattr(top, c) / getattr(bottom, c), 2) for c in COLUMNS if getattr(bottom, c)}


RATIO_PAIRS = (("DERP", "agent, DERP", "tailscaled userspace, DERP"),
               ("direct", "agent, direct", "tailscaled userspace, direct"))


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: its conditions, the verified paths, the tables."""
    results = [PathResult(**r) for r in doc["results"]]
    if doc.get("kernel_peer"):
        lines = [
            f"### Egress against a kernel-mode peer, {doc['date']}, commit {doc['commit']} (Headscale "
            f"{doc['headscale']}, tailscaled {doc['tailscale']})", "",
            "The peer is the pinned tailscaled on a TUN device (`--tun=tailscale0`, `--netfilter-mode=off`) in a "
            "network namespace of its own (198.18.0.0/15), and the sink/source server listens there, reached "
            "through the peer's kernel TCP: the peer forwards nothing in userspace. Headscale listens on the "
            "namespace's gateway address; the clients (tailscaled userspace through SOCKS5, the agent with "
            "direct paths) run on this machine and reach the peer over direct UDP across the namespace's veth "
            "pair. Only direct rows: over DERP the relay is the limit, not the peer.", "",
            f"Medians of {doc['rounds']} rounds (each round takes every path in turn), {doc['mib']} MiB per "
            f"measurement, {doc['setups']} connections for the setup times. "
            f"{load_average(doc['loadavg_before'], doc['loadavg_after'])}. The sink/source server runs in a "
            "process of its own; the measuring client in the benchmark's. No process has a CPU or memory "
            "limit (GOMEMLIMIT unset), so the RSS columns compare unlimited processes.", ""]
    else:
        lines = [
            f"## Egress, {doc['date']}, commit {doc['commit']} (Headscale {doc['headscale']} with embedded DERP, "
            f"tailscaled {doc['tailscale']})", "",
            f"Medians of {doc['rounds']} rounds (each round takes every path in turn), {doc['mib']} MiB per "
            f"measurement, {doc['setups']} connections for the setup times. "
            f"{load_average(doc['loadavg_before'], doc['loadavg_after'])}. The sink/source server runs in a "
            "process of its own; the measuring client in the benchmark's. No process has a CPU or memory "
            "limit (none is set for tailscaled or the agent, and GOMEMLIMIT is unset), so the RSS columns "
            "compare unlimited processes. The agent runs as two processes: one DERP only "
            "(`TAILNET_UDP_PORT=off`), one with direct paths (`TAILNET_UDP_PORT=0`).", ""]
    lines += [
        "Each row's path was checked on both ends before and after its measurements (a row whose path "
        "differs from its name fails the run): the measuring tailscaled's entry for the peer "
        "(`CurAddr` for direct, a DERP `Relay` and no `CurAddr` for DERP) or the agent's UDP counters, "
        "and the peer's tailscaled's entry for the measuring node.", "",
        table(results), "", "Ratio agent / tailscaled:", "",
        "| path | 1 stream up | 1 stream down | 8 streams up | 8 streams down |", "|---|---|---|---|---|"]
    for label, numerator, denominator in RATIO_PAIRS:
        if ratio := ratios(results, numerator, denominator):
            lines.append(f"| {label} | " + " | ".join(f"{ratio.get(c, 0):.2f}" for c in COLUMNS) + " |")
    lines += ["", "Samples (MB/s, rounds in order):", "", "| path | " + " | ".join(
        c.replace("_mbs", "").replace("_", " ") for c in COLUMNS) + " |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | " + " | ".join(", ".join(f"{v:.1f}" for v in r.samples.get(c, []))
                                                for c in COLUMNS) + " |")
    lines += ["", "Memory (RSS, MiB):", "",
              "| process | ready | after the throughput rounds | with 100 open connections |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.extra['rss_ready_kib'] / 1024:.1f} | {r.extra['rss_after_kib'] / 1024:.1f} | "
                     f"{r.extra['rss_100_connections_kib'] / 1024:.1f} |")
    lines += ["", "Paths as checked after the measurements:", ""]
    lines += [f"- {r.name}: {r.extra['path_after']}" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32, help="MiB per throughput measurement (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds; the median is reported (default 3)")
    parser.add_argument("--setups", type=int, default=200, help="connections timed for setup (default 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    parser.add_argument("--no-agent", action="store_true", help="measure only the tailscaled paths")
    parser.add_argument("--kernel-peer", action="store_true",
                        help="the peer on a TUN device in a network namespace; direct rows only")
    args = parser.parse_args(argv)
    loadavg_before = os.getloadavg()
    results = asyncio.run(run(args.mib, args.rounds, args.setups, agent=not args.no_agent,
                              kernel_peer=args.kernel_peer))
    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "headscale": versions.HEADSCALE,
           "tailscale": versions.TAILSCALE, "rounds": args.rounds, "mib": args.mib, "setups": args.setups,
           "kernel_peer": args.kernel_peer,
           "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
           "results": [asdict(r) for r in results]}
    for label, numerator, denominator in RATIO_PAIRS:
        doc[f"agent_over_tailscaled_{label.lower()}"] = ratios(results, numerator, denominator)
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc,
            name="egress-kernel-peer" if args.kernel_peer else "egress")
    return 0


if __name__ == "__main__":
    sys.exit(main())
