"""`make e2e`'s plan (hack/kind/plan.py): every address stays in the ranges it was given, dockerd
never runs with the system's defaults, the kind configuration asks for nothing from a registry."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml

from hack.kind import plan
from hack.localenv import node

OURS = [ipaddress.IPv4Network(c) for c in ("198.19.200.0/24", "198.19.208.0/20", "198.19.224.0/20")]
LOCAL_NODE = [ipaddress.ip_network(c) for c in ("198.19.0.0/24", "198.19.64.0/24", "198.19.128.0/24")]
SITE_HOSTS = ipaddress.ip_network("198.18.0.0/16")


def test_ranges_are_ours_and_apart() -> None:
    for cidr in (plan.NETWORK_SUBNET, plan.POD_SUBNET, plan.SERVICE_SUBNET):
        net = ipaddress.ip_network(cidr)
        assert net in OURS
        assert not any(net.overlaps(other) for other in LOCAL_NODE)
        assert not net.overlaps(SITE_HOSTS)
    assert ipaddress.ip_address(plan.CLUSTER_DNS) in ipaddress.ip_network(plan.SERVICE_SUBNET)
    assert ipaddress.ip_address(plan.NETWORK_GATEWAY) in ipaddress.ip_network(plan.NETWORK_SUBNET)


def test_dockerd_has_no_defaults() -> None:
    paths = plan.DaemonPaths(Path("/cache/docker"))
    argv = plan.dockerd_argv("/usr/sbin/dockerd", paths)
    assert "--config-file=/cache/docker/daemon.json" in argv
    assert all(a.split("=", 1)[1].startswith("/cache/docker") or a.split("=", 1)[1].startswith("unix:///cache")
               for a in argv[1:])
    config = plan.daemon_config(paths)
    assert config["bridge"] == "none"
    assert config["iptables"] is False and config["ip6tables"] is False and config["ip-forward"] is False
    assert config["registry-mirrors"] == [] and config["dns"] == [plan.NETWORK_GATEWAY]


def test_dockerd_proxy_is_a_closed_local_port() -> None:
    env = plan.dockerd_environment({"PATH": "/bin", "https_proxy": "http://proxy.example:3128"})
    assert "https_proxy" not in env
    assert env["HTTPS_PROXY"].startswith("http://127.0.0.1:")


def test_network_is_ipv4_in_its_subnet() -> None:
    args = plan.network_create_args()
    assert f"--subnet={plan.NETWORK_SUBNET}" in args and "--ipv6=false" in args and args[-1] == plan.NETWORK


@pytest.mark.parametrize(("ip", "subnet"), [("198.19.200.2", "198.19.208.0/24"), ("198.19.200.4", "198.19.210.0/24"),
                                            ("198.19.200.17", "198.19.223.0/24")])
def test_node_pod_subnet(ip: str, subnet: str) -> None:
    assert plan.node_pod_subnet(ip) == subnet


def test_node_pod_subnet_out_of_range() -> None:
    with pytest.raises(ValueError):
        plan.node_pod_subnet("198.19.200.18")


def test_host_routes() -> None:
    routes = plan.host_routes(["198.19.200.3", "198.19.200.2"])
    assert routes[:2] == [["unreachable", plan.POD_SUBNET], ["unreachable", plan.SERVICE_SUBNET]]
    assert routes[2] == ["198.19.208.0/24", "via", "198.19.200.2", "dev", plan.NETWORK_BRIDGE]


def test_net_script_routes_only_our_ranges() -> None:
    script = plan.net_script()
    assert "ip route del default" in script
    for line in script.splitlines():
        if line.startswith("ip route replace") or " ip route replace " in line:
            target = ipaddress.IPv4Network(line.split("ip route replace ")[1].split()[0])
            assert any(target.subnet_of(o) for o in OURS)


def test_kind_config() -> None:
    config = plan.kind_config("localhost/kind-node:x", etcd="3.6.16")
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker", "worker"]
    assert config["networking"]["disableDefaultCNI"] is True and config["networking"]["ipFamily"] == "ipv4"
    patches = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]
    kubelet = next(p for p in patches if p["kind"] == "KubeletConfiguration")
    assert kubelet["failCgroupV1"] is False
    assert kubelet["allowedUnsafeSysctls"] == ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"]
    cluster = next(p for p in patches if p["kind"] == "ClusterConfiguration")
    assert cluster["imageRepository"] == plan.IMAGE_REPOSITORY
    assert all(p["nodeRegistration"]["imagePullPolicy"] == "Never"
               for p in patches if p["kind"] in ("InitConfiguration", "JoinConfiguration"))


def test_coredns_serves_the_hosts_config_map_at_kinds_address() -> None:
    docs = plan.coredns_manifests(node.coredns_manifests("localhost/coredns:1"))
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == plan.CLUSTER_DNS
    corefile = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "coredns")
    assert "forward" not in corefile["data"]["Corefile"]
    assert any(d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tailnet-hosts" for d in docs)


def test_cri_base_spec() -> None:
    spec = plan.cri_base_spec({"process": {"rlimits": [1]}, "hooks": {}})
    assert "rlimits" not in spec["process"]
    assert spec["hooks"]["createContainer"] == [{"path": "/kind/bin/mount-product-files.sh"}]


def test_content_tag_is_stable_and_sensitive() -> None:
    assert plan.content_tag({"a": "1", "b": "2"}) == plan.content_tag({"b": "2", "a": "1"})
    assert plan.content_tag({"a": "1"}) != plan.content_tag({"a": "2"})



def test_runtime_wrapper_is_python_that_execs_runc() -> None:
    text = plan.runtime_wrapper("/usr/sbin/runc")
    compile(text, "tailnet-runc", "exec")
    assert text.startswith("#!/usr/bin/python3\n")
    assert "os.execv('/usr/sbin/runc', ['/usr/sbin/runc', *args])" in text
    assert '"CAP_SYS_RESOURCE"' in text
