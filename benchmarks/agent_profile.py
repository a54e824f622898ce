"""Where the agent's time goes: a profile of one egress stream up and one down, set against this
machine's limits.

The same path as ``benchmarks/egress.py`` (a client on this machine -> the agent's egress
listener -> the tailnet, direct UDP on loopback by default, DERP with ``--derp`` -> a tailscaled
peer in userspace networking -> a sink/source server on 127.0.0.1), and tailscaled's userspace
networking on the same path for the CPU comparison. Each path is checked on both of its ends
before and after (``benchmarks.pathcheck``: a "direct" row whose tailscaled or agent relays fails
the run). For each path and direction, separate
transfers of ``--mib`` MiB measure:

- wall time, MB/s, and CPU seconds (user / system, from ``/proc/PID/stat``) of the agent (or the
  tailscaled client), of the tailscaled peer, of this process (the client) and of the sink/source
  server (a process of its own);
- the data plane's own counters (WireGuard packets in/out, UDP datagrams, resends);
- ``perf record`` of the agent, split by where the samples fall: the kernel (syscalls, UDP/TCP
  stacks, copies to and from user space), the Python interpreter, the Rust crate (and within it
  ChaCha20-Poly1305), libc (``memcpy``/``memmove`` counted as copies);
- ``py-spy record`` of the agent (pinned: ``pip install py-spy==0.4.2``; skipped when absent):
  Python functions by share of the non-idle samples, native calls attributed to their caller;
- ``strace -c -f`` of the agent: system calls per WireGuard packet and per MiB (strace slows
  the process; the counts, not the time, are what is reported).

The machine's limits are measured in the same run: one loopback TCP stream (two threads, 1 MiB
writes), and ChaCha20-Poly1305 seal per core (``cryptography``, OpenSSL) on 1,420-byte and
64 KiB messages. The load average is reported before and after: the machine is shared.

    python -m benchmarks.agent_profile [--mib 64] [--derp] [--streams 1] [--direction both] [--kernel-peer]
                                       [--json results.json] [--tables results.json]

``--kernel-peer`` profiles against the peer of ``benchmarks.egress --kernel-peer``: a tailscaled on
a TUN device in a network namespace, which costs less per MiB than the userspace peer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks import pathcheck
from benchmarks.egress import (
    SERVER_TAG,
    peer_side,
    pid_of,
    running_agent,
    socks5_dialer,
    tcp_dialer,
)
from benchmarks.pathcheck import agent_check, fetch, tailscaled_check, until_direct, until_direct_tailscaled
from benchmarks.paths import MIB, Dial, download, upload
from benchmarks.record import commit, load_average, publish
from hack import versions
from hack.localenv import Environment, free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")
WG_PACKET = 1420
"""Bytes of one WireGuard packet's inner IP packet at the agent's MTU (the seal measured)."""


# -- the machine's limits -----------------------------------------------------------------------


def loopback_tcp_mbs(size: int = 1024 * MIB) -> float:
    """One TCP stream over 127.0.0.1 between two threads of this process, 1 MiB writes."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = [0]

    def sink() -> None:
        conn, _ = listener.accept()
        buf = bytearray(MIB)
        view = memoryview(buf)
        while (n := conn.recv_into(view)) > 0:
            got[0] += n
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    block = b"\0" * MIB
    started = time.perf_counter()
    with socket.create_connection(listener.getsockname()) as client:
        for _ in range(size // MIB):
            client.sendall(block)
        client.shutdown(socket.SHUT_WR)
        thread.join()
    elapsed = time.perf_counter() - started
    listener.close()
    return got[0] / MIB / elapsed


def chacha_mbs(message: int, seconds: float = 1.0) -> float:
    """ChaCha20-Poly1305 seals of ``message`` bytes on one core (OpenSSL via ``cryptography``)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    aead = ChaCha20Poly1305(os.urandom(32))
    data = os.urandom(message)
    nonce = bytes(12)
    done = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(64):
            aead.encrypt(nonce, data, None)
        done += 64 * message
    return done / MIB / elapsed


def limits() -> dict[str, float]:
    return {"loopback_tcp_one_stream_mbs": round(loopback_tcp_mbs(), 1),
            "chacha20poly1305_1420b_mbs_per_core": round(chacha_mbs(WG_PACKET), 1),
            "chacha20poly1305_64kib_mbs_per_core": round(chacha_mbs(64 * 1024), 1)}


# -- measuring one process ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` and all its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def metrics(url: str | None) -> dict[str, float]:
    if url is None:
        return {}
    out: dict[str, float] = {}
    for line in fetch(url).splitlines():
        if line.startswith("tailnet_agent_dataplane_"):
            name, value = line.split()[:2]
            out[name.removeprefix("tailnet_agent_dataplane_").removesuffix("_total")] = float(value)
    return out


Transfer = Callable[[], Awaitable[float]]


async def timed(transfer: Transfer, pids: dict[str, int], url: str | None, size: int) -> dict[str, Any]:
    """One transfer: MB/s, CPU seconds per process, data-plane counter deltas."""
    before_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    before = await asyncio.to_thread(metrics, url)
    elapsed = await transfer()
    after = await asyncio.to_thread(metrics, url)
    cpu = {}
    for name, pid in pids.items():
        user, system = cpu_seconds(pid)
        cpu[name] = {"user_s": round(user - before_cpu[name][0], 3), "system_s": round(system - before_cpu[name][1], 3)}
    counters = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    return {"mbs": round(size / MIB / elapsed, 1), "seconds": round(elapsed, 3), "cpu": cpu, "counters": counters}


@contextlib.asynccontextmanager
async def attached(argv: list[str]) -> Any:
    """A tracer/profiler attached for the block, stopped with SIGINT (it then writes its report)."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    await asyncio.sleep(1.0)  # let it attach
    result: dict[str, str] = {}
    try:
        yield result
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        result["stdout"], result["stderr"] = out.decode(errors="replace"), err.decode(errors="replace")


def classify(dso: str, sym: str) -> str:
    """The bucket of one perf sample."""
    s = sym.lower()
    if "chacha" in s or "poly1305" in s:
        return "crypto (ChaCha20-Poly1305)"
    if dso.startswith("[kernel") or (dso == "[unknown]" and s.startswith("0xffff")):
        if "copy_user" in s or "copy_to_iter" in s or "copy_from_iter" in s or "memcpy" in s or "csum_partial" in s:
            return "kernel: copies to/from user"
        return "kernel: other (syscalls, UDP/TCP, scheduler)"
    if "memcpy" in s or "memmove" in s:
        return "copies (memcpy/memmove)"
    if "_native" in dso or "tailnet_native" in dso:
        return "Rust data plane (other)"
    if "python" in dso or dso.startswith("libpython"):
        return "Python interpreter"
    if dso.startswith("libc") or dso.startswith("ld-"):
        return "libc (other)"
    if "libcrypto" in dso or "libssl" in dso:
        return "OpenSSL (TLS)"
    return f"other ({dso})"


def perf_split(data: Path) -> dict[str, Any]:
    """``perf report`` of ``data`` by bucket, plus the top symbols."""
    out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym",
                          "--percent-limit", "0"], capture_output=True, text=True, check=False).stdout
    buckets: dict[str, float] = {}
    top: list[tuple[float, str, str]] = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[^\]]\]\s+(.*)$", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        bucket = classify(dso, sym)
        buckets[bucket] = buckets.get(bucket, 0.0) + pct
        top.append((pct, dso, sym))
    top.sort(reverse=True)
    return {"buckets_pct": {k: round(v, 1) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
            "top_symbols": [{"pct": p, "dso": d, "sym": s[:100]} for p, d, s in top[:15]]}


def pyspy_split(raw: str) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks: share of samples by leaf function and by any frame."""
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r" \((.*/)?([^/]+):\d+\)$", r" (\2)", f) for f in stack.split(";")]
        leaf[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return {"samples": 0}
    return {"samples": total,
            "self_pct": {k: round(100 * v / total, 1) for k, v in leaf.most_common(12)},
            "inclusive_pct": {k: round(100 * v / total, 1) for k, v in inclusive.most_common(25)}}


def strace_counts(report: str) -> dict[str, int]:
    calls: dict[str, int] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and not parts[-1].startswith("total"):
            with contextlib.suppress(ValueError):
                calls[parts[-1]] = int(parts[3])
    return calls


async def profile_direction(name: str, direction: str, dial: Dial, pid: int, others: dict[str, int],
                            url: str | None, size: int, tools: dict[str, bool], streams: int = 1) -> dict[str, Any]:
    """Plain, perf, py-spy and strace transfers of one direction through one path (``streams``
    parallel streams sharing ``size``)."""

    async def transfer() -> float:
        move = upload if direction == "up" else download
        started = time.perf_counter()
        await asyncio.gather(*(move(dial, size // streams) for _ in range(streams)))
        return time.perf_counter() - started

    pids = {"measured": pid, **others}
    result: dict[str, Any] = {"plain": await timed(transfer, pids, url, size)}
    with tempfile.TemporaryDirectory() as tmp:
        if tools["perf"]:
            data = Path(tmp) / "perf.data"
            async with attached(["perf", "record", "-F", "999", "-p", str(pid), "-o", str(data)]):
                result["perf_transfer"] = await timed(transfer, pids, url, size)
            result["perf"] = await asyncio.to_thread(perf_split, data)
        if tools["py-spy"] and name.startswith("agent"):
            raw = Path(tmp) / "pyspy.txt"
            async with attached([tools_path("py-spy"), "record", "-p", str(pid), "-r", "250", "-f", "raw",
                                 "-o", str(raw)]):
                result["pyspy_transfer"] = await timed(transfer, pids, url, size)
            result["pyspy"] = pyspy_split(raw.read_text() if raw.exists() else "")
        if tools["strace"]:
            async with attached(["strace", "-c", "-f", "-p", str(pid)]) as traced:
                result["strace_transfer"] = await timed(transfer, pids, url, size)
            calls = strace_counts(traced["stderr"])
            total = sum(calls.values())
            counters = result["strace_transfer"]["counters"]
            packets = counters.get("packets_in", 0) + counters.get("packets_out", 0)
            result["syscalls"] = {"by_call": dict(sorted(calls.items(), key=lambda kv: -kv[1])[:12]),
                                  "total": total, "per_mib": round(total * MIB / size, 1),
                                  "per_wireguard_packet": round(total / packets, 3) if packets else None}
    return result


def tools_path(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


# -- the run ------------------------------------------------------------------------------------


def available_tools() -> dict[str, bool]:
    return {"perf": shutil.which("perf") is not None, "strace": shutil.which("strace") is not None,
            "py-spy": Path(tools_path("py-spy")).exists()}


async def run(mib: int, derp: bool, tools: dict[str, bool], streams: int = 1,
              directions: tuple[str, ...] = ("up", "down"), kernel_peer: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {"load_before": os.getloadavg(), "tools": tools, "mib": mib, "streams": streams,
                           "limits": await asyncio.to_thread(limits), "paths": {}, "kernel_peer": kernel_peer}
    size = mib * MIB
    with Environment() as env, peer_side(env, kernel=kernel_peer) as far:
        headscale, peer, target, port = far.headscale, far.node, far.target, far.port
        key = headscale.create_preauth_key(tags=[SERVER_TAG], reusable=True)
        clients = {"tailscaled, direct": (env.tailscale_node("bench-direct", headscale, authkey=key), pathcheck.DIRECT)}
        if derp:
            clients["tailscaled, DERP"] = (env.tailscale_node("bench-derp", headscale, authkey=key,
                                                              env={"TS_DEBUG_ALWAYS_USE_DERP": "true"}), pathcheck.DERP)
        async with contextlib.AsyncExitStack() as stack:
            measured: list[tuple[str, Dial, int, str | None]] = []
            checks: dict[str, Callable[[], str]] = {}
            for direct in (True, False) if derp else (True,):
                listen = free_port()
                proc, url = await stack.enter_async_context(
                    running_agent(env, headscale, target, port, listen, direct=direct))
                dial = tcp_dialer(listen)
                await upload(dial, 64 * 1024)
                if direct:
                    await until_direct(dial, url)
                name = f"agent, {'direct' if direct else 'DERP'}"
                measured.append((name, dial, proc.pid, url))
                checks[name] = agent_check(url, f"bench-agent-{'direct' if direct else 'derp'}", peer,
                                           pathcheck.DIRECT if direct else pathcheck.DERP)
            for name, (node, claim) in clients.items():
                dial = socks5_dialer(node, target, port)
                await upload(dial, 64 * 1024)
                if claim == pathcheck.DIRECT:
                    await until_direct_tailscaled(node, peer.hostname, dial)
                measured.append((name, dial, pid_of(node), None))
                checks[name] = tailscaled_check(node, peer, claim)
            for _, dial, _, _ in measured:
                await upload(dial, 4 * MIB)  # warm up
            doc["path_before"] = {name: await asyncio.to_thread(check) for name, check in checks.items()}
            others = {"tailscaled peer": pid_of(peer), "client (this process)": os.getpid(), "sink": far.server_pid}
            doc["path_after"] = {}
            for name, dial, pid, metrics_url in measured:
                doc["paths"][name] = {d: await profile_direction(name, d, dial, pid, others, metrics_url, size, tools,
                                                                 streams) for d in directions}
                # Checked as the row's own run ends: tailscaled reports a direct path as DERP once it
                # has been idle for a few seconds (its trust in the address lapses until the next
                # send), as it is while the other rows run.
                doc["path_after"][name] = await asyncio.to_thread(checks[name])
    doc["load_after"] = os.getloadavg()
    return doc


def summary(doc: dict[str, Any]) -> str:
    lines = [f"load average before {doc['load_before']}, after {doc['load_after']}",
             f"limits: {doc['limits']}"]
    for name, directions in doc["paths"].items():
        for direction, r in directions.items():
            plain = r["plain"]
            cpu = plain["cpu"]["measured"]
            busy = cpu["user_s"] + cpu["system_s"]
            lines.append(f"{name} {direction}: {plain['mbs']} MB/s; measured process CPU {busy:.2f} s "
                         f"({cpu['user_s']:.2f} user, {cpu['system_s']:.2f} sys) = "
                         f"{busy / plain['seconds']:.2f} cores, {1000 * busy / doc['mib']:.1f} ms/MiB; "
                         f"others {plain['cpu']}; counters {plain['counters']}")
            if "perf" in r:
                lines.append(f"  perf: {r['perf']['buckets_pct']}")
                lines.append("  top: " + "; ".join(f"{t['pct']}% {t['sym']}" for t in r["perf"]["top_symbols"][:8]))
            if "pyspy" in r:
                lines.append(f"  py-spy self: {r['pyspy'].get('self_pct')}")
                lines.append(f"  py-spy inclusive: {r['pyspy'].get('inclusive_pct')}")
            if "syscalls" in r:
                lines.append(f"  syscalls: {r['syscalls']}")
    return "\n".join(lines)


def _ms_per_mib(cpu: dict[str, float], mib: int) -> float:
    return 1000 * (cpu["user_s"] + cpu["system_s"]) / mib


def tables(doc: dict[str, Any]) -> str:
    """Markdown tables of one run (for docs/benchmarks.md)."""
    mib = doc["mib"]
    rows = ["| path, direction | MB/s | CPU ms/MiB: measured process (user + sys) | tailscaled peer | client + sink "
            "| measured share of the path's CPU | syscalls / MiB | syscalls / WireGuard packet |",
            "|---|---|---|---|---|---|---|---|"]
    perf_rows = ["| path, direction | kernel: copies | kernel: other | Python interpreter | Rust data plane "
                 "| ChaCha20-Poly1305 | memcpy/memmove | libc other | rest |", "|---|---|---|---|---|---|---|---|---|"]
    for name, directions in doc["paths"].items():
        for direction, r in directions.items():
            cpu = r["plain"]["cpu"]
            own, peer = _ms_per_mib(cpu["measured"], mib), _ms_per_mib(cpu["tailscaled peer"], mib)
            client = _ms_per_mib(cpu["client (this process)"], mib) + _ms_per_mib(cpu["sink"], mib)
            calls = r.get("syscalls", {})
            per_packet = calls.get("per_wireguard_packet")
            rows.append(f"| {name}, {direction} | {r['plain']['mbs']} | {own:.1f} "
                        f"({_ms_per_mib({'user_s': cpu['measured']['user_s'], 'system_s': 0}, mib):.1f} + "
                        f"{_ms_per_mib({'user_s': 0, 'system_s': cpu['measured']['system_s']}, mib):.1f}) | "
                        f"{peer:.1f} | {client:.1f} | {100 * own / (own + peer + client):.0f}% | "
                        f"{calls.get('per_mib', '-')} | {per_packet if per_packet is not None else '-'} |")
            if "perf" in r:
                b = r["perf"]["buckets_pct"]
                named = ["kernel: copies to/from user", "kernel: other (syscalls, UDP/TCP, scheduler)",
                         "Python interpreter", "Rust data plane (other)", "crypto (ChaCha20-Poly1305)",
                         "copies (memcpy/memmove)", "libc (other)"]
                rest = sum(v for k, v in b.items() if k not in named)
                perf_rows.append(f"| {name}, {direction} | " + " | ".join(f"{b.get(k, 0.0):.0f}%" for k in named)
                                 + f" | {rest:.0f}% |")
    return "\n".join(rows) + "\n\nperf samples of the measured process:\n\n" + "\n".join(perf_rows)


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: its conditions, the machine's limits, the checked
    paths and the tables."""
    limit = doc["limits"]
    tools = ", ".join(name for name, present in doc["tools"].items() if present) or "none"
    peer = ("the peer a tailscaled on a TUN device in a network namespace of its own, the sink/source server "
            "there behind its kernel TCP; " if doc.get("kernel_peer") else "")
    lines = [
        f"### Where the agent's time goes{', against a kernel-mode peer' if doc.get('kernel_peer') else ''}, "
        f"{doc['date']}, commit {doc['commit']} (Headscale {doc['headscale']}, tailscaled {doc['tailscale']})", "",
        f"{peer}{doc['mib']} MiB per transfer, {doc['streams']} stream(s); profilers present: {tools}. "
        f"{load_average(doc['load_before'], doc['load_after'])}. The machine's limits in the same run: one "
        f"loopback TCP stream {limit['loopback_tcp_one_stream_mbs']:,.0f} MB/s; ChaCha20-Poly1305 seal on one "
        f"core {limit['chacha20poly1305_1420b_mbs_per_core']:,.0f} MB/s for 1,420-byte messages, "
        f"{limit['chacha20poly1305_64kib_mbs_per_core']:,.0f} MB/s for 64 KiB.", "",
        "Paths, checked at both ends before and after the transfers:", ""]
    lines += [f"- {name}: before: {doc['path_before'][name]}; after: {doc['path_after'][name]}"
              for name in doc["path_after"]]
    lines += ["", "CPU per MiB moved, by process on the path (the tailscaled peer and the client + sink are the "
              "same processes for every row):", "", tables(doc)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per transfer (default 64)")
    parser.add_argument("--derp", action="store_true", help="also profile the DERP path")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--streams", type=int, default=1, help="parallel streams per transfer (default 1)")
    parser.add_argument("--direction", choices=("up", "down", "both"), default="both")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    parser.add_argument("--tables", type=Path, default=None, help="print the tables of an earlier run's JSON")
    parser.add_argument("--kernel-peer", action="store_true",
                        help="the peer on a TUN device in a network namespace (benchmarks.egress --kernel-peer)")
    args = parser.parse_args(argv)
    if args.tables:
        print(tables(json.loads(args.tables.read_text())))
        return 0
    directions = ("up", "down") if args.direction == "both" else (args.direction,)
    doc = asyncio.run(run(args.mib, args.derp, available_tools(), args.streams, directions, args.kernel_peer))
    doc |= {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "headscale": versions.HEADSCALE,
            "tailscale": versions.TAILSCALE}
    print(summary(doc))
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc,
            name="agent-profile-kernel-peer" if args.kernel_peer else "agent-profile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
