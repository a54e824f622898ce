"""In-cluster egress benchmark: the agent against the tailscaled egress pods users run, on the local node.

Path: a client pod -> (the TailnetEgress target's Service -> the agent pod | a tailscaled pod in
userspace networking, dialled through its SOCKS5 proxy Service | a kernel-mode tailscaled pod
behind its Service) -> the tailnet (to a tailscaled subnet router on the node) -> a sink/source
server on a site host in a network namespace. The userspace pod is what a user builds by hand:
the static tailscaled of the pinned version in a scratch image, ``--tun=userspace-networking
--socks5-server``, joined with a config file. The kernel-mode pod is the shape of the Tailscale
operator's egress proxy (:mod:`benchmarks.kernel_proxy`): the same tailscaled on a TUN device
with ``NET_ADMIN``, the client's connections DNATed to the target and SNATed into the tunnel by
the rules containerboot sets. Both tailscaled pods get the agent pod's resources (read back from
every pod, the run stops if they differ) and a GOMEMLIMIT at 90% of the memory limit. Each path's
tailnet hop is checked direct at both ends (the pod's side and the router's) before and after its
measurements.

Measured in one run: one stream and 8 parallel streams (MB/s, upload and download) in rounds that
take both paths in turn (medians reported), connection setup (connect plus one byte echoed, p50
and p99), the time from creating the TailnetEgress to the first byte echoed through it (the client
polls the target's Service name through the cluster's DNS, whose cache holds a miss for up to
5 s), and the RSS of each egress pod's processes. The client runs ``benchmarks/paths.py`` inside
its pod; the server runs the same file on the site host.

    python -m benchmarks.egress_incluster [--mib 32] [--rounds 3] [--setups 200] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks import kernel_proxy, pathcheck
from benchmarks.paths import COLUMNS, PathResult
from benchmarks.record import commit, load_average, publish
from e2e.cluster import (
    OPEN_BASE,
    SLEEPER,
    ClusterUnderTest,
    PythonSession,
    apply,
    condition,
    exec_python,
    get_json,
    install_operator_in_cluster,
    kubectl,
    python_pod,
    wait_available,
    wait_pod_running,
)
from e2e.operator import tailnet_object
from hack import image, versions
from hack.localenv import Environment, Headscale, wait_until
from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract.endpoints import HEALTH_PORT

PATHS_SOURCE = Path(__file__).with_name("paths.py")
SERVER_PORT = 9000
SOCKS_PORT = 1080
AGENT = "agent (TailnetEgress)"
TAILSCALED = "tailscaled userspace pod (SOCKS5)"
KERNEL = "tailscaled kernel-mode pod (TUN, DNAT)"
TAILSCALED_HOSTNAME = "bench-tailscaled"
KERNEL_HOSTNAME = "bench-tailscaled-kernel"
PROXY_NAMESPACE = "bench-proxies"
"""The kernel-mode pod's namespace: it needs the ``privileged`` Pod Security level (TUN device, NET_ADMIN)."""
TAILSCALED_SOCKET = "/state/tailscaled.sock"
EGRESS_TAG = "tag:bench-egress"
ROUTER_TAG = "tag:bench-site"

FIRST_BYTE = """
import socket, sys, time
sys.stdin.readline()
while True:
    try:
        with socket.create_connection(({host!r}, {port}), timeout=2) as conn:
            conn.sendall(b"E*")
            if conn.recv(1) == b"*":
                break
    except OSError:
        time.sleep(0.02)
print(time.time(), flush=True)
"""


def in_pod(cluster: ClusterUnderTest, ns: str, pod: str, *args: str, timeout: float = 600) -> str:
    """``benchmarks/paths.py`` run inside ``pod`` with ``args`` (the file goes in on stdin)."""
    return kubectl(cluster, "-n", ns, "exec", "-i", pod, "--", "python3", "-", *args,
                   stdin=PATHS_SOURCE.read_text(), timeout=timeout)


def pod_rss_kib(pod_uid: str) -> int:
    """RSS of the pod's processes (the sandbox's pause excluded), from the node's cgroups. Under
    cgroup v1 a process is listed once per controller hierarchy, so each PID counts once."""
    marker = pod_uid.replace("-", "_")
    pids = {pid for procs in Path("/sys/fs/cgroup").rglob("cgroup.procs")
            if pod_uid in str(procs) or marker in str(procs) for pid in procs.read_text().split()}
    total = 0
    for pid in pids:
        proc = Path("/proc") / pid
        try:
            if proc.joinpath("comm").read_text().strip() == "pause":
                continue
            for line in proc.joinpath("status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _since(start: str, moment: str | None) -> float | None:
    """Seconds from one RFC 3339 timestamp to another (None when the second is unknown)."""
    if not moment:
        return None
    return _epoch(moment) - _epoch(start)


def _epoch(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


def milestones(cluster: ClusterUnderTest, ns: str, pod: dict[str, Any]) -> dict[str, float | None]:
    """When the egress's objects appeared, in seconds after the CR was created (1 s resolution):
    where the time to the first byte goes."""
    egress = get_json(cluster, "-n", ns, "tailnetegresses.tailnet.dev", "bench")
    created = egress["metadata"]["creationTimestamp"]
    secret = get_json(cluster, "-n", ns, "secret", "bench-auth-key")
    service = get_json(cluster, "-n", ns, "service", "bench-site")
    statuses = pod["status"].get("containerStatuses") or [{}]
    started = ((statuses[0].get("state") or {}).get("running") or {}).get("startedAt")
    ready = next((c.get("lastTransitionTime") for c in pod["status"].get("conditions") or []
                  if c["type"] == "Ready"), None)
    return {"pre_auth_key_secret": _since(created, secret["metadata"]["creationTimestamp"]),
            "target_service": _since(created, service["metadata"]["creationTimestamp"]),
            "agent_pod_created": _since(created, pod["metadata"]["creationTimestamp"]),
            "agent_container_started": _since(created, started),
            "agent_pod_ready": _since(created, ready)}


def go_memory_limit(resources: dict[str, Any]) -> str | None:
    """GOMEMLIMIT for a container with ``resources``: 90% of its memory limit (Go's GC then works
    to stay under the limit, as a user who sets one would want), or none without a limit."""
    limit = resources.get("limits", {}).get("memory")
    if limit is None:
        return None
    units = {"Ki": 1, "Mi": 1024, "Gi": 1024 * 1024}
    number, unit = limit[:-2], limit[-2:]
    if unit not in units or not number.isdigit():
        raise ValueError(f"memory limit {limit!r}: expected a whole number of Ki, Mi or Gi")
    return f"{int(number) * units[unit] * 9 // 10}KiB"


def tailscaled_objects(ns: str, ref: str, headscale: Headscale, authkey: str,
                       resources: dict[str, Any]) -> list[dict[str, Any]]:
    """A tailscaled egress pod built by hand: config file, CA, Deployment, SOCKS5 Service. It gets
    the agent pod's ``resources`` and a GOMEMLIMIT under their memory limit."""
    security = {"runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"}}
    return kernel_proxy.tailscaled_pod(
        ns, TAILSCALED_HOSTNAME, ref, headscale, authkey, resources, go_memory_limit(resources),
        port=(SOCKS_PORT, "socks5"), security=security,
        args=["--tun=userspace-networking", f"--socks5-server=0.0.0.0:{SOCKS_PORT}", "--statedir=/state",
              f"--socket={TAILSCALED_SOCKET}", "--port=0"])


@dataclass(frozen=True)
class PodTailscaled:
    """The tailscaled in a tailscaled pod (userspace or kernel mode), its status read through its CLI."""

    cluster: ClusterUnderTest
    namespace: str
    pod: str
    hostname: str = TAILSCALED_HOSTNAME

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(kubectl(self.cluster, "-n", self.namespace, "exec", self.pod, "--",
                                                    "/tailscale", f"--socket={TAILSCALED_SOCKET}", "status",
                                                    "--json"))
        return status

    def peers(self) -> list[dict[str, Any]]:
        return list((self.status().get("Peer") or {}).values())

    def ipv4(self) -> str:
        return str(next(ip for ip in self.status()["Self"]["TailscaleIPs"] if "." in ip))


AGENT_METRICS = f"""
import urllib.request
print(urllib.request.urlopen("http://127.0.0.1:{HEALTH_PORT}/metrics", timeout=5).read().decode())
"""


def agent_hostname(pod: dict[str, Any]) -> str:
    """The tailnet hostname the operator gave the agent pod."""
    env = pod["spec"]["containers"][0]["env"]
    return str(next(e["value"] for e in env if e["name"] == env_names.HOSTNAME))


def direct_check(cluster: ClusterUnderTest, pod: dict[str, Any], router: pathcheck.Peers,
                 tailscaled: str | None = None) -> Callable[[], str]:
    """Both ends of the row's tailnet hop are direct: the pod (an agent's UDP counters going both
    ways, or, for a pod whose tailscaled has the hostname ``tailscaled``, its entry for ``router``)
    and ``router``'s entry for it. ``router`` is the tailnet node at the far end: the site's router,
    or the tailnet client of an ingress."""
    ns, pod_name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    if tailscaled is None:
        hostname = agent_hostname(pod)

        def agent() -> str:
            udp = pathcheck.udp_counters(exec_python(cluster, ns, pod_name, AGENT_METRICS))
            if not (udp.packets_out and udp.packets_in):
                raise pathcheck.PathNotAsClaimed(f"{hostname}: the row claims direct, its UDP counters are "
                                                 f"{udp.packets_out:.0f} out, {udp.packets_in:.0f} in")
            theirs = pathcheck.require(pathcheck.DIRECT, pathcheck.peer_path(router, hostname), router.hostname)
            return f"{hostname}: UDP {udp.packets_out:.0f} out, {udp.packets_in:.0f} in; {router.hostname}: {theirs}"

        return agent
    node = PodTailscaled(cluster, ns, pod_name, hostname=tailscaled)

    def pod_tailscaled() -> str:
        mine = pathcheck.require(pathcheck.DIRECT, pathcheck.peer_path(node, router.hostname), node.hostname)
        theirs = pathcheck.require(pathcheck.DIRECT, pathcheck.peer_path(router, node.hostname), router.hostname)
        return f"{node.hostname}: {mine}; {router.hostname}: {theirs}"

    return pod_tailscaled


def proxy_namespace(cluster: ClusterUnderTest, name: str = PROXY_NAMESPACE) -> str:
    """A namespace that admits the kernel-mode pod (Pod Security ``privileged``), its ServiceAccount ready."""
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": name, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}])
    wait_until(lambda: kubectl(cluster, "-n", name, "get", "serviceaccount", "default", check=False),
               timeout=60, what=f"the {name} namespace's ServiceAccount")
    return name


def kernel_pod(cluster: ClusterUnderTest, ns: str, ref: str, headscale: Headscale, authkey: str,
               resources: dict[str, Any], port: int,
               rules: Callable[[str], list[kernel_proxy.Rule]]) -> tuple[dict[str, Any], str, list[str]]:
    """The kernel-mode tailscaled pod up with its forwarding rules: the pod, its tailnet address, and
    the rules as read back from its namespace. ``rules`` makes them from the tailnet address."""
    apply(cluster, kernel_proxy.kernel_objects(ns, KERNEL_HOSTNAME, ref, headscale, authkey, resources,
                                               go_memory_limit(resources), port))
    wait_available(cluster, ns, KERNEL_HOSTNAME, timeout=120)
    pod = only_pod(cluster, ns, f"app={KERNEL_HOSTNAME}")
    node = PodTailscaled(cluster, ns, pod["metadata"]["name"], hostname=KERNEL_HOSTNAME)
    address = wait_until(lambda: node.status().get("BackendState") == "Running" and node.ipv4(), timeout=60,
                         what="the kernel-mode tailscaled Running")
    installed = kernel_proxy.install(kernel_proxy.pod_pid(pod["metadata"]["uid"]), rules(str(address)))
    return pod, str(address), installed


def container_resources(pod: dict[str, Any]) -> dict[str, Any]:
    resources: dict[str, Any] = pod["spec"]["containers"][0].get("resources", {})
    return resources


def egress_object(ns: str, tailnet: str, address: str, consumer: str) -> dict[str, Any]:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": "bench", "namespace": ns},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": EGRESS_TAG, "consumerNamespaces": [consumer],
                     "targets": [{"name": "bench-site", "address": address,
                                  "ports": [{"port": SERVER_PORT, "name": "bench"}]}]}}


def only_pod(cluster: ClusterUnderTest, ns: str, selector: str) -> dict[str, Any]:
    pods = [p for p in get_json(cluster, "-n", ns, "pods", "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != 1:
        raise RuntimeError(f"expected one pod for {selector}, found {len(pods)}")
    pod: dict[str, Any] = pods[0]
    return pod


def run(mib: int, rounds: int, setups: int) -> dict[str, Any]:
    with Environment() as env:
        cluster = env.cluster()
        project = image.project_image()
        cluster.load_image(project)
        tailscale = image.tailscale_image()
        cluster.load_image(tailscale)
        headscale = env.headscale("bench-headscale", address=cluster.host_address)
        ns = install_operator_in_cluster(cluster, project.ref, env.root / "install")

        host = env.site_host()
        server = host.run("bench-server", [sys.executable, "-u", str(PATHS_SOURCE), "serve", host.address,
                                           str(SERVER_PORT)])

        def listening() -> bool:
            server.check_running()
            return "listening" in server.log_tail()

        wait_until(listening, timeout=10, what="the benchmark server on the site host")
        apply(cluster, [
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bench-bootstrap", "namespace": ns},
             "stringData": {"apiKey": headscale.api_key}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench-policy", "namespace": ns},
             "data": {"policy.hujson": OPEN_BASE}},
            tailnet_object("bench", headscale, ns, secret="bench-bootstrap",
                           policy={"baseConfigMapRef": {"namespace": ns, "name": "bench-policy",
                                                        "key": "policy.hujson"}, "mode": "Apply"}),
            {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": "bench-site"},
             "spec": {"tailnetRef": {"name": "bench"}, "routes": [host.subnet], "routerTag": ROUTER_TAG}},
        ])
        router = env.tailscale_node("bench-router", headscale, authkey=headscale.create_preauth_key(tags=[ROUTER_TAG]),
                           advertise_routes=[host.subnet], site_router=True)
        consumer = "bench-consumer"
        apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": consumer}}])
        wait_until(lambda: kubectl(cluster, "-n", consumer, "get", "serviceaccount", "default", check=False),
                   timeout=60, what="the consumer namespace's ServiceAccount")
        apply(cluster, [python_pod("client", consumer, project.ref, SLEEPER)])
        wait_pod_running(cluster, consumer, "client")

        # Time to first byte: the client polls the target's Service name from before the CR exists.
        service = f"bench-site.{ns}.svc"
        waiter = PythonSession(cluster, consumer, "client", FIRST_BYTE.format(host=service, port=SERVER_PORT))
        try:
            waiter.send("go")
            created = time.time()
            apply(cluster, [egress_object(ns, "bench", host.address, consumer)])
            first_byte_s = float(waiter.read_line(timeout=300)) - created
        finally:
            waiter.close()
        wait_available(cluster, ns, "bench-egress-agent", timeout=120)
        agent_pod = only_pod(cluster, ns, "tailnet.dev/egress=bench")

        key = headscale.create_preauth_key(tags=[EGRESS_TAG], reusable=True, ephemeral=True)
        resources = container_resources(agent_pod)
        apply(cluster, tailscaled_objects(consumer, tailscale.ref, headscale, key, resources))
        wait_available(cluster, consumer, TAILSCALED_HOSTNAME, timeout=120)
        proxies = proxy_namespace(cluster)
        kernel, _, rules = kernel_pod(cluster, proxies, tailscale.ref, headscale, key, resources, SERVER_PORT,
                                      lambda address: kernel_proxy.egress_rules(address, host.address))
        socks = f"socks5:{TAILSCALED_HOSTNAME}.{consumer}.svc:{SOCKS_PORT}:{host.address}:{SERVER_PORT}"
        dials = {AGENT: f"tcp:{service}:{SERVER_PORT}", TAILSCALED: socks,
                 KERNEL: f"tcp:{KERNEL_HOSTNAME}.{proxies}.svc:{SERVER_PORT}"}
        pods = {AGENT: agent_pod, TAILSCALED: only_pod(cluster, consumer, f"app={TAILSCALED_HOSTNAME}"),
                KERNEL: kernel}
        limits = {name: container_resources(pod) for name, pod in pods.items()}
        if any(limit != limits[AGENT] for limit in limits.values()):
            raise RuntimeError(f"the egress pods' resources differ: {limits}")
        hostnames = {AGENT: None, TAILSCALED: TAILSCALED_HOSTNAME, KERNEL: KERNEL_HOSTNAME}
        checks = {name: direct_check(cluster, pod, router, hostnames[name]) for name, pod in pods.items()}
        results = measure_rows(cluster, pods, dials, checks, functools.partial(in_pod, cluster, consumer, "client"),
                               mib=mib, rounds=rounds, setups=setups)
        ready = condition(get_json(cluster, "-n", ns, "tailnetegresses.tailnet.dev", "bench"), "Ready")
        return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(),
                "headscale": versions.HEADSCALE, "tailscale": versions.TAILSCALE,
                "first_byte_s": round(first_byte_s, 2), "egress_ready": ready,
                "first_byte_milestones_s": milestones(cluster, ns, pods[AGENT]),
                "resources": limits[AGENT], "tailscaled_gomemlimit": go_memory_limit(limits[AGENT]),
                "kernel_rules": rules,
                "mib": mib, "rounds": rounds, "setups": setups,
                "results": [asdict(r) for r in results.values()]}


class Paths(Protocol):
    """``benchmarks/paths.py`` run with ``args`` where a benchmark's measuring client lives; its output."""

    def __call__(self, *args: str, timeout: float = ...) -> str: ...


def measure_rows(cluster: ClusterUnderTest, pods: dict[str, dict[str, Any]], dials: dict[str, str],
                 checks: dict[str, Callable[[], str]], paths: Paths, *, mib: int, rounds: int,
                 setups: int) -> dict[str, PathResult]:
    """Every row measured the same way: a first connection, both ends of its path direct and its
    pod's RSS when ready; ``rounds`` throughput rounds, the rows taking turns; the setup round; then
    the figures after (:func:`finish_row`)."""
    results = {name: PathResult(name) for name in dials}
    for name, dial in dials.items():
        def connects(name: str = name, dial: str = dial) -> str:
            return paths("round", name, dial, "--mib", "0", "--setups", "1", timeout=60)

        def direct(name: str = name) -> str:
            connects()
            return checks[name]()

        wait_until(connects, timeout=120, what=f"a first connection through the {name}")
        results[name].extra["path_before"] = wait_until(direct, timeout=60, interval=0.5,
                                                        what=f"a direct path at both ends of the {name}")
        results[name].extra["rss_ready_kib"] = pod_rss_kib(pods[name]["metadata"]["uid"])
    for _ in range(rounds):
        for name, dial in dials.items():
            results[name].merge(PathResult(**json.loads(paths("round", name, dial, "--mib", str(mib)))))
    for name, dial in dials.items():
        results[name].merge(PathResult(**json.loads(paths("round", name, dial, "--mib", "0", "--setups",
                                                          str(setups)))))
        finish_row(cluster, results[name], pods[name], checks[name])
    return results


def finish_row(cluster: ClusterUnderTest, result: PathResult, pod: dict[str, Any], check: Callable[[], str]) -> None:
    """A row's figures after its rounds: its pod's RSS, the path at both ends, the pod's restarts."""
    meta = pod["metadata"]
    result.extra["rss_after_kib"] = pod_rss_kib(meta["uid"])
    result.extra["path_after"] = check()
    result.extra["restarts"] = sum(c["restartCount"] for c in get_json(
        cluster, "-n", meta["namespace"], "pod", meta["name"])["status"]["containerStatuses"])


def table(doc: dict[str, Any]) -> str:
    rows = ["| path | 1 stream up MB/s | 1 stream down MB/s | 8 streams up MB/s | 8 streams down MB/s "
            "| setup p50 ms | setup p99 ms | pod RSS ready MiB | pod RSS after MiB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        extra = r["extra"]
        rows.append(f"| {r['name']} | {r['one_stream_up_mbs']:.1f} | {r['one_stream_down_mbs']:.1f} | "
                    f"{r['eight_streams_up_mbs']:.1f} | {r['eight_streams_down_mbs']:.1f} | "
                    f"{r['setup_p50_ms']:.1f} | {r['setup_p99_ms']:.1f} | "
                    f"{extra.get('rss_ready_kib', 0) / 1024:.1f} | {extra.get('rss_after_kib', 0) / 1024:.1f} |")
    return "\n".join(rows)


def ratio_lines(results: dict[str, PathResult], agent: str, others: list[str]) -> list[str]:
    """One line per other row: the agent's figure over its, per throughput column and setup time."""
    lines = []
    mine = results[agent]
    for name in others:
        theirs = results.get(name)
        if theirs is None:
            continue
        columns = ", ".join(f"{c.replace('_mbs', '').replace('_', ' ')} {getattr(mine, c) / getattr(theirs, c):.2f}"
                            for c in COLUMNS if getattr(theirs, c))
        setup = (f"; setup p50 {mine.setup_p50_ms / theirs.setup_p50_ms:.2f}, "
                 f"p99 {mine.setup_p99_ms / theirs.setup_p99_ms:.2f}" if theirs.setup_p50_ms else "")
        rss = ""
        if theirs.extra.get("rss_ready_kib") and theirs.extra.get("rss_after_kib"):
            rss = (f"; pod RSS ready {mine.extra.get('rss_ready_kib', 0) / theirs.extra['rss_ready_kib']:.2f}, "
                   f"after {mine.extra.get('rss_after_kib', 0) / theirs.extra['rss_after_kib']:.2f}")
        lines.append(f"- agent / {name}: {columns}{setup}{rss}.")
    return lines


def samples_table(results: dict[str, PathResult]) -> list[str]:
    lines = ["| path | " + " | ".join(c.replace("_mbs", "").replace("_", " ") for c in COLUMNS) + " |",
             "|---|---|---|---|---|"]
    for r in results.values():
        lines.append(f"| {r.name} | " + " | ".join(", ".join(f"{v:.1f}" for v in r.samples.get(c, []))
                                                for c in COLUMNS) + " |")
    return lines


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: its conditions, the verified paths, the tables."""
    results = {r["name"]: PathResult(**r) for r in doc["results"]}
    lines = [
        f"## Egress in the cluster, {doc['date']}, commit {doc['commit']} (local node, Headscale "
        f"{doc['headscale']}, tailscaled {doc['tailscale']})", "",
        "A client pod in a consumer namespace -> one of three egress pods -> the tailnet -> a tailscaled "
        "subnet router on the node -> a sink/source server on a site host. The egress pods: the agent "
        "(the TailnetEgress target's Service); a tailscaled pod in userspace networking that a user builds "
        "by hand (the pinned tailscaled in a scratch image, `--tun=userspace-networking --socks5-server`, "
        "joined with a config file, dialled through its SOCKS5 Service); and the shape of the Tailscale "
        "operator's egress proxy: the same tailscaled in kernel mode (`--tun=tailscale0`, root with "
        "`NET_ADMIN` only, the host's `/dev/net/tun`, `--netfilter-mode=off`), dialled through its Service, "
        "with the rules containerboot sets for `TS_TAILNET_TARGET_IP` added by the benchmark in the pod's "
        "network namespace (containerboot itself is not built here; IP forwarding turned on from the host, "
        "as containerboot does), with one rule containerboot does not set: UDP to the pod tailscaled's own "
        "port (`--port=41641`) is exempt from the DNAT. On the local node the site router reaches the pod "
        "across the bridge from an address the pod never sent to, so without it the router's first "
        "WireGuard and disco packets start new flows that the DNAT sends to the target, and the pod stays on "
        "DERP (the first trial run); a peer elsewhere only answers the pod's own flows, which conntrack "
        "takes past the DNAT. The rules as read back from the pod's namespace (`iptables-save`):", ""]
    lines += [f"    {rule}" for rule in doc.get("kernel_rules", [])]
    lines += [
        "", "The client runs `benchmarks/paths.py` in its pod, so the figures include the pod's own Python "
        "client; the server runs in a process of its own on the site host.", "",
        "All three egress pods have the same tag and resources "
        f"(`{json.dumps(doc['resources'])}`, read back from every pod before measuring); both tailscaled pods "
        f"also get `GOMEMLIMIT={doc['tailscaled_gomemlimit']}` (90% of the memory limit), so their garbage "
        "collector works to stay under the limit as the agent's must. The agent and the userspace pod run "
        "under the `restricted` security context; the kernel-mode pod cannot (root, `NET_ADMIN`, a host "
        "device). Each row's tailnet hop was checked direct at both ends before and after its measurements "
        "(the agent's UDP counters or the pod tailscaled's entry for the router, and the router's entry for "
        "the pod); a row whose path is not direct fails the run.", "",
        f"Medians of {doc['rounds']} interleaved rounds of {doc['mib']} MiB, {doc['setups']} connections for "
        f"setup. {load_average(doc['loadavg_before'], doc['loadavg_after'])}.", "",
        table(doc), ""]
    lines += ratio_lines(results, AGENT, [KERNEL, TAILSCALED])
    lines += ["", "Samples (MB/s, rounds in order):", "", *samples_table(results)]
    milestones_s = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in doc["first_byte_milestones_s"].items())
    lines += ["", f"**TailnetEgress created -> first byte echoed through it: {doc['first_byte_s']} s** "
              f"(on the way, s after creation, 1 s resolution: {milestones_s}).", "",
              "Paths as checked after the measurements:", ""]
    lines += [f"- {r.name}: {r.extra.get('path_after')}" for r in results.values()]
    return "\n".join(lines)


def command(argv: list[str] | None, *, description: str, name: str,
            measure: Callable[[int, int, int], dict[str, Any]], render: Callable[[dict[str, Any]], str]) -> int:
    """The command line of the in-cluster throughput benchmarks: ``measure(mib, rounds, setups)``,
    then its section, ``render``ed, written between the doc's ``name`` markers."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32, help="MiB per throughput measurement (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds; medians reported (default 3)")
    parser.add_argument("--setups", type=int, default=200, help="connections timed for setup (default 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    loadavg_before = os.getloadavg()
    doc = measure(args.mib, args.rounds, args.setups)
    doc |= {"loadavg_before": loadavg_before, "loadavg_after": os.getloadavg()}
    publish(render(doc), doc, json_path=args.json, doc_path=args.doc, name=name)
    return 0


def main(argv: list[str] | None = None) -> int:
    return command(argv, description=__doc__ or "", name="egress-incluster", measure=run, render=section)


if __name__ == "__main__":
    sys.exit(main())
