"""In-cluster ingress benchmark: the agent's tcp expose against the Tailscale operator's kernel-mode proxy.

Path: a tailnet client -> the tailnet -> (the TailnetIngress's agent pod, a tcp expose | a
tailscaled pod in kernel mode that DNATs its tailnet address to the Service's ClusterIP, the
shape of the Tailscale operator's ingress proxy, ``TS_DEST_IP``: :mod:`benchmarks.kernel_proxy`)
-> a ClusterIP Service -> a sink/source server pod (``benchmarks/paths.py serve``). The client is
a tailnet user's machine: a tailscaled on a TUN device in a reachable network namespace
(``site_host(reachable=True)``), so what runs there dials tailnet addresses with the kernel's TCP
and no proxy, and ``paths.py round`` runs there as a process of its own; neither end is a
userspace netstack that could be the bottleneck.

Both pods get the same resources (the agent's, read back from both) and the tailscaled pod a
GOMEMLIMIT at 90% of the memory limit. Each row's tailnet hop is checked direct at both ends (the
client's entry for the pod, and the agent's UDP counters or the pod tailscaled's entry for the
client) before and after its measurements. Measured in one run, in rounds that take both paths in
turn: one stream and 8 streams up and down (MB/s, medians), connection setup (connect plus one byte
echoed, p50 and p99), and each pod's RSS ready and after.

    python -m benchmarks.ingress_incluster [--mib 32] [--rounds 3] [--setups 200] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from benchmarks import kernel_proxy
from benchmarks.egress_incluster import (
    KERNEL_HOSTNAME,
    PATHS_SOURCE,
    command,
    container_resources,
    direct_check,
    go_memory_limit,
    kernel_pod,
    measure_rows,
    only_pod,
    proxy_namespace,
    ratio_lines,
    samples_table,
    table,
)
from benchmarks.paths import PathResult
from benchmarks.record import commit, load_average
from e2e.cluster import (
    OPEN_BASE,
    ClusterUnderTest,
    apply,
    get_json,
    install_operator_in_cluster,
    kubectl,
    python_pod,
    wait_available,
    wait_pod_running,
)
from e2e.operator import tailnet_object
from hack import image, versions
from hack.localenv import Environment, SiteHost, wait_until

PORT = 9000
TENANT = "bench-tenant"
INGRESS_TAG = "tag:bench-ingress"
INGRESS = "bench"
INGRESS_HOSTNAME = "bench-ingress"
AGENT = "agent (TailnetIngress, tcp expose)"
KERNEL = "tailscaled kernel-mode pod (TUN, DNAT to the ClusterIP)"
INGRESSES = "tailnetingresses.tailnet.dev"


def server_script(port: int = PORT) -> str:
    """``paths.py serve 0.0.0.0 PORT`` as the ``python -c`` script of a pod (the project's image has
    no copy of the benchmarks): the file's text is compiled inside the script."""
    return (f"import sys\nsys.argv = ['paths.py', 'serve', '0.0.0.0', '{port}']\n"
            f"exec(compile({PATHS_SOURCE.read_text()!r}, 'paths.py', 'exec'), {{'__name__': '__main__'}})\n")


def ingress_object(tailnet: str) -> dict[str, Any]:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
            "metadata": {"name": INGRESS, "namespace": TENANT},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": INGRESS_TAG, "hostname": INGRESS_HOSTNAME,
                     "exposes": [{"name": "sink", "port": PORT, "backend": {"service": "sink", "port": PORT}}]}}


def node_address(obj: dict[str, Any]) -> str | None:
    """The IPv4 tailnet address in an ingress's ``status.node``, once it is Ready."""
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in (obj.get("status") or {}).get("conditions", []))
    addresses = ((obj.get("status") or {}).get("node") or {}).get("addresses") or []
    return next((a for a in addresses if "." in a), None) if ready else None


def on_host(host: SiteHost, *args: str, timeout: float = 600) -> str:
    """``benchmarks/paths.py`` with ``args``, as a process of its own on the tailnet client's host."""
    proc = subprocess.run(["ip", "netns", "exec", host.name, sys.executable, str(PATHS_SOURCE), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"paths.py {' '.join(args)} on {host.name} failed: {proc.stderr.strip()[-600:]}")
    return proc.stdout


def _world(cluster: ClusterUnderTest, ns: str, headscale: Any, image_ref: str) -> None:
    """The Tailnet (open policy; the tenant may use the ingress tag), the tenant, the sink and its Service."""
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TENANT}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bench-bootstrap", "namespace": ns},
         "stringData": {"apiKey": headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench-policy", "namespace": ns},
         "data": {"policy.hujson": OPEN_BASE}},
        tailnet_object("bench", headscale, ns, secret="bench-bootstrap",
                       tenants=[{"namespaces": [TENANT], "tags": [INGRESS_TAG]}],
                       policy={"baseConfigMapRef": {"namespace": ns, "name": "bench-policy", "key": "policy.hujson"},
                               "mode": "Apply"}),
    ])
    wait_until(lambda: kubectl(cluster, "-n", TENANT, "get", "serviceaccount", "default", check=False),
               timeout=60, what="the tenant namespace's ServiceAccount")
    apply(cluster, [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "tailnet-operator", "namespace": TENANT},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tailnet-operator-tenant"},
         "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": ns}]},
        python_pod("sink", TENANT, image_ref, server_script(), labels={"app": "sink"}, port=PORT),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "sink", "namespace": TENANT},
         "spec": {"selector": {"app": "sink"}, "ports": [{"port": PORT, "targetPort": PORT}]}},
    ])
    wait_pod_running(cluster, TENANT, "sink")


def run(mib: int, rounds: int, setups: int) -> dict[str, Any]:
    with Environment() as env:
        cluster = env.cluster()
        project = image.project_image()
        cluster.load_image(project)
        tailscale = image.tailscale_image()
        cluster.load_image(tailscale)
        headscale = env.headscale("bench-headscale", address=cluster.host_address)
        ns = install_operator_in_cluster(cluster, project.ref, env.root / "install")
        _world(cluster, ns, headscale, project.ref)
        apply(cluster, [ingress_object("bench")])
        agent_ip = wait_until(lambda: node_address(get_json(cluster, "-n", TENANT, INGRESSES, INGRESS)), timeout=300,
                              what="the TailnetIngress Ready with a tailnet address")
        wait_available(cluster, TENANT, f"{INGRESS}-ingress-agent", timeout=120)
        agent_pod = only_pod(cluster, TENANT, f"tailnet.dev/ingress={INGRESS}")

        host = env.site_host(reachable=True)
        user = headscale.create_user("bench-laptop")
        client = env.tailscale_node("bench-laptop", headscale, authkey=headscale.create_preauth_key(user_id=user["id"]),
                                    host=host)
        resources = container_resources(agent_pod)
        cluster_ip = get_json(cluster, "-n", TENANT, "service", "sink")["spec"]["clusterIP"]
        key = headscale.create_preauth_key(tags=[INGRESS_TAG], reusable=True, ephemeral=True)
        kernel, kernel_ip, rules = kernel_pod(cluster, proxy_namespace(cluster), tailscale.ref, headscale, key,
                                              resources, PORT,
                                              lambda address: kernel_proxy.ingress_rules(address, cluster_ip))
        dials = {AGENT: f"tcp:{agent_ip}:{PORT}", KERNEL: f"tcp:{kernel_ip}:{PORT}"}
        pods = {AGENT: agent_pod, KERNEL: kernel}
        limits = {name: container_resources(pod) for name, pod in pods.items()}
        if limits[AGENT] != limits[KERNEL]:
            raise RuntimeError(f"the ingress pods' resources differ: {limits}")
        hostnames = {AGENT: None, KERNEL: KERNEL_HOSTNAME}
        checks: dict[str, Callable[[], str]] = {name: direct_check(cluster, pod, client, hostnames[name])
                                                for name, pod in pods.items()}
        results = measure_rows(cluster, pods, dials, checks, functools.partial(on_host, host),
                               mib=mib, rounds=rounds, setups=setups)
        return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(),
                "headscale": versions.HEADSCALE, "tailscale": versions.TAILSCALE,
                "resources": limits[AGENT], "tailscaled_gomemlimit": go_memory_limit(limits[AGENT]),
                "kernel_rules": rules, "cluster_ip": cluster_ip,
                "mib": mib, "rounds": rounds, "setups": setups,
                "results": [asdict(r) for r in results.values()]}


def section(doc: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of one run: its conditions, the verified paths, the tables."""
    results = {r["name"]: PathResult(**r) for r in doc["results"]}
    lines = [
        f"### Ingress in the cluster, {doc['date']}, commit {doc['commit']} (local node, Headscale "
        f"{doc['headscale']}, tailscaled {doc['tailscale']})", "",
        "A tailnet client (the pinned tailscaled on a TUN device in a network namespace of its own, "
        "`--netfilter-mode=off`; `benchmarks/paths.py` run there as a process of its own, dialling tailnet "
        "addresses with the kernel's TCP) -> the tailnet -> one of two ingress pods -> the `sink` Service's "
        "ClusterIP -> a sink/source server pod. The ingress pods: the agent of a TailnetIngress with a tcp "
        "expose of the Service; and the shape of the Tailscale operator's ingress proxy: the pinned "
        "tailscaled in kernel mode (`--tun=tailscale0`, root with `NET_ADMIN` only, the host's "
        "`/dev/net/tun`, `--netfilter-mode=off`) with the rules containerboot sets for `TS_DEST_IP`, plus "
        "the masquerade of forwarded traffic that tailscaled's own netfilter mode would add, set by the "
        "benchmark in the pod's network namespace (IP forwarding turned on from the host, as containerboot "
        "does):", ""]
    lines += [f"    {rule}" for rule in doc.get("kernel_rules", [])]
    lines += [
        "", "Both pods have the same resources "
        f"(`{json.dumps(doc['resources'])}`, read back from both before measuring); the tailscaled pod also "
        f"gets `GOMEMLIMIT={doc['tailscaled_gomemlimit']}` (90% of the memory limit). The agent runs under the "
        "`restricted` security context, the kernel-mode pod cannot. Each row's tailnet hop was checked direct "
        "at both ends before and after its measurements (the client's entry for the pod, and the agent's UDP "
        "counters or the pod tailscaled's entry for the client); a row whose path is not direct fails the "
        "run. No userspace tailscaled row here: a userspace tailscaled ingress is `tailscale serve`, measured "
        "on host processes in \"Ingress against tailscale serve\".", "",
        f"Medians of {doc['rounds']} interleaved rounds of {doc['mib']} MiB, {doc['setups']} connections for "
        f"setup. {load_average(doc['loadavg_before'], doc['loadavg_after'])}.", "",
        table(doc), ""]
    lines += ratio_lines(results, AGENT, [KERNEL])
    lines += ["", "Samples (MB/s, rounds in order):", "", *samples_table(results)]
    lines += ["", "Paths as checked after the measurements:", ""]
    lines += [f"- {r.name}: {r.extra.get('path_after')}" for r in results.values()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return command(argv, description=__doc__ or "", name="ingress-incluster", measure=run, render=section)


if __name__ == "__main__":
    sys.exit(main())
