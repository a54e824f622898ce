"""Runtime benchmark: one small Widget controller on this project's runtime, on kopf and on Go
controller-runtime, and the floor (a bare client making the same writes), against one real
etcd + kube-apiserver on 127.0.0.1.

For each N and each round (the implementations take turns, in a rotating order), a fresh
namespace gets N Widgets, then the controller starts: cold start is the time from its start to
all N converged (status.observedGeneration == generation, which each controller writes after the
ConfigMap). Then churn: ``--churn`` spec updates at ``--rate`` per second on distinct Widgets,
latency from each write to the watch showing it observed; then (first round only) ``--idle``
seconds with nothing to do. Writes are the apiserver's own counters of writes to Widgets and
ConfigMaps, less the benchmark's; CPU and peak RSS come from /proc of the controller process.

``python -m benchmarks.runtime --sizes 1000,5000 --rounds 3 --json _artifacts/bench-runtime.json``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from benchmarks import record
from benchmarks.record import write_section
from hack.localenv import ControlPlane, Environment

from . import harness
from .harness import Api, Convergence

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailnet-operator" / "bench"
KOPF_SPEC = "kopf>=1.45,<1.46"
CONTROLLER_RUNTIME = "sigs.k8s.io/controller-runtime@v0.25.2"
IMPLEMENTATIONS = ("ours", "kopf", "controller-runtime", "floor")
CONVERGE_TIMEOUT = 900.0


# -- the implementations ----------------------------------------------------------------------


def kopf_python() -> Path:
    """kopf in a virtualenv of its own under the cache (created on first use)."""
    venv = CACHE / "kopf-venv"
    python = venv / "bin" / "python"
    marker = venv / f".installed-{hashlib.sha256(KOPF_SPEC.encode()).hexdigest()[:12]}"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", KOPF_SPEC],
                       check=True)
        marker.touch()
    return python


def controller_runtime_binary() -> Path:
    """benchmarks/runtime/crwidget built in a throwaway module against controller-runtime (cached by
    the source and the version)."""
    source = (HERE / "crwidget" / "main.go").read_bytes()
    digest = hashlib.sha256(source + CONTROLLER_RUNTIME.encode()).hexdigest()[:12]
    binary = CACHE / f"crwidget-{digest}"
    if binary.exists():
        return binary
    work = CACHE / f"crwidget-build-{digest}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "main.go").write_bytes(source)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    for argv in (["go", "mod", "init", "crwidget"], ["go", "get", CONTROLLER_RUNTIME], ["go", "mod", "tidy"],
                 ["go", "build", "-trimpath", "-o", str(binary) + ".tmp", "."]):
        subprocess.run(argv, cwd=work, env=env, check=True)
    (CACHE / f"crwidget-{digest}.go.mod").write_text((work / "go.mod").read_text())
    Path(str(binary) + ".tmp").rename(binary)
    shutil.rmtree(work, ignore_errors=True)
    return binary


DEFAULT_WORKERS = 32
"""Every controller's concurrent reconciles: the floor's requests in flight (the runtime's
``APISERVER_WORKERS``); 8 until 2026-12-07."""


def controller_argv(impl: str, kubeconfig: Path, namespace: str, workers: int = DEFAULT_WORKERS) -> list[str]:
    """How to start ``impl``'s controller with ``workers`` concurrent reconciles (kopf reads them
    from ``WIDGET_WORKERS``, see :func:`controller_env`)."""
    if impl == "ours":
        return [sys.executable, "-m", "benchmarks.runtime.ours", str(kubeconfig), namespace, str(workers)]
    if impl == "kopf":
        return [str(kopf_python()), "-m", "kopf", "run", "--standalone", "--namespace", namespace, "--quiet",
                str(HERE / "kopf_widget.py")]
    if impl == "controller-runtime":
        return [str(controller_runtime_binary()), f"--workers={workers}", f"--namespace={namespace}",
                f"--kubeconfig={kubeconfig}"]
    raise ValueError(impl)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    with contextlib.suppress(Exception):
        found["kopf"] = subprocess.run(
            [str(kopf_python()), "-c", "import importlib.metadata as m; print(m.version('kopf'))"],
            check=True, capture_output=True, text=True).stdout.strip()
    with contextlib.suppress(Exception):
        found["go"] = subprocess.run(["go", "env", "GOVERSION"], check=True, capture_output=True,
                                     text=True).stdout.strip()
    found["controller-runtime"] = CONTROLLER_RUNTIME.rpartition("@")[2]
    from hack import versions as pinned
    found["kube-apiserver"] = pinned.KUBERNETES
    found["etcd"] = pinned.ETCD
    return found


# -- one measurement ---------------------------------------------------------------------------


@dataclass
class Run:
    impl: str
    n: int
    round: int
    cold_start_s: float = 0.0
    cold_writes: int = 0
    controller_cpu_s: float = 0.0
    apiserver_cpu_s: float = 0.0
    churn_p50_ms: float = float("nan")
    churn_p99_ms: float = float("nan")
    churn_writes: int = 0
    churn_changes: int = 0
    churn_cpu_s: float = 0.0
    idle_writes: int | None = None
    peak_rss_mib: float = 0.0


async def quiet_writes(api: Api, *, still: float = 2.0, deadline: float) -> int:
    """The write count once it has not moved for ``still`` seconds."""
    last, since = await api.write_count(), time.monotonic()
    while time.monotonic() - since < still:
        if time.monotonic() > deadline:
            raise TimeoutError("writes did not settle")
        await asyncio.sleep(0.25)
        now = await api.write_count()
        if now != last:
            last, since = now, time.monotonic()
    return last


async def churn(api: Api, convergence: Convergence, namespace: str, n: int, count: int, rate: float) -> list[float]:
    """``count`` spec updates at ``rate``/s on distinct Widgets; latency (s) from each write's send
    to the watch showing its generation observed."""
    latencies: list[float] = []

    async def update(i: int) -> None:
        name = f"w{i % n:05d}"
        sent = time.monotonic()
        obj = await api.request("PATCH", f"{harness.WIDGETS}/namespaces/{namespace}/widgets/{name}",
                                {"spec": {"value": f"c{i}"}}, content_type="application/merge-patch+json")
        seen = await convergence.wait_observed(name, obj["metadata"]["generation"])
        latencies.append(seen - sent)

    start = time.monotonic()
    async with asyncio.timeout(count / rate + 300), asyncio.TaskGroup() as group:
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            group.create_task(update(i))
    return latencies


async def measure(impl: str, plane: ControlPlane, api: Api, n: int, rnd: int, *, churn_count: int, rate: float,
                  idle: float, log_dir: Path, workers: int = DEFAULT_WORKERS) -> Run:
    namespace = f"{impl.replace('-', '')[:8]}-{n}-{rnd}-{uuid.uuid4().hex[:4]}"
    widgets = await harness.create_widgets(api, namespace, n)
    run = Run(impl, n, rnd)
    apiserver_pid = plane.apiserver.pid if plane.apiserver else None
    assert apiserver_pid is not None
    before = await quiet_writes(api, deadline=time.monotonic() + 120)
    api_cpu = harness.cpu_seconds(apiserver_pid)
    if impl == "floor":
        start = time.monotonic()
        await harness.floor_writes(api, widgets)
        run.cold_start_s = time.monotonic() - start
        run.apiserver_cpu_s = harness.cpu_seconds(apiserver_pid) - api_cpu
        run.cold_writes = await quiet_writes(api, deadline=time.monotonic() + 120) - before
        return run

    convergence = Convergence(api, namespace)
    await convergence.start()
    argv = controller_argv(impl, plane.kubeconfig, namespace, workers)
    log = open(log_dir / f"{namespace}.log", "wb")  # noqa: SIM115, ASYNC230
    env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig), "PYTHONPATH": str(ROOT), "WIDGET_WORKERS": str(workers)}
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    try:
        await convergence.until(n, deadline=start + CONVERGE_TIMEOUT)
        run.cold_start_s = time.monotonic() - start
        run.controller_cpu_s = harness.cpu_seconds(proc.pid)
        run.apiserver_cpu_s = harness.cpu_seconds(apiserver_pid) - api_cpu
        after_cold = await quiet_writes(api, deadline=time.monotonic() + 120)
        run.cold_writes = after_cold - before

        if churn_count:
            cpu = harness.cpu_seconds(proc.pid)
            latencies = await churn(api, convergence, namespace, n, churn_count, rate)
            after_churn = await quiet_writes(api, deadline=time.monotonic() + 120)
            run.churn_cpu_s = harness.cpu_seconds(proc.pid) - cpu
            run.churn_writes = after_churn - after_cold - churn_count
            run.churn_changes = churn_count
            run.churn_p50_ms = harness.percentile(latencies, 0.50) * 1000
            run.churn_p99_ms = harness.percentile(latencies, 0.99) * 1000
        if idle:
            before_idle = await api.write_count()
            await asyncio.sleep(idle)
            run.idle_writes = await api.write_count() - before_idle
        run.peak_rss_mib = harness.peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        log.close()
        await convergence.stop()
    if proc.returncode not in (0, -signal.SIGTERM, 143):
        print(f"  note: {impl} exited {proc.returncode}", file=sys.stderr)
    del widgets
    return run


async def run_all(sizes: list[int], rounds: int, impls: list[str], *, churn_count: int, rate: float,
                  idle: float, large_rounds: int | None = None, workers: int = DEFAULT_WORKERS,
                  progress: Path | None = None) -> tuple[list[Run], dict[str, str]]:
    for impl in impls:  # build and install before anything is timed
        if impl in ("kopf", "controller-runtime"):
            controller_argv(impl, Path("/dev/null"), "x")
    runs: list[Run] = []
    with Environment() as env:
        plane = env.control_plane()
        found = versions()
        async with Api(plane.url, plane.ssl_context()) as api:
            await install_crd(api)
            log_dir = env.log_dir / "bench-runtime"
            log_dir.mkdir(parents=True, exist_ok=True)
            for n in sizes:
                for rnd in range(rounds if n == sizes[0] or large_rounds is None else large_rounds):
                    order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                    for impl in order:
                        run = await measure(impl, plane, api, n, rnd, churn_count=churn_count, rate=rate,
                                            idle=idle if rnd == 0 and n == sizes[0] else 0.0,
                                            log_dir=log_dir, workers=workers)
                        runs.append(run)
                        if progress is not None:  # what is measured so far survives an interrupted run
                            progress.parent.mkdir(parents=True, exist_ok=True)
                            progress.write_text(json.dumps({"versions": found, "runs": [asdict(r) for r in runs]},  # noqa: ASYNC240
                                                           indent=1))
                        print(f"N={n} round {rnd} {impl}: cold {run.cold_start_s:.1f}s "
                              f"cpu {run.controller_cpu_s:.1f}s writes {run.cold_writes} "
                              f"churn p50/p99 {run.churn_p50_ms:.0f}/{run.churn_p99_ms:.0f} ms "
                              f"writes/change {run.churn_writes / max(1, run.churn_changes):.2f} "
                              f"idle {run.idle_writes} rss {run.peak_rss_mib:.0f} MiB", flush=True)
    return runs, found


async def install_crd(api: Api) -> None:
    from e2e.widgets import WIDGET_CRD

    await api.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD, ok=(409,))
    deadline = time.monotonic() + 60
    while True:
        crd = await api.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                                       f"{WIDGET_CRD['metadata']['name']}")
        if any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd.get("status") or {}).get("conditions") or []):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the Widget CRD was not Established")
        await asyncio.sleep(0.2)


# -- the report ---------------------------------------------------------------------------------


@dataclass
class Summary:
    impl: str
    n: int
    values: dict[str, float] = field(default_factory=dict)


def summarize(runs: list[Run]) -> dict[tuple[str, int], dict[str, float]]:
    out: dict[tuple[str, int], dict[str, float]] = {}
    keys = {(r.impl, r.n) for r in runs}
    for impl, n in keys:
        mine = [r for r in runs if r.impl == impl and r.n == n]
        row = {
            "cold_start_s": median(r.cold_start_s for r in mine),
            "controller_cpu_s": median(r.controller_cpu_s for r in mine),
            "apiserver_cpu_s": median(r.apiserver_cpu_s for r in mine),
            "cold_writes_per_object": median(r.cold_writes / n for r in mine),
            "peak_rss_mib": median(r.peak_rss_mib for r in mine),
            "rounds": len(mine),
        }
        churned = [r for r in mine if r.churn_changes]
        if churned:
            row["churn_p50_ms"] = median(r.churn_p50_ms for r in churned)
            row["churn_p99_ms"] = median(r.churn_p99_ms for r in churned)
            row["writes_per_change"] = median(r.churn_writes / r.churn_changes for r in churned)
            row["churn_cpu_s"] = median(r.churn_cpu_s for r in churned)
        idle = [r.idle_writes for r in mine if r.idle_writes is not None]
        if idle:
            row["idle_writes"] = max(idle)
        out[(impl, n)] = row
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def report(runs: list[Run], found: dict[str, str], *, rounds: int, churn_count: int, rate: float,
           idle: float, conditions: str, workers: int = DEFAULT_WORKERS) -> str:
    table = summarize(runs)
    sizes = sorted({r.n for r in runs})
    impls = [i for i in IMPLEMENTATIONS if any(r.impl == i for r in runs)]
    lines = [
        f"## Runtime vs kopf vs controller-runtime, {dt.date.today().isoformat()}",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}. "
        f"{conditions} Versions: "
        + ", ".join(f"{k} {v}" for k, v in found.items()) + ". "
        f"Medians of the rounds per N given in each table (each round runs every implementation in turn, in a "
        f"rotating order); churn is {churn_count} spec updates at {rate:.0f}/s on distinct Widgets; idle writes are "
        f"counted over {idle:.0f} s after the churn of the first round at the smallest N. Controllers run "
        f"{workers} workers (the floor keeps 32 requests in flight); ours drops the events of its own writes "
        "(`ignore_own_writes`), controller-runtime's For has GenerationChangedPredicate; kopf runs standalone with "
        "posting off. Writes are the apiserver's counts of writes to Widgets and "
        "ConfigMaps (less the benchmark's own); controller CPU is user+system of its process from start to "
        "all converged.",
        "",
    ]
    for n in sizes:
        floor = table.get(("floor", n), {})
        count = max(int(r.get("rounds", 0)) for (_, m), r in table.items() if m == n)
        lines += [f"### N = {n:,} ({count} round{'s' if count != 1 else ''})", "",
                  "| implementation | cold start s | vs floor | controller CPU s | CPU ms per object "
                  "| apiserver CPU s | writes per object | peak RSS MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for impl in impls:
            row = table.get((impl, n))
            if row is None:
                continue
            cpu = row["controller_cpu_s"] if impl != "floor" else None
            lines.append(
                f"| {impl} | {_fmt(row['cold_start_s'])} | {_ratio(row['cold_start_s'], floor.get('cold_start_s'))} "
                f"| {_fmt(cpu)} | {_fmt(cpu * 1000 / n if cpu else None, 2)} | {_fmt(row['apiserver_cpu_s'])} "
                f"| {_fmt(row['cold_writes_per_object'], 2)} "
                f"| {_fmt(row['peak_rss_mib'] if impl != 'floor' else None, 0)} |")
        lines += ["", "| implementation | churn p50 ms | churn p99 ms | writes per change | CPU during churn s "
                  "| writes in idle |", "|---|---|---|---|---|---|"]
        for impl in impls:
            row = table.get((impl, n))
            if row is None or impl == "floor":
                continue
            idle_writes = row.get("idle_writes")
            lines.append(f"| {impl} | {_fmt(row.get('churn_p50_ms'), 0)} | {_fmt(row.get('churn_p99_ms'), 0)} "
                         f"| {_fmt(row.get('writes_per_change'), 2)} | {_fmt(row.get('churn_cpu_s'))} "
                         f"| {'-' if idle_writes is None else int(idle_writes)} |")
        ours, kopf, cr = table.get(("ours", n)), table.get(("kopf", n)), table.get(("controller-runtime", n))
        if ours:
            parts = [f"ours / floor cold start {_ratio(ours['cold_start_s'], floor.get('cold_start_s'))}"]
            if kopf:
                parts += [f"kopf / ours cold start {_ratio(kopf['cold_start_s'], ours['cold_start_s'])}",
                          f"CPU {_ratio(kopf['controller_cpu_s'], ours['controller_cpu_s'])}",
                          f"churn p99 {_ratio(kopf.get('churn_p99_ms'), ours.get('churn_p99_ms'))}",
                          f"peak RSS {_ratio(kopf['peak_rss_mib'], ours['peak_rss_mib'])}"]
            if cr:
                parts += [f"ours / controller-runtime CPU {_ratio(ours['controller_cpu_s'], cr['controller_cpu_s'])}",
                          f"cold start {_ratio(ours['cold_start_s'], cr['cold_start_s'])}"]
            lines += ["", "Ratios: " + "; ".join(parts) + ".", ""]
    samples = ", ".join(f"{r.impl} N={r.n} r{r.round} {r.cold_start_s:.1f}s" for r in runs)
    lines += [f"Cold start samples, in run order: {samples}.", ""]
    return "\n".join(lines)


BEGIN, END = "<!-- bench:runtime:begin -->", "<!-- bench:runtime:end -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="1000,5000", help="comma-separated N (default 1000,5000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--large-rounds", type=int, default=None,
                        help="rounds for every N after the first (default: --rounds)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="report the runs of an earlier --json file instead of measuring")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help=f"concurrent reconciles of every controller (default {DEFAULT_WORKERS})")
    parser.add_argument("--churn", type=int, default=500)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None, help="write the tables into this markdown file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    impls = [i for i in args.impls.split(",") if i]
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs, found = [Run(**r) for r in saved["runs"]], saved["versions"]
        conditions = saved.get("conditions", "Commit and load average not recorded.")
        args.workers = saved.get("workers", DEFAULT_WORKERS)
    else:
        before = os.getloadavg()
        runs, found = asyncio.run(run_all(sizes, args.rounds, impls, churn_count=args.churn, rate=args.rate,
                                          idle=args.idle, large_rounds=args.large_rounds, workers=args.workers,
                                          progress=args.json))
        conditions = record.conditions(before)
    text = report(runs, found, rounds=args.rounds, churn_count=args.churn, rate=args.rate, idle=args.idle,
                  conditions=conditions, workers=args.workers)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"versions": found, "conditions": conditions, "workers": args.workers,
                                         "runs": [asdict(r) for r in runs]}, indent=1))
    if args.doc:
        write_section(args.doc, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
