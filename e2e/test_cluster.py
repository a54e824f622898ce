"""The cluster itself: a Ready node that runs the project's image, pod and Service networking,
cluster DNS with the hosts ConfigMap, and the fences that keep every packet on this machine.

These run against the local node under ``make test`` and against kind under ``make e2e``.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from e2e.cluster import (
    HTTP_SERVER,
    SLEEPER,
    ClusterUnderTest,
    apply,
    exec_python,
    get_json,
    http_get_code,
    kubectl,
    namespace,
    python_pod,
    wait_available,
    wait_pod_running,
)
from e2e.skips import skip_by_design
from hack.localenv import wait_until
from tailnet_operator import __version__

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e]


def test_the_node_is_ready_and_runs_the_projects_image(cluster: ClusterUnderTest, project_image: Any) -> None:
    nodes = get_json(cluster, "nodes")["items"]
    assert nodes, "the cluster has a node"
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]

    with namespace(cluster, "image") as ns:
        server = python_pod("server", ns, project_image.ref, HTTP_SERVER, port=8080)
        apply(cluster, [{
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "echo", "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "echo"}},
                     "template": {"metadata": {"labels": {"app": "echo"}}, "spec": server["spec"]}}}])
        wait_available(cluster, ns, "echo")

        for name, command in (("version", ["/tailnet-operator", "--version"]), ("agent", ["/tailnet-agent"])):
            pod = python_pod(name, ns, project_image.ref, "")
            pod["spec"]["restartPolicy"] = "Never"
            pod["spec"]["containers"][0]["command"] = command
            apply(cluster, [pod])
        assert _finished(cluster, ns, "version") == "Succeeded"
        assert kubectl(cluster, "-n", ns, "logs", "version").strip() == f"tailnet-operator {__version__}"
        assert _finished(cluster, ns, "agent") == "Failed"
        agent_log = kubectl(cluster, "-n", ns, "logs", "agent")
        assert "AGENT_MODE is unset" in agent_log, agent_log


def _finished(cluster: ClusterUnderTest, ns: str, pod: str) -> str:
    def phase() -> str | None:
        value = get_json(cluster, "-n", ns, "pod", pod)["status"].get("phase")
        return str(value) if value in ("Succeeded", "Failed") else None

    return wait_until(phase, timeout=120, what=f"pod {ns}/{pod} to finish")


def test_pods_reach_each_other_by_cluster_ip_and_by_name(cluster: ClusterUnderTest, project_image: Any) -> None:
    with namespace(cluster, "server") as server_ns, namespace(cluster, "client") as client_ns:
        apply(cluster, [
            python_pod("hello", server_ns, project_image.ref, HTTP_SERVER, labels={"app": "hello"}, port=8080),
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hello", "namespace": server_ns},
             "spec": {"selector": {"app": "hello"}, "ports": [{"port": 80, "targetPort": 8080}]}},
            python_pod("client", client_ns, project_image.ref, SLEEPER),
        ])
        wait_pod_running(cluster, server_ns, "hello")
        wait_pod_running(cluster, client_ns, "client")
        service = get_json(cluster, "-n", server_ns, "service", "hello")
        pod_ip = get_json(cluster, "-n", server_ns, "pod", "hello")["status"]["podIP"]

        for url in (f"http://{pod_ip}:8080/", f"http://{service['spec']['clusterIP']}/",
                    f"http://hello.{server_ns}.svc.cluster.local/"):
            body = wait_until(_getter(cluster, client_ns, url), timeout=60, what=f"GET {url} from a pod")
            assert body.strip() == "hello from hello", url


def _getter(cluster: ClusterUnderTest, ns: str, url: str) -> Callable[[], str]:
    return lambda: exec_python(cluster, ns, "client", http_get_code(url))


def test_a_name_added_to_the_hosts_config_map_resolves_without_a_restart(
        cluster: ClusterUnderTest, project_image: Any) -> None:
    from hack.localenv.node import HOSTS_CONFIG_MAP

    hosts_ns, hosts_name = HOSTS_CONFIG_MAP
    name, address = "hosts-test.tailnet.test", "198.19.200.7"
    coredns_before = _coredns_pods(cluster)
    with namespace(cluster, "dns") as ns:
        apply(cluster, [python_pod("client", ns, project_image.ref, SLEEPER)])
        wait_pod_running(cluster, ns, "client")
        resolve = f"""
import socket
try:
    print(socket.gethostbyname({name!r}))
except OSError as exc:
    print("error", exc)
"""
        assert exec_python(cluster, ns, "client", resolve).startswith("error"), "not in the hosts file yet"
        apply(cluster, [{"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": hosts_name, "namespace": hosts_ns},
                         "data": {"hosts": f"{address} {name}\n"}}])
        try:
            resolved = wait_until(lambda: exec_python(cluster, ns, "client", resolve).strip() == address,
                                  timeout=120, interval=1, what=f"{name} to resolve through CoreDNS")
            assert resolved
        finally:
            apply(cluster, [{"apiVersion": "v1", "kind": "ConfigMap",
                             "metadata": {"name": hosts_name, "namespace": hosts_ns},
                             "data": {"hosts": "# names the DNS reconciler writes\n"}}])
    assert _coredns_pods(cluster) == coredns_before, "CoreDNS was not restarted"


def _coredns_pods(cluster: ClusterUnderTest) -> list[tuple[str, int]]:
    pods = get_json(cluster, "-n", "kube-system", "pods", "-l", "k8s-app=kube-dns")["items"]
    return sorted((p["metadata"]["name"], p["status"]["containerStatuses"][0]["restartCount"]) for p in pods)


READ_POD_NETWORK = """
import json
routes = []
for line in open("/proc/net/route").read().splitlines()[1:]:
    fields = line.split()
    routes.append([fields[1], fields[7]])
print(json.dumps({"routes": routes, "resolv": open("/etc/resolv.conf").read()}))
"""


DNS_PROBE = """
import socket
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    try:
        sock.sendto(b"probe", ("127.0.0.1", 53))
    except PermissionError:
        pass  # dropped by the guard, as it should be
"""


def _ip(little_endian_hex: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(little_endian_hex, 16)))


def _cidr(destination_hex: str, mask_hex: str) -> str:
    return str(ipaddress.ip_network(f"{_ip(destination_hex)}/{_ip(mask_hex)}"))


def test_pods_and_the_host_can_only_address_this_machine(cluster: ClusterUnderTest, project_image: Any) -> None:
    """A pod has no default route, only the safe range; its resolver is the cluster's alone; on
    the host, every cluster address that is not on the bridge is unreachable."""
    from hack.localenv import hostnet, node

    if not isinstance(cluster, node.Cluster):
        skip_by_design("the fences belong to the local node; kind has its own network")
    with namespace(cluster, "fence") as ns:
        apply(cluster, [python_pod("client", ns, project_image.ref, SLEEPER)])
        wait_pod_running(cluster, ns, "client")
        seen = json.loads(exec_python(cluster, ns, "client", READ_POD_NETWORK))
    routes = {_cidr(dst, mask) for dst, mask in seen["routes"]}
    assert routes == {hostnet.SAFE_RANGE, hostnet.POD_CIDR}, routes
    nameservers = [line.split()[1] for line in seen["resolv"].splitlines() if line.startswith("nameserver")]
    assert nameservers == [node.CLUSTER_DNS]

    assert hostnet.unreachable_route_present(hostnet.CLUSTER_RANGE)
    for address in ("198.19.128.1", node.CLUSTER_DNS, "198.19.255.254", "198.19.1.1"):
        answer = hostnet.route_get(address)
        assert answer == "RTNETLINK answers: No route to host", (address, answer)  # the unreachable route
    counts = hostnet.guard_counts()
    assert counts["pod-escape"] == 0, "a pod sent a packet towards an address outside the safe range"
    assert counts["node-dns"] == 0, "a process of the node sent a DNS query (to the machine's resolver)"
    # The DNS fence sees what it is meant to see: a query from the node's group to loopback.
    subprocess.run([sys.executable, "-c", DNS_PROBE], group=hostnet.NODE_GID, check=True, timeout=10)
    assert hostnet.guard_counts()["node-dns"] == 1
    node_addresses = get_json(cluster, "node", node.NODE_NAME)["status"]["addresses"]
    assert {a["type"]: a["address"] for a in node_addresses} == {
        "InternalIP": hostnet.NODE_IP, "Hostname": node.NODE_NAME}
