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
import ipaddress
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hack.localenv import Environment, Headscale, TailscaleNode, free_port, wait_until

Dial = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
CHUNK = 256 * 1024
MIB = 1024 * 1024


# -- the server behind the peer -----------------------------------------------------------------


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``U`` + u64: read that many bytes, answer the count; ``D`` + u64: send that many bytes;
    ``E``: echo 1 byte. No half-close: tailscaled's SOCKS5 proxy closes both ways on the first EOF."""
    try:
        op = await reader.readexactly(1)
        if op == b"U":
            (size,) = struct.unpack("!Q", await reader.readexactly(8))
            total = 0
            while total < size and (data := await reader.read(min(CHUNK, size - total))):
                total += len(data)
            writer.write(struct.pack("!Q", total))
        elif op == b"D":
            (size,) = struct.unpack("!Q", await reader.readexactly(8))
            block = b"\0" * CHUNK
            while size > 0:
                writer.write(block[: min(size, CHUNK)])
                size -= min(size, CHUNK)
                await writer.drain()
        elif op == b"E":
            writer.write(await reader.readexactly(1))
        await writer.drain()
        await reader.read()  # hold until the client closes
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
        pass  # the client went away, or the benchmark is over
    finally:
        writer.close()


# -- the measurements ---------------------------------------------------------------------------


async def upload(dial: Dial, size: int) -> float:
    reader, writer = await dial()
    started = time.perf_counter()
    writer.write(b"U" + struct.pack("!Q", size))
    block = b"\1" * CHUNK
    sent = 0
    while sent < size:
        writer.write(block[: min(CHUNK, size - sent)])
        sent += min(CHUNK, size - sent)
        await writer.drain()
    (received,) = struct.unpack("!Q", await reader.readexactly(8))
    elapsed = time.perf_counter() - started
    writer.close()
    if received != size:
        raise RuntimeError(f"server received {received} of {size} bytes")
    return elapsed


async def download(dial: Dial, size: int) -> float:
    reader, writer = await dial()
    started = time.perf_counter()
    writer.write(b"D" + struct.pack("!Q", size))
    got = 0
    while got < size:
        data = await reader.read(CHUNK)
        if not data:
            raise RuntimeError(f"stream ended after {got} of {size} bytes")
        got += len(data)
    elapsed = time.perf_counter() - started
    writer.close()
    return elapsed


async def setup_times(dial: Dial, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        reader, writer = await dial()
        writer.write(b"E\x2a")
        await reader.readexactly(1)
        times.append(time.perf_counter() - started)
        writer.close()
    return times


@dataclass
class PathResult:
    name: str
    one_stream_up_mbs: float = 0.0
    one_stream_down_mbs: float = 0.0
    eight_streams_up_mbs: float = 0.0
    eight_streams_down_mbs: float = 0.0
    setup_p50_ms: float = 0.0
    setup_p99_ms: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)
    """Every round's figure per throughput column; the columns above are their medians."""
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.samples.setdefault(column, []).append(round(value, 2))
        setattr(self, column, statistics.median(self.samples[column]))


async def throughput_round(result: PathResult, dial: Dial, *, mib: int) -> None:
    """One sample of each throughput column (8 streams share the ``mib``)."""
    size = mib * MIB
    result.add("one_stream_up_mbs", size / MIB / await upload(dial, size))
    result.add("one_stream_down_mbs", size / MIB / await download(dial, size))
    each = size // 8
    started = time.perf_counter()
    await asyncio.gather(*(upload(dial, each) for _ in range(8)))
    result.add("eight_streams_up_mbs", size / MIB / (time.perf_counter() - started))
    started = time.perf_counter()
    await asyncio.gather(*(download(dial, each) for _ in range(8)))
    result.add("eight_streams_down_mbs", size / MIB / (time.perf_counter() - started))


async def setup_round(result: PathResult, dial: Dial, *, setups: int) -> None:
    times = sorted(await setup_times(dial, setups))
    result.setup_p50_ms = statistics.median(times) * 1000
    result.setup_p99_ms = times[min(len(times) - 1, int(len(times) * 0.99))] * 1000


async def measure_all(paths: list[tuple[PathResult, Dial]], *, mib: int, rounds: int, setups: int) -> None:
    for _, dial in paths:
        await upload(dial, MIB)  # warm up: handshakes, paths
    for _ in range(rounds):
        for result, dial in paths:
            await throughput_round(result, dial, mib=mib)
    for result, dial in paths:
        await setup_round(result, dial, setups=setups)


# -- dialers ------------------------------------------------------------------------------------


def socks5_dialer(node: TailscaleNode, host: str, port: int) -> Dial:
    """Dial through tailscaled's SOCKS5 listener (its userspace netstack)."""

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", node.socks5_port)
        writer.write(b"\x05\x01\x00")
        await reader.readexactly(2)
        writer.write(b"\x05\x01\x00\x01" + ipaddress.IPv4Address(host).packed + struct.pack("!H", port))
        reply = await reader.readexactly(10)
        if reply[1] != 0:
            writer.close()
            raise ConnectionError(f"SOCKS5 connect to {host}:{port} failed with code {reply[1]}")
        return reader, writer

    return dial


def tcp_dialer(port: int) -> Dial:
    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    return dial


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
        "AGENT_MODE": "egress",
        "TAILNET_CONTROL_URL": headscale.url,
        "TAILNET_AUTH_KEY_FILE": str(key_file),
        "TAILNET_HOSTNAME": "bench-agent-direct" if direct else "bench-agent-derp",
        "TAILNET_UDP_PORT": "0" if direct else "off",
        "TAILNET_CA_BUNDLE": str(headscale.ca_bundle),
        "TAILNET_TARGETS": json.dumps([{"name": "bench", "address": target_ip,
                                        "ports": [{"port": port, "listen": listen}]}]),
        "TAILNET_BIND_ADDRESS": "127.0.0.1",
        "TAILNET_HEALTH_ADDRESS": f"127.0.0.1:{free_port()}",
        "TAILNET_LOG_LEVEL": "warning",
    }
    log = (env.log_dir / f"agent-{'direct' if direct else 'derp'}.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any measurement
        [sys.executable, "-m", "tailnet_agent"], env=config, stdout=log, stderr=subprocess.STDOUT)
    try:
        health = config["TAILNET_HEALTH_ADDRESS"]
        wait_until(lambda: _fetch(f"http://{health}/readyz"), timeout=60, what="the agent's /readyz")
        yield proc, f"http://{health}/metrics"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()
        log.close()


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
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    with Environment() as env:
        headscale = env.headscale()
        server_key = headscale.create_preauth_key(tags=["tag:bench-server"], reusable=True)
        peer = env.tailscale_node("bench-server", headscale, authkey=server_key)
        target = peer.ipv4()
        derp_client = env.tailscale_node("bench-derp", headscale, authkey=server_key,
                                         env={"TS_DEBUG_ALWAYS_USE_DERP": "true"})
        direct_client = env.tailscale_node("bench-direct", headscale, authkey=server_key)
        paths = [(PathResult("tailscaled userspace, DERP"), socks5_dialer(derp_client, target, port)),
                 (PathResult("tailscaled userspace, direct"), socks5_dialer(direct_client, target, port))]
        async with contextlib.AsyncExitStack() as stack:
            # Processes whose memory is reported.
            pids = {paths[0][0].name: derp_client.process.pid, paths[1][0].name: direct_client.process.pid}
            if agent:
                for name, direct in (("agent, DERP", False), ("agent, direct", True)):
                    listen = free_port()
                    process, metrics = await stack.enter_async_context(
                        running_agent(env, headscale, target, port, listen, direct=direct))
                    paths.append((PathResult(name), tcp_dialer(listen)))
                    pids[name] = process.pid
                    if direct:
                        await until_direct(paths[-1][1], metrics)
            for result, _ in paths:
                if (pid := pids.get(result.name)) is not None:
                    result.extra["rss_ready_kib"] = rss_kib(pid)
            await measure_all(paths, mib=mib, rounds=rounds, setups=setups)
            for result, dial in paths:
                if (pid := pids.get(result.name)) is not None:
                    result.extra["rss_after_kib"] = rss_kib(pid)
                    result.extra["rss_100_connections_kib"] = await held_connections_rss(pid, dial, 100)
    server.close()
    return [result for result, _ in paths]


def table(results: list[PathResult]) -> str:
    rows = ["| path | 1 stream up MB/s | 1 stream down MB/s | 8 streams up MB/s | 8 streams down MB/s "
            "| setup p50 ms | setup p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {r.one_stream_up_mbs:.1f} | {r.one_stream_down_mbs:.1f} | "
                    f"{r.eight_streams_up_mbs:.1f} | {r.eight_streams_down_mbs:.1f} | {r.setup_p50_ms:.1f} | "
                    f"{r.setup_p99_ms:.1f} |")
    return "\n".join(rows)


COLUMNS = ("one_stream_up_mbs", "one_stream_down_mbs", "eight_streams_up_mbs", "eight_streams_down_mbs")


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
