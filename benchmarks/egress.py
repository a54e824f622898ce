"""Egress benchmark: the agent against tailscaled's userspace networking on the same path.

Path: a client on this machine -> (agent egress listener | tailscaled SOCKS5) -> the tailnet
(DERP, or a direct UDP path where the client supports one) -> a tailscaled peer in userspace
networking -> a sink/source server on 127.0.0.1 behind it.

Measured in one run: one stream and 8 parallel streams (MB/s, upload and download), connection
setup time through the whole path (p50, p99 of connect + one byte echoed), and the agent's RSS
when ready, after the throughput rounds, and with 100 open connections. Throughput is measured in
rounds that take every path in turn (so a slow phase of the machine hits all paths alike); the
table gives the median of the rounds, the JSON every sample. Everything runs on loopback; nothing
leaves the machine.

    python -m benchmarks.egress [--mib 32] [--rounds 3] [--setups 200] [--json results.json]
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
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

from benchmarks import paths
from benchmarks.paths import COLUMNS, MIB, Dial, PathResult, setup_round, throughput_round, upload
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
        wait_until(lambda: _fetch(f"http://{health}/readyz"), timeout=60, what="the agent's /readyz")
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


async def until_direct(dial: Dial, metrics_url: str, timeout: float = 30.0) -> None:
    """Send a little until the agent's metrics show WireGuard going both ways over UDP."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await upload(dial, 64 * 1024)
        text = await asyncio.to_thread(_fetch, metrics_url)
        counts = {name: float(value) for name, value in
                  (line.split() for line in text.splitlines() if line.startswith("tailnet_agent_dataplane_udp"))}
        if counts.get("tailnet_agent_dataplane_udp_packets_out_total", 0) and counts.get(
                "tailnet_agent_dataplane_udp_packets_in_total", 0):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"no direct path within {timeout:.0f} s (see the agent-direct log)")


def _fetch(url: str) -> str:
    """The body of a 2xx answer (urllib raises on any other)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


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


async def run(mib: int, rounds: int, setups: int, *, agent: bool = True) -> list[PathResult]:
    port = free_port()
    server = await asyncio.start_server(paths.serve_connection, "127.0.0.1", port)
    with Environment() as env:
        headscale = env.headscale()
        server_key = headscale.create_preauth_key(tags=["tag:bench-server"], reusable=True)
        peer = env.tailscale_node("bench-server", headscale, authkey=server_key)
        target = peer.ipv4()
        derp_client = env.tailscale_node("bench-derp", headscale, authkey=server_key,
                                         env={"TS_DEBUG_ALWAYS_USE_DERP": "true"})
        direct_client = env.tailscale_node("bench-direct", headscale, authkey=server_key)
        measured = [(PathResult("tailscaled userspace, DERP"), socks5_dialer(derp_client, target, port)),
                 (PathResult("tailscaled userspace, direct"), socks5_dialer(direct_client, target, port))]
        async with contextlib.AsyncExitStack() as stack:
            # Processes whose memory is reported.
            pids = {measured[0][0].name: derp_client.process.pid, measured[1][0].name: direct_client.process.pid}
            if agent:
                for name, direct in (("agent, DERP", False), ("agent, direct", True)):
                    listen = free_port()
                    process, metrics = await stack.enter_async_context(
                        running_agent(env, headscale, target, port, listen, direct=direct))
                    measured.append((PathResult(name), tcp_dialer(listen)))
                    pids[name] = process.pid
                    if direct:
                        await until_direct(measured[-1][1], metrics)
            for result, _ in measured:
                if (pid := pids.get(result.name)) is not None:
                    result.extra["rss_ready_kib"] = rss_kib(pid)
            await measure_all(measured, mib=mib, rounds=rounds, setups=setups)
            for result, dial in measured:
                if (pid := pids.get(result.name)) is not None:
                    result.extra["rss_after_kib"] = rss_kib(pid)
                    result.extra["rss_100_connections_kib"] = await held_connections_rss(pid, dial, 100)
    server.close()
    return [result for result, _ in measured]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32, help="MiB per throughput measurement (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds; the median is reported (default 3)")
    parser.add_argument("--setups", type=int, default=200, help="connections timed for setup (default 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--no-agent", action="store_true", help="measure only the tailscaled paths")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.mib, args.rounds, args.setups, agent=not args.no_agent))
    print(table(results))
    for r in results:
        print(f"{r.name}: samples " + ", ".join(f"{k}={v}" for k, v in r.samples.items()))
        if r.extra:
            print(f"{r.name}: " + ", ".join(f"{k}={v}" for k, v in r.extra.items()))
    derp = ratios(results, "agent, DERP", "tailscaled userspace, DERP")
    direct = ratios(results, "agent, direct", "tailscaled userspace, direct")
    if derp:
        print("agent / tailscaled over DERP: " + ", ".join(f"{k}={v}" for k, v in derp.items()))
    if direct:
        print("agent / tailscaled direct: " + ", ".join(f"{k}={v}" for k, v in direct.items()))
    if args.json:
        doc = {"results": [asdict(r) for r in results], "agent_over_tailscaled_derp": derp,
               "agent_over_tailscaled_direct": direct}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
