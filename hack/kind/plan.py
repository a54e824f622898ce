"""What `make e2e` sets up, as data and text: addresses, the dockerd command line, the kind
configuration, the node image's generated files. Pure (config in, text out); the I/O lives in
:mod:`hack.kind.docker`, :mod:`hack.kind.nodeimage` and :mod:`hack.kind.cluster`.

Every address comes from the benchmarking range 198.18.0.0/15 (RFC 2544) and none from the
parts the local node (198.19.0.0/24, 198.19.64.0/24, 198.19.128.0/24) or the site hosts
(198.18.1.0 to 198.18.250.255) use, so `make e2e` and `make test` can run on one machine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

NETWORK = "kind"
"""The docker network kind attaches its nodes to (kind reuses an existing one of that name)."""
NETWORK_SUBNET = "198.19.200.0/24"
NETWORK_GATEWAY = "198.19.200.1"
"""The host's address on the kind network: where pods reach servers the tests run here."""
NETWORK_BRIDGE = "tkind0"
POD_SUBNET = "198.19.208.0/20"
SERVICE_SUBNET = "198.19.224.0/20"
CLUSTER_DNS = "198.19.224.10"
"""kubeadm's choice (the tenth address of the Service range), which the kubelets are given."""
NODE_POD_PREFIX = 24
"""Each node's pods take one /24 of the pod range, chosen from the node's address on the network."""
SAFE_RANGE = "198.18.0.0/15"
UNREACHABLE = (POD_SUBNET, SERVICE_SUBNET)
"""Ranges the host does not reach directly: an ``unreachable`` route covers each, so a packet to
one of them never takes the default route (the pod /24 of each node is routed through it)."""
GUARD_TABLE = "tailnet_test_kind_guard"
"""An nftables table that drops whatever the host would forward from the kind bridge to an
address outside 198.18.0.0/15 (should forwarding be on while the cluster runs). Named as the
tests' own tables are, so that a local node started meanwhile leaves it alone."""

CLUSTER_NAME = "tailnet-e2e"
WORKERS = 2
IMAGE_REPOSITORY = "localhost/kind"
"""kubeadm's ``imageRepository``: every control-plane image is built here under this name."""
NODE_IMAGE_REPOSITORY = "localhost/kind-node"
BASE_IMAGE_REPOSITORY = "localhost/kind-base"

BASE_PACKAGES = ("systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux", "mount",
                 "kmod", "libseccomp2", "e2fsprogs", "bash", "ca-certificates", "procps", "jq")
"""What kind's base Dockerfile installs, less what serves storage drivers and tools the cluster
tests never use (fuse-overlayfs, nfs-common, open-iscsi, pigz, curl); jq serves kind's
mount-product-files.sh hook."""

KIND_FILES = ("etc/sysctl.d", "etc/systemd/system", "etc/default", "etc/crictl.yaml", "usr/local/bin", "kind")
"""kind's own files (``images/base/files`` of the pinned module), copied into the base at build
time from Go's module cache: the entrypoint, the units and the mount helpers."""
ENABLED_UNITS = ("kubelet.service", "containerd.service", "undo-mount-hacks.service", "tailnet-kind-net.service")
MASKED_UNITS = ("systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "systemd-sysctl.service",
                "systemd-modules-load.service", "systemd-pstore.service")
"""Units that would reach past the node container into the kernel it shares with the host (a
privileged container): binfmt_misc (kind masks it too), Debian's sysctl defaults (kernel.pid_max,
fs.protected_*, ...), module loading, the host's pstore."""
NODE_SYSCTLS = {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.route_localnet": "1",
                "net.ipv4.conf.all.arp_ignore": "0", "net.ipv4.conf.default.rp_filter": "1",
                "net.ipv4.conf.all.rp_filter": "1"}
"""kind's /etc/sysctl.d, set by the node's own unit (systemd-sysctl is masked): all are per
network namespace, so they change the node, not the host."""
POD_UNSAFE_SYSCTLS = ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding")
"""What the kubelets let pods set (``allowedUnsafeSysctls``): a pod's network namespace takes its
IPv4 settings from the host's initial namespace, not the node's (``devconf_inherit_init_net=0``),
so on kind a TailnetGateway router forwards only when its pod sets them
(``--gateway-router-sysctls``); the host's own forwarding is left as it is."""
KUBELET_TUNABLES = {"vm.overcommit_memory": "1", "vm.panic_on_oom": "0", "kernel.panic": "10",
                    "kernel.panic_on_oops": "1", "kernel.keys.root_maxkeys": "1000000",
                    "kernel.keys.root_maxbytes": "25000000"}
"""What the kubelet writes at start unless it reads these values (``setupKernelTunables``): the
kernel's, not the container's. Each node shows the kubelet a file with that value bound over the
/proc/sys entry, so the host keeps its own."""
NODE_CHANGES = (
    "ENV container=docker",
    'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
)
"""The node image's configuration, as kind's base image has it (``docker import --change``)."""
STOP_SIGNAL = "SIGRTMIN+3"
"""What stops systemd cleanly; set by a last ``docker build`` step (``import`` and ``commit`` of
Docker 20.10 take no STOPSIGNAL change)."""


# --- dockerd --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonPaths:
    """Everything the run's dockerd writes, all under one directory of the cache."""

    root: Path

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def exec_root(self) -> Path:
        return self.root / "exec"

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def config(self) -> Path:
        return self.root / "daemon.json"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def runtime(self) -> Path:
        return self.root / "bin" / "tailnet-runc"

    @property
    def host(self) -> str:
        """``DOCKER_HOST`` for our commands."""
        return f"unix://{self.socket}"


RUNTIME = "tailnet-runc"


def daemon_config(paths: DaemonPaths) -> dict[str, Any]:
    """dockerd's settings: no default bridge, no iptables or forwarding, no registry mirrors.

    The containers' DNS is the host's address on the kind network, where nothing listens: docker's
    embedded resolver then has nowhere to send a name, instead of the machine's resolver. The
    runtime is runc behind :func:`runtime_wrapper`.
    """
    return {
        "runtimes": {RUNTIME: {"path": str(paths.runtime)}},
        "default-runtime": RUNTIME,
        "bridge": "none",
        "iptables": False,
        "ip6tables": False,
        "ip-forward": False,
        "ip-masq": False,
        "ipv6": False,
        "dns": [NETWORK_GATEWAY],
        "registry-mirrors": [],
        "insecure-registries": [],
        "exec-opts": ["native.cgroupdriver=cgroupfs"],
        "storage-driver": "overlay2",
        "log-driver": "json-file",
        "features": {"buildkit": False},
    }


def runtime_wrapper(runc: str) -> str:
    """runc, with every capability the machine's bounding set lacks taken out of the container's
    (``create``/``run``) or process's (``exec --process``) spec first.

    This VM withholds CAP_SYS_RESOURCE from everything, and Docker 20.10 hands a privileged
    container (every kind node is one) each capability it knows, which runc then fails to apply
    ("unable to apply caps: operation not permitted").
    """
    return textwrap.dedent(f"""\
        #!/usr/bin/python3
        # Written by hack/kind (tailnet-operator): runc without the capabilities this machine withholds.
        import json, os, sys

        NAMES = {json.dumps(CAPABILITY_NAMES)}
        bounding = int(open("/proc/self/status").read().split("CapBnd:")[1].split()[0], 16)
        allowed = {{name for i, name in enumerate(NAMES) if bounding >> i & 1}}


        def trim(process):
            for key, caps in (process.get("capabilities") or {{}}).items():
                process["capabilities"][key] = [c for c in caps if c in allowed]


        def edit(path, inner):
            with open(path) as f:
                doc = json.load(f)
            trim(doc.get("process", {{}}) if inner else doc)
            with open(path, "w") as f:
                json.dump(doc, f)


        args = sys.argv[1:]
        for i, arg in enumerate(args):
            if arg in ("create", "run"):
                rest = args[i + 1:]
                bundle = next((v.split("=", 1)[1] for v in rest if v.startswith(("--bundle=", "-b="))), None)
                for j, v in enumerate(rest[:-1]):
                    if v in ("--bundle", "-b"):
                        bundle = rest[j + 1]
                edit(os.path.join(bundle or ".", "config.json"), True)
                break
            if arg == "exec":
                rest = args[i + 1:]
                for j, v in enumerate(rest[:-1]):
                    if v in ("--process", "-p"):
                        edit(rest[j + 1], False)
                break
        os.execv({runc!r}, [{runc!r}, *args])
        """)


CAPABILITY_NAMES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN",
    "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
]
"""Linux capabilities by number (capability.h)."""


def dockerd_argv(dockerd: str, paths: DaemonPaths) -> list[str]:
    """The command line: our own config file (never /etc/docker/daemon.json), roots, socket, pidfile."""
    return [dockerd, f"--config-file={paths.config}", f"--data-root={paths.data_root}",
            f"--exec-root={paths.exec_root}", f"--pidfile={paths.pidfile}", f"--host={paths.host}"]


def dockerd_environment(base: Mapping[str, str]) -> dict[str, str]:
    """dockerd's environment: a proxy on a closed local port, so that a pull nobody meant fails on
    this machine instead of resolving a registry's name through the machine's resolver."""
    env = {k: v for k, v in base.items() if k.lower() not in ("http_proxy", "https_proxy", "no_proxy")}
    env.update({"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""})
    return env


def network_create_args() -> list[str]:
    """``docker network create`` for kind's network: IPv4 only, our subnet and bridge name, no masquerade."""
    return ["network", "create", "--driver=bridge", f"--subnet={NETWORK_SUBNET}", f"--gateway={NETWORK_GATEWAY}",
            "--ipv6=false", f"--opt=com.docker.network.bridge.name={NETWORK_BRIDGE}",
            "--opt=com.docker.network.bridge.enable_ip_masquerade=false", NETWORK]


def node_pod_subnet(node_ip: str) -> str:
    """The /24 of the pod range a node's pods take: the node's offset from the first node address
    (the gateway is .1, docker gives nodes .2 onwards)."""
    network = ipaddress.ip_network(NETWORK_SUBNET)
    offset = int(ipaddress.ip_address(node_ip)) - int(network.network_address) - 2
    subnets = list(ipaddress.ip_network(POD_SUBNET).subnets(new_prefix=NODE_POD_PREFIX))
    if not 0 <= offset < len(subnets):
        raise ValueError(f"node address {node_ip} has no pod subnet (at most {len(subnets)} nodes)")
    return str(subnets[offset])


def host_routes(node_ips: Iterable[str]) -> list[list[str]]:
    """``ip route`` arguments the host needs: each node's pods through the node, and the rest of
    the pod and Service ranges unreachable."""
    routes = [["unreachable", cidr] for cidr in UNREACHABLE]
    routes += [[node_pod_subnet(ip), "via", ip, "dev", NETWORK_BRIDGE] for ip in sorted(node_ips)]
    return routes


def guard_ruleset() -> str:
    """The host's guard: nothing is forwarded from the kind bridge outside 198.18.0.0/15."""
    return textwrap.dedent(f"""\
        table inet {GUARD_TABLE} {{
          chain forward {{
            type filter hook forward priority -10; policy accept;
            iifname "{NETWORK_BRIDGE}" ip daddr != {SAFE_RANGE} counter drop comment "kind-escape"
            iifname "{NETWORK_BRIDGE}" meta nfproto ipv6 counter drop comment "kind-escape-v6"
          }}
        }}
        """)


# --- the node image -------------------------------------------------------------------------

NET_SCRIPT = "/kind/bin/tailnet-kind-net.sh"


def net_script() -> str:
    """Run once in each node before containerd: the node's pod subnet and CNI configuration, a
    route to every other possible node's pods, and no default route (a pod's packet to anything
    outside the cluster fails in the node instead of reaching the host)."""
    network = ipaddress.ip_network(NETWORK_SUBNET)
    pods = list(ipaddress.ip_network(POD_SUBNET).subnets(new_prefix=NODE_POD_PREFIX))
    others = "\n".join(
        f'[ "$ip" = "{network.network_address + 2 + i}" ] || '
        f"ip route replace {subnet} via {network.network_address + 2 + i} dev eth0"
        for i, subnet in enumerate(pods))
    cases = "\n".join(f'  {network.network_address + 2 + i}) subnet={subnet} ;;' for i, subnet in enumerate(pods))
    conflist = json.dumps(cni_conflist("SUBNET"), indent=2).replace('"SUBNET"', '"$subnet"')
    sysctls = "\n".join(f"sysctl -qw {k}={v}" for k, v in NODE_SYSCTLS.items())
    tunables = "\n".join(
        f"echo {v} > /run/tailnet-kind/sysctl/{k} && "
        f"mount --bind /run/tailnet-kind/sysctl/{k} /proc/sys/{k.replace('.', '/')}"
        for k, v in KUBELET_TUNABLES.items())
    return f"""#!/bin/sh
# Written by hack/kind (tailnet-operator): the node's pod network, no default route.
set -eu
ip=$(ip -4 -o addr show dev eth0 | awk '{{print $4}}' | cut -d/ -f1)
case "$ip" in
{cases}
  *) echo "no pod subnet for node address $ip" >&2; exit 1 ;;
esac
mkdir -p /etc/cni/net.d
cat > /etc/cni/net.d/10-tailnet-kind.conflist <<EOF
{conflist}
EOF
{others}
ip route replace {SERVICE_SUBNET} via {NETWORK_GATEWAY} dev eth0
ip route del default 2>/dev/null || true
{sysctls}
mkdir -p /run/tailnet-kind/sysctl
{tunables}
"""


def net_unit() -> str:
    return textwrap.dedent(f"""\
        [Unit]
        Description=tailnet-operator kind: pod network of this node
        After=network.target
        Before=containerd.service kubelet.service

        [Service]
        Type=oneshot
        RemainAfterExit=yes
        ExecStart={NET_SCRIPT}

        [Install]
        WantedBy=multi-user.target
        """)


def cni_conflist(subnet: str) -> dict[str, Any]:
    """ptp (a veth per pod, routed by the node), host-local in the node's /24, portmap."""
    return {
        "cniVersion": "1.0.0",
        "name": "tailnet-kind",
        "plugins": [
            {"type": "ptp", "ipMasq": False, "mtu": 1500,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "/run/cni-ipam-state"}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def containerd_config(sandbox_image: str) -> str:
    """containerd 2.x in the node: kind's settings, the pinned local sandbox image, and
    ``restrict_oom_score_adj`` (this machine withholds CAP_SYS_RESOURCE, so nothing may lower an
    oom_score_adj)."""
    return textwrap.dedent(f"""\
        version = 3

        [plugins."io.containerd.cri.v1.images"]
          snapshotter = "overlayfs"
          discard_unpacked_layers = true
          [plugins."io.containerd.cri.v1.images".pinned_images]
            sandbox = "{sandbox_image}"

        [plugins."io.containerd.cri.v1.runtime"]
          restrict_oom_score_adj = true
          tolerate_missing_hugepages_controller = true
          [plugins."io.containerd.cri.v1.runtime".containerd]
            default_runtime_name = "runc"
            [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
              runtime_type = "io.containerd.runc.v2"
              base_runtime_spec = "/etc/containerd/cri-base.json"
              [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
                SystemdCgroup = true
          [plugins."io.containerd.cri.v1.runtime".cni]
            bin_dirs = ["/opt/cni/bin"]
            conf_dir = "/etc/cni/net.d"
        """)


def cri_base_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """kind's edit of ``ctr oci spec``: the product-files hook, no rlimits."""
    out: dict[str, Any] = json.loads(json.dumps(spec))
    out.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
    out.get("process", {}).pop("rlimits", None)
    return out


def scratch_dockerfile(binary: str, *, base: str = "scratch", entrypoint: Sequence[str] = ()) -> str:
    """A control-plane image: one static binary on PATH (kubeadm's manifests name the command)."""
    lines = [f"FROM {base}", f"COPY {binary} /usr/local/bin/{binary}",
             "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    if entrypoint:
        lines.append(f"ENTRYPOINT {json.dumps(list(entrypoint))}")
    return "\n".join(lines) + "\n"


def image_ref(name: str, tag: str) -> str:
    return f"{IMAGE_REPOSITORY}/{name}:{tag}"


def content_tag(parts: Mapping[str, str]) -> str:
    """A short hash over named inputs (file digests, generated texts, versions)."""
    digest = hashlib.sha256()
    for key, value in sorted(parts.items()):
        digest.update(f"{key}\0{value}\0".encode())
    return digest.hexdigest()[:12]


# --- the kind cluster -----------------------------------------------------------------------


def kind_config(node_image: str, *, etcd: str, workers: int = WORKERS) -> dict[str, Any]:
    """kind's Cluster: one control plane and ``workers`` workers from our node image, our ranges,
    no default CNI (the node image carries one), nothing pulled, cgroup v1 allowed."""
    patches = [
        {"kind": "ClusterConfiguration", "imageRepository": IMAGE_REPOSITORY,
         "etcd": {"local": {"imageTag": etcd}}},
        # kind skips preflight (it would pull images); CoreDNS is installed after kubeadm, serving
        # the Tailnets' hosts ConfigMap (hack/kind/cluster.py).
        {"kind": "InitConfiguration", "skipPhases": ["preflight", "addon/coredns"],
         "nodeRegistration": {"imagePullPolicy": "Never"}},
        {"kind": "JoinConfiguration", "nodeRegistration": {"imagePullPolicy": "Never"}},
        {"kind": "KubeletConfiguration", "failCgroupV1": False, "failSwapOn": False,
         "serializeImagePulls": False, "imageGCHighThresholdPercent": 100,
         "allowedUnsafeSysctls": list(POD_UNSAFE_SYSCTLS),
         "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"}},
        {"kind": "KubeProxyConfiguration",
         "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}},
    ]
    nodes = [{"role": "control-plane", "image": node_image}] + [{"role": "worker", "image": node_image}] * workers
    return {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "name": CLUSTER_NAME,
        "networking": {"ipFamily": "ipv4", "podSubnet": POD_SUBNET, "serviceSubnet": SERVICE_SUBNET,
                       "disableDefaultCNI": True, "kubeProxyMode": "nftables"},
        "nodes": nodes,
        "kubeadmConfigPatches": [yaml.safe_dump(p, sort_keys=False) for p in patches],
    }


def coredns_manifests(local: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The local node's CoreDNS (the ``hosts`` plugin over ``kube-system/tailnet-hosts``, no
    ``forward``) with kind's cluster DNS address, spread over the nodes."""
    out: list[dict[str, Any]] = json.loads(json.dumps(list(local)))
    for doc in out:
        if doc["kind"] == "Service" and doc["metadata"]["name"] == "kube-dns":
            doc["spec"]["clusterIP"] = CLUSTER_DNS
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "coredns":
            doc["spec"]["replicas"] = 2
            spec = doc["spec"]["template"]["spec"]
            spec["tolerations"] = [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]
            spec["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                  "whenUnsatisfiable": "ScheduleAnyway",
                                                  "labelSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    return out
