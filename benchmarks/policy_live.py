"""One CR change to the live Headscale policy, at scale: a Tailnet in Apply mode with a base of
``--rules`` rules, ``--egresses`` TailnetEgresses and ``--sites`` TailnetSites, against a real
kube-apiserver and Headscale on 127.0.0.1, the operator's Tailnet and Policy controllers in this process.

After the first render is applied, each of ``--changes`` TailnetEgresses in turn gets a new
port; the time is from that write to Headscale's policy holding the port (polled every 50 ms).

``python -m benchmarks.policy_live --json _artifacts/bench-policy-live.json``
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from statistics import median
from typing import Any

from prometheus_client import CollectorRegistry

from e2e.operator import create_bootstrap_secret, tailnet_object
from hack import versions
from hack.crds import install_crds, load_samples
from hack.localenv import Environment
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS, TAILNET_SITE
from tailnet_operator.controllers.setup import setup
from tailnet_operator.headscale import HeadscaleClient
from tailnet_operator.logs import configure
from tailnet_operator.names import OPERATOR
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.runtime.kinds import CONFIG_MAP, NAMESPACE
from tailnet_operator.runtime.manager import Manager, ManagerOptions

from .policy import base_policy
from .record import conditions, write_section
from .runtime.harness import bounded

OPERATOR_NAMESPACE = "tailnet-system"
BEGIN, END = "<!-- bench:policy-live:begin -->", "<!-- bench:policy-live:end -->"
REGISTRY = CollectorRegistry()


def reconcile_seconds() -> tuple[float, float]:
    """(sum of seconds, count) of the Policy controller's reconciles so far."""
    labels = {"controller": "policy"}
    return (REGISTRY.get_sample_value("controller_runtime_reconcile_time_seconds_sum", labels) or 0.0,
            REGISTRY.get_sample_value("controller_runtime_reconcile_time_seconds_count", labels) or 0.0)


async def wait_for(check: Any, *, timeout: float, what: str, interval: float = 0.01) -> float:
    """Poll ``check`` until true; the monotonic time it first was. TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(interval)


@asynccontextmanager
async def policy_controllers(kubeconfig: Path) -> AsyncIterator[Manager]:
    """The operator's Tailnet and Policy controllers (the Egress and DNS ones would keep
    Headscale busy with 1,000 agents that never start here), in this process."""
    manager = Manager(rest_config.load(kubeconfig), ManagerOptions(field_manager=OPERATOR, graceful_shutdown_timeout=5),
                      registry=REGISTRY)
    setup(manager, namespace=OPERATOR_NAMESPACE, events=EventRecorder(manager.client, reporting_controller=OPERATOR,
                                                                    reporting_instance="bench"))
    manager.controllers = [c for c in manager.controllers if c.name in ("tailnet", "policy")]
    task = asyncio.create_task(manager.run())
    try:
        yield manager
    finally:
        manager.stop()
        await asyncio.gather(task, return_exceptions=True)


async def run(rules: int, n_egresses: int, n_sites: int, changes: int) -> dict[str, Any]:
    samples = {s["kind"]: s for s in load_samples()}
    with Environment() as env:
        plane = env.control_plane()
        await asyncio.to_thread(install_crds, plane.api_client())
        headscale = env.headscale()
        async with Client(rest_config.load(plane.kubeconfig), field_manager="bench") as admin, \
                HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hs:
            await admin.create(NAMESPACE, {"metadata": {"name": OPERATOR_NAMESPACE}})
            await create_bootstrap_secret(admin, OPERATOR_NAMESPACE, "bootstrap", headscale.api_key)
            await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": OPERATOR_NAMESPACE},
                                           "data": {"policy.hujson": base_policy(rules)}})

            def egress(i: int, port: int = 5432) -> dict[str, Any]:
                body = copy.deepcopy(samples["TailnetEgress"])
                body["metadata"] = {"name": f"e{i:04d}", "namespace": OPERATOR_NAMESPACE}
                body["spec"]["tailnetRef"] = {"name": "bench"}
                body["spec"]["tag"] = f"tag:egress-e{i:04d}"
                body["spec"]["targets"][0]["address"] = f"192.168.{i // 256 % 256}.{i % 256}"
                body["spec"]["targets"][0]["ports"][0]["port"] = port
                return body

            def site(i: int) -> dict[str, Any]:
                body = copy.deepcopy(samples["TailnetSite"])
                body["metadata"] = {"name": f"s{i:04d}"}
                body["spec"] = {"tailnetRef": {"name": "bench"}, "routes": [f"172.{16 + i // 256}.{i % 256}.0/24"],
                                "routerTag": f"tag:site-s{i:04d}"}
                return body

            await bounded(16, [lambda i=i: admin.create(TAILNET_EGRESS, egress(i)) for i in range(n_egresses)])  # type: ignore[misc]
            await bounded(16, [lambda i=i: admin.create(TAILNET_SITE, site(i)) for i in range(n_sites)])  # type: ignore[misc]
            await admin.create(TAILNET, tailnet_object("bench", headscale, OPERATOR_NAMESPACE, policy={
                "baseConfigMapRef": {"namespace": OPERATOR_NAMESPACE, "name": "base", "key": "policy.hujson"},
                "mode": "Apply"}))

            async with policy_controllers(plane.kubeconfig) as operator:
                start = time.monotonic()

                async def applied() -> bool:
                    text, _ = await hs.get_policy()
                    return f"tag:egress-e{n_egresses - 1:04d}" in text

                first = await wait_for(applied, timeout=600, what="the first render applied", interval=0.2) - start
                latencies: list[float] = []
                before = reconcile_seconds()
                for i in range(changes):
                    port = 20000 + i
                    sent = time.monotonic()
                    await admin.merge_patch(TAILNET_EGRESS, f"e{i:04d}", {"spec": {"targets": [
                        egress(i, port)["spec"]["targets"][0], egress(i)["spec"]["targets"][1]]}},
                        OPERATOR_NAMESPACE)

                    async def has_port(port: int = port) -> bool:
                        text, _ = await hs.get_policy()
                        return f"tcp:{port}" in text

                    latencies.append(await wait_for(has_port, timeout=60, what=f"port {port} in the policy",
                                                    interval=0.05) - sent)
                    print(f"change {i}: {latencies[-1] * 1000:.0f} ms", flush=True)
                del operator
                after = reconcile_seconds()
    reconciles = after[1] - before[1]
    return {"first_apply_s": first, "reconciles": reconciles,
            "reconcile_mean_ms": (after[0] - before[0]) / reconciles * 1000 if reconciles else float("nan"),
            "change_ms": [x * 1000 for x in latencies],
            "change_p50_ms": median(latencies) * 1000, "change_max_ms": max(latencies) * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rules", type=int, default=2000)
    parser.add_argument("--egresses", type=int, default=1000)
    parser.add_argument("--sites", type=int, default=200)
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None)
    args = parser.parse_args(argv)
    configure(level=os.environ.get("BENCH_LOG_LEVEL", "warning"))
    before = os.getloadavg()
    result = asyncio.run(run(args.rules, args.egresses, args.sites, args.changes))
    measured = conditions(before)
    print(json.dumps(result, indent=1))
    if args.doc:
        samples = ", ".join(f"{x:.0f}" for x in result["change_ms"])
        write_section(args.doc, BEGIN, END, "\n".join([
            f"### One CR change to Headscale, {dt.date.today().isoformat()}", "",
            f"{measured} Headscale {versions.HEADSCALE} and kube-apiserver {versions.KUBERNETES} on 127.0.0.1, "
            "the Tailnet and "
            f"Policy controllers in the benchmark's process; a Tailnet in Apply mode with the {args.rules:,}-rule "
            "base, "
            f"{args.egresses:,} TailnetEgresses and {args.sites:,} TailnetSites. First render applied "
            f"{result['first_apply_s']:.1f} s after the operator started. Then {args.changes} TailnetEgresses in "
            f"turn get a new port: from the write to Headscale's policy holding it (polled every 50 ms), "
            f"p50 {result['change_p50_ms']:.0f} ms, max {result['change_max_ms']:.0f} ms (samples: {samples} ms). "
            f"The Policy controller ran {result['reconciles']:.0f} reconciles meanwhile, "
            f"{result['reconcile_mean_ms']:.0f} ms each on average (Headscale's list, read, check and write of "
            "the policy included).",
            ""]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
