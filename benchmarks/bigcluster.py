"""The operator in a big cluster: its start-up time and memory with and without 5,000 unrelated
Secrets and ConfigMaps of 50-100 KB (what Helm release Secrets look like) around it.

Two control planes on 127.0.0.1 hold the same CRs (a Tailnet, ``--egresses`` TailnetEgresses and
``--sites`` TailnetSites); one of them also holds the noise, in ten namespaces of its own. Each
round starts the operator (``python -m tailnet_operator``, leader election off) against each in
turn: start-up is the time from the process start to ``/readyz`` passing (every informer
listed); RSS is read once it has been ready for ``--settle`` seconds, and its peak (VmHWM) then.
``--before DIR`` adds a second source tree (an earlier commit, unpacked) measured the same way.

``python -m benchmarks.bigcluster --rounds 3 --json _artifacts/bench-bigcluster.json``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp

from hack.localenv import ControlPlane, Environment
from hack.localenv._process import free_port

from .record import conditions, write_section
from .runtime.harness import Api, bounded, peak_rss_mib, rss_mib

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "tailnet-system"
NOISE_NAMESPACES = 10
BEGIN, END = "<!-- bench:bigcluster:begin -->", "<!-- bench:bigcluster:end -->"


async def install_crs(api: Api, plane: ControlPlane, egresses: int, sites: int) -> None:
    from hack.crds import install_crds, load_samples

    await asyncio.to_thread(install_crds, plane.api_client())
    samples = {s["kind"]: s for s in load_samples()}
    for ns in (NAMESPACE, "kube-system"):
        await api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}}, ok=(409,))
    await api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", {
        "metadata": {"name": "headscale-bootstrap"}, "stringData": {"apiKey": "not-a-real-key"}})
    await api.request("POST", "/apis/tailnet.dev/v1alpha1/tailnets", samples["Tailnet"])

    async def egress(i: int) -> None:
        body = json.loads(json.dumps(samples["TailnetEgress"]))
        body["metadata"] = {"name": f"e{i:04d}", "namespace": NAMESPACE}
        body["spec"]["tag"] = f"tag:egress-e{i:04d}"
        await api.request("POST", f"/apis/tailnet.dev/v1alpha1/namespaces/{NAMESPACE}/tailnetegresses", body)

    async def site(i: int) -> None:
        body = json.loads(json.dumps(samples["TailnetSite"]))
        body["metadata"] = {"name": f"s{i:04d}"}
        body["spec"]["routes"] = [f"172.{16 + i // 256}.{i % 256}.0/24"]
        body["spec"]["routerTag"] = f"tag:site-s{i:04d}"
        await api.request("POST", "/apis/tailnet.dev/v1alpha1/tailnetsites", body)

    await bounded(16, [lambda i=i: egress(i) for i in range(egresses)])  # type: ignore[misc]
    await bounded(16, [lambda i=i: site(i) for i in range(sites)])  # type: ignore[misc]


async def install_noise(api: Api, count: int, seed: int = 1) -> int:
    """``count`` Secrets and ConfigMaps (half each) of 50-100 KB; returns the bytes of their data."""
    rng = random.Random(seed)
    for i in range(NOISE_NAMESPACES):
        await api.request("POST", "/api/v1/namespaces", {"metadata": {"name": f"noise-{i}"}})
    total = 0

    async def one(i: int) -> None:
        nonlocal total
        size = rng.randint(50_000, 100_000)
        payload = rng.randbytes(size * 3 // 4)  # base64 makes it ``size`` bytes
        namespace = f"noise-{i % NOISE_NAMESPACES}"
        labels = {"owner": "helm", "name": f"release-{i}", "status": "deployed", "version": "1"}
        if i % 2:
            body: dict[str, Any] = {"metadata": {"name": f"sh.helm.release.v1.r{i}.v1", "labels": labels},
                                    "type": "helm.sh/release.v1",
                                    "data": {"release": base64.b64encode(payload).decode()}}
            path = f"/api/v1/namespaces/{namespace}/secrets"
        else:
            body = {"metadata": {"name": f"config-{i}", "labels": labels},
                    "data": {"config": base64.b64encode(payload).decode()}}
            path = f"/api/v1/namespaces/{namespace}/configmaps"
        total += size
        await api.request("POST", path, body)

    await bounded(8, [lambda i=i: one(i) for i in range(count)])  # type: ignore[misc]
    return total


@dataclass
class Start:
    tree: str
    cluster: str
    round: int
    startup_s: float
    rss_mib: float
    peak_rss_mib: float


async def start_operator(tree: Path, plane: ControlPlane, *, settle: float, log: Path) -> tuple[float, float, float]:
    port = free_port()
    argv = [sys.executable, "-m", "tailnet_operator", "--kubeconfig", str(plane.kubeconfig), "--namespace",
            NAMESPACE, "--no-leader-elect", "--metrics-bind-address", "0",
            "--health-probe-bind-address", f"127.0.0.1:{port}", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(tree), "TAILNET_AGENT_IMAGE": "localhost/tailnet-operator:dev"}
    with log.open("ab") as out:
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    try:
        async with aiohttp.ClientSession() as session:
            deadline = start + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the operator exited with {proc.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise TimeoutError("the operator did not become ready in 300 s")
                try:
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        startup = time.monotonic() - start
        await asyncio.sleep(settle)
        return startup, rss_mib(proc.pid), peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def run(rounds: int, noise: int, egresses: int, sites: int, settle: float,
              trees: dict[str, Path]) -> tuple[list[Start], int]:
    starts: list[Start] = []
    with Environment() as env:
        clean, noisy = env.control_plane(), env.control_plane()
        async with Api(clean.url, clean.ssl_context()) as api_clean, Api(noisy.url, noisy.ssl_context()) as api_noisy:
            await install_crs(api_clean, clean, egresses, sites)
            await install_crs(api_noisy, noisy, egresses, sites)
            noise_bytes = await install_noise(api_noisy, noise)
            clusters = [("without noise", clean), ("with noise", noisy)]
            runs = [(tree, cluster) for tree in trees for cluster in clusters]
            for rnd in range(rounds):
                order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
                for tree, (name, plane) in order:
                    startup, rss, peak = await start_operator(trees[tree], plane, settle=settle,
                                                              log=env.log_dir / f"operator-{tree}.log")
                    starts.append(Start(tree, name, rnd, startup, rss, peak))
                    print(f"round {rnd} {tree} {name}: ready in {startup:.2f} s, RSS {rss:.1f} MiB "
                          f"(peak {peak:.1f})", flush=True)
    return starts, noise_bytes


def report(starts: list[Start], *, noise: int, noise_bytes: int, egresses: int, sites: int, rounds: int,
           settle: float, conditions: str) -> str:
    lines = [f"## The operator in a big cluster, {dt.date.today().isoformat()}", "",
             f"Machine: {os.cpu_count()} cores, Linux {platform.release()}. {conditions} "
             f"Medians of {rounds} interleaved rounds. Both clusters hold 1 Tailnet, {egresses:,} "
             f"TailnetEgresses and {sites:,} TailnetSites; the noisy one also {noise:,} unrelated Secrets and "
             f"ConfigMaps of 50-100 KB ({noise_bytes / 2**20:.0f} MiB of data) in other namespaces. Start-up: "
             f"process start to /readyz (every informer listed); RSS after {settle:.0f} s ready.", "",
             "| source | cluster | start-up s | RSS MiB | peak RSS MiB |", "|---|---|---|---|---|"]
    summary: dict[tuple[str, str], tuple[float, float, float]] = {}
    for tree in dict.fromkeys(s.tree for s in starts):
        for cluster in ("without noise", "with noise"):
            mine = [s for s in starts if s.tree == tree and s.cluster == cluster]
            if not mine:
                continue
            row = (median(s.startup_s for s in mine), median(s.rss_mib for s in mine),
                   median(s.peak_rss_mib for s in mine))
            summary[(tree, cluster)] = row
            lines.append(f"| {tree} | {cluster} | {row[0]:.2f} | {row[1]:.1f} | {row[2]:.1f} |")
    lines += ["", "What the noise costs (with minus without):", "",
              "| source | start-up s | RSS MiB | peak RSS MiB |", "|---|---|---|---|"]
    for tree in dict.fromkeys(s.tree for s in starts):
        a, b = summary.get((tree, "without noise")), summary.get((tree, "with noise"))
        if a and b:
            lines.append(f"| {tree} | {b[0] - a[0]:+.2f} | {b[1] - a[1]:+.1f} | {b[2] - a[2]:+.1f} |")
    samples = ", ".join(f"{s.tree}/{s.cluster} {s.startup_s:.2f}s {s.rss_mib:.0f}MiB" for s in starts)
    lines += ["", f"Samples in run order: {samples}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--noise", type=int, default=5000)
    parser.add_argument("--egresses", type=int, default=1000)
    parser.add_argument("--sites", type=int, default=200)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--before", type=Path, default=None, help="also measure this source tree")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None)
    args = parser.parse_args(argv)
    trees = {"this tree": ROOT}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    before = os.getloadavg()
    starts, noise_bytes = asyncio.run(run(args.rounds, args.noise, args.egresses, args.sites, args.settle, trees))
    text = report(starts, noise=args.noise, noise_bytes=noise_bytes, egresses=args.egresses, sites=args.sites,
                  rounds=args.rounds, settle=args.settle,
                  conditions=conditions(before))
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(s) for s in starts], indent=1))
    if args.doc:
        write_section(args.doc, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
