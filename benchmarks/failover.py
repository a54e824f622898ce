"""Operator failover: how long a Tailnet change waits when the leading replica goes.

The chart installed with its defaults (2 replicas, the Lease ``tailnet-operator``) on the local
node, a Tailnet Ready; then, in each round, the leader goes and the Tailnet's spec is changed at
once. The clock starts at the kill and stops twice: when another holder has the Lease, and when the
Tailnet's status carries the new ``observedGeneration`` with Ready=True. Two ways to go: a crash
(SIGKILL of the manager's container through containerd; the Lease is not released and must
expire) and a pod deletion with its grace period (the kubelet sends SIGTERM; the manager releases
the Lease). Each round waits for both replicas Ready again before it starts.

    python -m benchmarks.failover [--rounds 3] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.record import commit, load_average, publish
from e2e.cluster import ClusterUnderTest, apply_tailnet, get_json, kubectl, wait_available
from e2e.helm_release import (
    DEPLOYMENT,
    LEASE,
    NAMESPACE,
    crash_manager,
    get_tailnet,
    holder_other_than,
    holder_pod,
    installed_release,
    is_reconciled,
    lease_holder,
    ready_release_pods,
)
from hack import image, versions
from hack.localenv import Environment, wait_until

WAYS = {"crash": "SIGKILL of the manager's container (containerd), the Lease not released",
        "delete": "`kubectl delete pod` with its grace period (SIGTERM; the manager releases the Lease)"}
BOUND = 60.0
"""Seconds a failover may take before the run fails (four lease durations of the defaults)."""


def both_ready(cluster: ClusterUnderTest) -> str:
    """The Lease holder once both replicas are Ready and it is one of them."""
    ready = ready_release_pods(cluster)
    holder = lease_holder(cluster)
    if len(ready) == 2 and holder and any(holder.startswith(f"{p}_") for p in ready):
        return holder
    return ""


def one_failover(cluster: ClusterUnderTest, tailnet: str, way: str, round_: int) -> dict[str, Any]:
    holder = wait_until(lambda: both_ready(cluster), timeout=180, interval=0.5, what="both replicas Ready")
    leader = holder_pod(cluster, holder)
    started = time.monotonic()
    if way == "crash":
        crash_manager(cluster, leader)
    else:
        kubectl(cluster, "-n", NAMESPACE, "delete", "pod", leader, "--wait=false")
    kubectl(cluster, "patch", "tailnets.tailnet.dev", tailnet, "--type=merge",
            "-p", json.dumps({"spec": {"apiKeyLifetime": f"{2 + round_}h"}}))
    generation = get_tailnet(cluster, tailnet)["metadata"]["generation"]
    new_holder = wait_until(lambda: holder_other_than(cluster, holder), timeout=BOUND, interval=0.05,
                            what="another holder of the Lease")
    lease_s = time.monotonic() - started
    wait_until(lambda: is_reconciled(cluster, tailnet, generation), timeout=BOUND, interval=0.05,
               what="the change reconciled")
    return {"way": way, "round": round_, "lease_s": round(lease_s, 2),
            "reconciled_s": round(time.monotonic() - started, 2),
            "taken_by": "the standby" if not new_holder.startswith(f"{leader}_") else "the restarted leader"}


def run(rounds: int) -> dict[str, Any]:
    with Environment() as env:
        cluster = env.cluster()
        project = image.project_image()
        cluster.load_image(project)
        headscale = env.headscale("bench-headscale", address=cluster.host_address)
        with installed_release(cluster, project.ref):
            wait_available(cluster, NAMESPACE, DEPLOYMENT, timeout=240)
            tailnet, _ = apply_tailnet(cluster, headscale, NAMESPACE, "bench-failover")
            wait_until(lambda: is_reconciled(cluster, tailnet, get_tailnet(cluster, tailnet)["metadata"]["generation"]),
                       timeout=180, what="the Tailnet Ready")
            lease = get_json(cluster, "-n", NAMESPACE, "lease", LEASE)["spec"]
            samples = [one_failover(cluster, tailnet, way, n * len(WAYS) + i)
                       for n in range(rounds) for i, way in enumerate(WAYS)]
            kubectl(cluster, "delete", "tailnets.tailnet.dev", tailnet, "--wait=true", "--timeout=60s", check=False)
    return {"lease_duration_s": lease.get("leaseDurationSeconds"), "samples": samples, "rounds": rounds}


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run."""
    lines = [
        f"## Operator failover, {doc['date']}, commit {doc['commit']} (Helm chart defaults, local node, "
        f"Kubernetes {doc['kubernetes']})", "",
        "`benchmarks/failover.py`: `helm install` with the defaults (2 replicas, Lease `tailnet-operator` "
        f"with a lease duration of {doc['lease_duration_s']} s), a Tailnet Ready; in each round the leader goes "
        "and the Tailnet's spec is changed at once; the clock stops when another holder has the Lease and "
        "when the Tailnet's status carries the new `observedGeneration` with Ready=True. Both replicas are "
        f"Ready again before each round; the ways alternate. {doc['rounds']} rounds of each. "
        f"{load_average(doc['loadavg_before'], doc['loadavg_after'])}.", "",
        "| how the leader went | Lease taken, median s | change reconciled, median s | samples (Lease / reconciled, s) "
        "| taken by |", "|---|---|---|---|---|"]
    for way, label in WAYS.items():
        mine = [s for s in doc["samples"] if s["way"] == way]
        if not mine:
            continue
        takers = ", ".join(sorted({s["taken_by"] for s in mine}))
        pairs = ", ".join(f"{s['lease_s']:.1f} / {s['reconciled_s']:.1f}" for s in mine)
        lines.append(f"| {label} | {statistics.median(s['lease_s'] for s in mine):.1f} | "
                     f"{statistics.median(s['reconciled_s'] for s in mine):.1f} | {pairs} | {takers} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="failovers of each way (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    before = os.getloadavg()
    doc = run(args.rounds)
    doc |= {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "kubernetes": versions.KUBERNETES,
            "loadavg_before": before, "loadavg_after": os.getloadavg()}
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc, name="failover")
    return 0


if __name__ == "__main__":
    sys.exit(main())
