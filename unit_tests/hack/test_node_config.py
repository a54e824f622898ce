"""The local node's configuration builders: the fences that keep packets on this machine and
the settings this kernel needs are in what they produce."""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path

from hack.localenv import hostnet, node
from hack.localenv.controlplane import SERVICE_CIDR


def test_every_cluster_range_is_inside_the_benchmarking_range_and_under_the_unreachable_route() -> None:
    safe = ipaddress.ip_network(hostnet.SAFE_RANGE)
    fenced = ipaddress.ip_network(hostnet.CLUSTER_RANGE)
    for cidr in (hostnet.POD_CIDR, SERVICE_CIDR, f"{hostnet.NODE_IP}/32", f"{node.CLUSTER_DNS}/32"):
        network = ipaddress.ip_network(cidr)
        assert network.subnet_of(safe), cidr  # type: ignore[arg-type]
        assert network.subnet_of(fenced), cidr  # type: ignore[arg-type]
    assert ipaddress.ip_address(node.CLUSTER_DNS) in ipaddress.ip_network(SERVICE_CIDR)


def test_pods_get_no_default_route_and_no_masquerade() -> None:
    config = node.cni_config(Path("/state/ipam"))
    bridge = config["plugins"][0]
    assert bridge["ipMasq"] is False
    assert bridge["ipam"]["routes"] == [{"dst": hostnet.SAFE_RANGE}]
    assert bridge["ipam"]["dataDir"] == "/state/ipam", "IPAM state stays in the node's directory"


def test_containerd_configuration_keeps_to_its_directory_and_this_kernels_limits() -> None:
    base = Path("/state/containerd")
    config = tomllib.loads(node.containerd_config(base, Path("/state/net.d"), "localhost/pause:1",
                                                  cni_bin=Path("/bin/cni"), runc=Path("/bin/runc")))
    assert config["version"] == 3
    assert config["root"].startswith(str(base)) and config["state"].startswith(str(base))
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert config["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == "localhost/pause:1"


def test_kubelet_runs_on_cgroup_v1_and_never_hands_pods_the_machines_resolver() -> None:
    config = node.kubelet_config(ca=Path("/ca"), resolv_conf=Path("/state/resolv.conf"),
                                 socket=Path("/state/sock"), pod_logs=Path("/state/logs"), port=1, healthz_port=2)
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["resolvConf"] == "/state/resolv.conf"
    assert config["clusterDNS"] == [node.CLUSTER_DNS]
    assert config["readOnlyPort"] == 0


def test_cluster_dns_never_forwards() -> None:
    assert "forward" not in node.COREFILE
    assert "hosts /etc/coredns/hosts/hosts" in node.COREFILE
    deployment = next(d for d in node.coredns_manifests("localhost/coredns:1") if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["dnsPolicy"] == "Default"


def test_the_guard_drops_pod_traffic_to_anything_outside_the_safe_range() -> None:
    rules = hostnet._guard_ruleset()
    assert f"ip saddr {hostnet.POD_CIDR} ip daddr != {hostnet.SAFE_RANGE} counter drop" in rules
