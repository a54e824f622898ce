"""Requests lost and the longest gap while an agent is disrupted under continuous load, on the local node.

Egress (1 and 2 replicas): a client pod sends an HTTP GET every 20 ms, a new connection each with
a 2 s deadline, through the target's Service to a site host behind a tailscaled subnet router.
Ingress (1 replica): a tailscaled laptop on the host sends the same to an https expose and a tcp
expose by the ingress's MagicDNS name; with 2 replicas behind a shared address, to that address.
Each disruption in turn (``e2e/disruption.py``): a rolling
update of the agent (``kubectl rollout restart``), one agent pod deleted, a pre-auth key rotation,
an operator restart, a Headscale restart. Then the agent's RSS (the node's /proc through the
pod's cgroups) idle and with 1,000 connections open through it. ``--doc`` writes the table into
docs/benchmarks.md between its markers, with the commit and the load average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.egress_incluster import pod_rss_kib
from benchmarks.record import commit, load_average, write_section
from e2e.cluster import (
    EXTERNAL_KUBECONFIG,
    ClusterUnderTest,
    KindCluster,
    get_json,
    install_operator_in_cluster,
    kubectl,
)
from e2e.disruption import (
    DEADLINE,
    DISRUPTIONS,
    INTERVAL,
    OLD_SHAPE,
    SETTLE,
    WARM,
    Load,
    Subject,
    disrupt,
    egress_world,
    ingress_world,
    old_shape,
    open_connections,
    schedulable_nodes,
)
from hack import image, versions
from hack.localenv import Environment, Headscale, wait_until

BEGIN, END = "<!-- bench:disruption:begin -->", "<!-- bench:disruption:end -->"
CONNECTIONS = 1000
PEER_LIMIT = 2 * CONNECTIONS
"""The agent's connections per peer while the RSS is measured (default 512): one pod opens them all."""
DRAIN = "node drained"
DRAIN_NOTE = ("node drain: not measured here. The local node is the only node: a drain cordons it and "
              "evicts the agent with nowhere to schedule its successor (and evicts the operator and "
              "CoreDNS with it), so it measures an outage of the whole cluster, not the agent's drain. "
              "It needs a second node: `python -m hack.kind run -- python -m benchmarks.disruption ...` "
              "measures it on kind.")


BASELINE_DISRUPTIONS = ("rollout", "pod deleted", DRAIN)
"""What the old shape is measured on: with the operator stopped, a key rotation or an operator
restart would not happen at all, and a Headscale restart does not involve the Deployment."""
BASELINE_RECOVERY = 60.0
"""Seconds a load gets to recover in the old shape before the row says it did not."""


def _rounds(subject: Subject, headscale: Headscale, load: Callable[[], Load], label: dict[str, Any],
            rounds: int, rows: list[dict[str, Any]], progress: Path | None, *,
            disruptions: tuple[str, ...] = tuple(DISRUPTIONS), recovery: float | None = None) -> None:
    for number in range(1, rounds + 1):
        for what in disruptions:
            row: dict[str, Any] = {"shape": "now", **label, "round": number, "disruption": what}
            try:
                outcome = disrupt(subject, headscale, what, load, recovery=recovery)
                row.update(streams={k: asdict(v) for k, v in outcome.streams.items()}, done_s=outcome.done_s,
                           named_s=outcome.named_s, recovered=outcome.recovered)
            except Exception as exc:  # one disruption's failure is reported; the others still run
                row["error"] = str(exc).splitlines()[0][:300]
                print(exc, flush=True)
            row["loadavg"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if progress:
                progress.parent.mkdir(parents=True, exist_ok=True)
                progress.write_text(json.dumps({"rows": rows}, indent=1))


SUBJECTS = ("egress", "ingress", "shared-ingress")
"""What a run measures: egress (1 and 2 replicas, the old shape, the RSS), ingress (1 replica by
MagicDNS name, the old shape), and an ingress of 2 replicas behind a shared address."""


def _cluster(env: Environment) -> tuple[ClusterUnderTest, str]:
    """The cluster to measure on and how the table names it (an open parenthesis the table goes on
    inside): the kind cluster of ``make e2e`` when its kubeconfig is given (``python -m hack.kind
    run``), else the local node."""
    if os.environ.get(EXTERNAL_KUBECONFIG):
        cluster: ClusterUnderTest = KindCluster.from_environment()
        nodes = get_json(cluster, "nodes")["items"]
        workers = sum(1 for n in nodes if "node-role.kubernetes.io/control-plane" not in n["metadata"]["labels"])
        return cluster, f"A kind cluster on this machine ({len(nodes)} nodes, {workers} of them workers"
    return env.cluster(), "The local node (one node"


def run(rounds: int, progress: Path | None, subjects: tuple[str, ...] = SUBJECTS,
        disruptions: tuple[str, ...] = tuple(DISRUPTIONS)) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    rss: dict[str, Any] = {}
    with Environment() as env:
        cluster, where = _cluster(env)
        if DRAIN in disruptions and len(schedulable_nodes(cluster)) < 2:
            disruptions = tuple(d for d in disruptions if d != DRAIN)  # the note says why
        project = image.project_image()
        cluster.load_image(project)
        headscale = env.headscale("bench-headscale", address=cluster.host_address)
        ns = install_operator_in_cluster(cluster, project.ref, env.root / "install")
        world = World(cluster, ns, headscale, project.ref, env, rounds, rows, progress, disruptions)
        if "egress" in subjects:
            rss = _egress(world)
        if "ingress" in subjects:
            _ingress(world, shared=False)
        if "shared-ingress" in subjects:
            _ingress(world, shared=True)
    return {"date": dt.date.today().isoformat(), "commit": commit(), "rounds": rounds, "subjects": list(subjects),
            "where": where, "disruptions": list(disruptions),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rss": rss, "rows": rows}


@dataclass(frozen=True)
class World:
    """What every measured subject shares: the cluster, the operator, Headscale, the run's settings."""

    cluster: ClusterUnderTest
    namespace: str
    headscale: Headscale
    image: str
    env: Environment
    rounds: int
    rows: list[dict[str, Any]]
    progress: Path | None
    disruptions: tuple[str, ...]

    def rounds_of(self, subject: Subject, load: Callable[[], Load], label: dict[str, Any], *,
                  baseline: bool = False) -> None:
        """Every disruption of the run (the old shape's: those of :data:`BASELINE_DISRUPTIONS`)."""
        disruptions = tuple(d for d in self.disruptions if not baseline or d in BASELINE_DISRUPTIONS)
        _rounds(subject, self.headscale, load, label, self.rounds, self.rows, self.progress,
                disruptions=disruptions, recovery=BASELINE_RECOVERY if baseline else None)


def _egress(world: World) -> dict[str, Any]:
    rss: dict[str, Any] = {}
    cluster, ns, env = world.cluster, world.namespace, world.env
    with egress_world(cluster, ns, world.headscale, world.image, env.site_host, env.tailscale_node) as egress:
        # One client pod opens every connection: the agent's per-peer limit is raised for it.
        kubectl(cluster, "-n", ns, "set", "env", f"deployment/{egress.subject.deployment}", "-c", "agent",
                f"TAILNET_MAX_CONNECTIONS_PER_PEER={PEER_LIMIT}")
        wait_until(lambda: len(egress.subject.pods()) == 1 and egress.subject.settled(), timeout=240,
                   what="the agent rolled out with the raised per-peer limit")
        (pod,) = egress.subject.pods()
        rss["per_peer_limit"] = PEER_LIMIT
        uid = pod["metadata"]["uid"]
        rss["limits"] = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
        rss["idle_kib"] = pod_rss_kib(uid)
        with open_connections(egress, CONNECTIONS) as opened:
            rss["connections"] = opened
            rss["open_kib"] = pod_rss_kib(uid)
        rss["after_kib"] = pod_rss_kib(uid)
        rss["restarts"] = sum(c["restartCount"] for c in get_json(
            cluster, "-n", ns, "pod", pod["metadata"]["name"])["status"]["containerStatuses"])
        print(json.dumps({"rss": rss}), flush=True)
        for replicas in (1, 2):
            egress.scale(replicas)
            world.rounds_of(egress.subject, egress.load, {"subject": "egress", "replicas": replicas})
        egress.scale(1)
        with old_shape(egress.subject) as before:
            world.rounds_of(before, egress.load, {"subject": "egress", "replicas": 1, "shape": "before"},
                            baseline=True)
    return rss


def _ingress(world: World, *, shared: bool) -> None:
    """One replica by MagicDNS name (and the old shape), or two behind a shared address."""
    replicas = 2 if shared else 1
    try:
        with ingress_world(world.cluster, world.namespace, world.headscale, world.image,
                           world.env.root / f"ingress-{replicas}", world.env.tailscale_node, shared=shared) as ingress:
            world.rounds_of(ingress.subject, ingress.load, {"subject": "ingress", "replicas": replicas})
            if not shared:
                with old_shape(ingress.subject) as before:
                    world.rounds_of(before, ingress.load_by_address, {"subject": "ingress", "replicas": 1,
                                                                      "shape": "before"},
                                    baseline=True)
    except (TimeoutError, RuntimeError) as exc:
        print(f"the ingress did not come up: {exc}", flush=True)  # with its diagnosis
        world.rows.append({"subject": "ingress", "replicas": replicas, "round": 0, "disruption": "setup",
                           "error": str(exc).splitlines()[0][:300]})


def _order(key: tuple[str, str, int, str, str]) -> tuple[int, str, int, int, str]:
    """Rows grouped by agent and replicas, the two shapes of a disruption next to each other."""
    subject, shape, replicas, what, stream = key
    position = list(DISRUPTIONS).index(what) if what in DISRUPTIONS else len(DISRUPTIONS)
    return (0 if subject == "egress" else 1, "", replicas, position * 2 + (shape != "before"), stream)


def _cell(values: list[str]) -> str:
    return " / ".join(values) if values else "-"


def table(doc: dict[str, Any]) -> str:
    keys: dict[tuple[str, str, int, str, str], list[dict[str, Any]]] = {}
    errors: list[str] = []
    for row in doc["rows"]:
        if "error" in row:
            errors.append(f"{row['subject']} ({row.get('shape', 'now')}) x{row['replicas']} {row['disruption']} "
                          f"round {row['round']}: {row['error']}")
            continue
        shape = row.get("shape", "now")
        for stream, t in row["streams"].items():
            keys.setdefault((row["subject"], shape, row["replicas"], row["disruption"], stream), []).append(
                {**t, "done_s": row["done_s"], "named_s": row.get("named_s"), "recovered": row.get("recovered", True),
                 "round": row["round"]})
    lines = ["| agent | shape | replicas | disruption | requests | sent | lost | longest gap s | disruption done s "
             "| name back s |", "|---|---|---|---|---|---|---|---|---|---|"]
    how: list[str] = []
    for (subject, shape, replicas, what, stream), runs in sorted(keys.items(), key=lambda kv: _order(kv[0])):
        how += [f"{subject} x{replicas} {what} {stream} (round {r['round']}): "
                + ", ".join(f"{count} {cause}" for cause, count in sorted(r["how"].items()))
                for r in runs if r.get("how")]
        named = [format(r["named_s"], ".0f") for r in runs if r["named_s"] is not None]
        lost = [f"{r['lost']}{'' if r['recovered'] else '*'}" for r in runs]
        lines.append(f"| {subject} | {shape} | {replicas} | {what} | {stream} | "
                     f"{_cell([str(r['sent']) for r in runs])} | {_cell(lost)} | "
                     f"{_cell([format(r['longest_gap_s'], '.2f') for r in runs])} | "
                     f"{_cell([format(r['done_s'], '.0f') for r in runs])} | {_cell(named)} |")
    # A drain left out of a run on one node is explained; one left out elsewhere was not asked for.
    drained = DRAIN in doc.get("disruptions", ()) or not str(doc.get("where", "The local node")).startswith(
        "The local node")
    if not drained:
        for subject in sorted({k[0] for k in keys}):
            lines.append(f"| {subject} | - | - | node drain | not measurable on one node (below) | - | - | - | - | - |")
    measured = [r for r in (doc["rss"] if isinstance(doc["rss"], list) else [doc["rss"]]) if r]
    during = [row["loadavg"] for row in doc["rows"] if "loadavg" in row]
    if "loadavg_before" in doc:
        load_text = load_average(doc["loadavg_before"], doc["loadavg_after"])
    else:
        load_text = "Load average not recorded at the start and end"
    if during:
        load_text += f"; 1 min load average after each disruption {min(during):.1f}-{max(during):.1f}"
    text = [
        f"### Agent disruptions under load, {doc['date']}, commit {doc['commit']}", "",
        f"{doc.get('where', 'The local node (one node')}, kube-apiserver {versions.KUBERNETES}), "
        f"Headscale {versions.HEADSCALE} and "
        f"tailscaled {versions.TAILSCALE} on this machine; {doc['rounds']} round(s), the figures of each round "
        f"separated by `/`. {load_text}. "
        f"Egress: a client pod sends an HTTP GET every {INTERVAL * 1000:.0f} ms, a new connection each with "
        f"a {DEADLINE:.0f} s deadline, through the target's Service to a site host behind a tailscaled subnet "
        "router. Ingress: a tailscaled laptop on the host sends the same to an https expose and a tcp expose "
        "by the ingress's MagicDNS name (`requests` names the stream); with 2 replicas, to the address they "
        "share (`spec.sharedAddress`, the laptop accepting routes). A request is lost when it fails or "
        f"answers past the deadline. Each load starts {WARM} successes in a row before the disruption and stops "
        f"{SETTLE} successes in a row after the disruption's conditions are met (rollout: every old pod gone; "
        "pod deleted: its successor ready; node drained: the agent pods of the drained node replaced "
        "elsewhere, the node uncordoned after; key rotation: the CR reports the new key; operator restart: "
        "the new operator pods alone; Headscale restart: healthy); the longest gap is between two "
        "successful answers. `now`: this commit's defaults (surge, preStop 10 s, drain 30 s, the ingress "
        f"name handed over once the new pod is ready). `before`: the shape before them ({OLD_SHAPE}), "
        "reproduced with the operator stopped and the agent Deployment patched (`e2e/disruption.py` "
        "`old_shape`; the agent's readiness warm-up and logout stay this commit's), on a rollout, a "
        "deleted pod and a node drain; a load that did not recover within "
        f"{BASELINE_RECOVERY:.0f} s is marked `*` (its lost requests are those until then). With the "
        "operator stopped nothing hands the ingress's name "
        "to a new node, so the ingress's `before` load goes to the address of the node the agent runs as "
        "when the load starts, as a client that looked the name up before the disruption; a new pod is a "
        "new node with another address (before the fixes its name was suffixed, `HostnameTaken`).", "",
        *lines,
    ]
    if not drained:
        text += ["", DRAIN_NOTE]
    if how:
        text += ["", "How the lost requests failed (`hung`: no answer within the deadline; "
                 "`ConnectionError`: for the ingress, the laptop's CONNECT refused, as when no node carries "
                 "the name; other errors by their type, as the client saw them; `wrong answer`: the "
                 "connection ended before the whole answer; `late`: answered past the deadline): "
                 + "; ".join(how) + "."]
    if measured:
        limit = measured[0].get("limits", {}).get("memory", "none")
        text += ["", (
            f"Agent RSS (egress, 1 replica, memory limit {limit}; each round separated by `/`): "
            f"{_cell([format(r['idle_kib'] / 1024, '.1f') for r in measured])} MiB idle, "
            f"{_cell([format(r['open_kib'] / 1024, '.1f') for r in measured])} MiB with "
            f"{_cell([format(r['connections'], ',') for r in measured])} connections open through it from one "
            f"client pod (each echoed once; the per-peer limit raised to {measured[0].get('per_peer_limit', 'none')} "
            "for it, the other limits at their defaults), "
            f"{_cell([format(r['after_kib'] / 1024, '.1f') for r in measured])} MiB just after they closed; "
            f"container restarts {_cell([str(r['restarts']) for r in measured])}.")]
    if doc.get("note"):
        text += ["", doc["note"]]
    if errors:
        text += ["", "Disruptions that did not complete: " + "; ".join(errors) + "."]
    return "\n".join(text) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every disruption (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--from-json", type=Path, default=None, help="report an earlier --json instead")
    parser.add_argument("--doc", type=Path, default=None, help="write the table into this markdown file")
    parser.add_argument("--disruptions", default=",".join(DISRUPTIONS),
                        help=f"which disruptions, of {', '.join(DISRUPTIONS)} (default all; a node drain only "
                             "where a second node can take the agent)")
    parser.add_argument("--subjects", default=",".join(SUBJECTS),
                        help=f"what to measure, of {', '.join(SUBJECTS)} (default all); a run of some is "
                             "written into its own section of the doc")
    parser.add_argument("--section", default=None,
                        help="the doc's section markers (bench:NAME) to write, instead of the one the subjects name")
    args = parser.parse_args(argv)
    subjects = tuple(s for s in args.subjects.split(",") if s)
    if unknown := [s for s in subjects if s not in SUBJECTS]:
        parser.error(f"unknown subjects {unknown}; choose from {', '.join(SUBJECTS)}")
    disruptions = tuple(d for d in args.disruptions.split(",") if d)
    if unknown := [d for d in disruptions if d not in DISRUPTIONS]:
        parser.error(f"unknown disruptions {unknown}; choose from {', '.join(DISRUPTIONS)}")
    started = time.monotonic()
    doc = json.loads(args.from_json.read_text()) if args.from_json else run(args.rounds, args.json, subjects,
                                                                            disruptions)
    text = table(doc)
    print(text)
    if args.json and not args.from_json:
        doc["wall_s"] = round(time.monotonic() - started)
        args.json.write_text(json.dumps(doc, indent=1))
    if args.doc:
        chosen = tuple(doc.get("subjects") or SUBJECTS)
        name = "disruption-kind" if str(doc.get("where", "")).startswith("A kind") else "disruption"
        if chosen != SUBJECTS:
            name += ":" + "+".join(chosen)
        name = args.section or name
        begin, end = (BEGIN, END) if name == "disruption" else (f"<!-- bench:{name}:begin -->",
                                                                 f"<!-- bench:{name}:end -->")
        write_section(args.doc, begin, end, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
