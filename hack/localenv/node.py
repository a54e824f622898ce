"""A real single-node Kubernetes cluster on this machine, built from source: the local
environment's answer to kind where there is no Docker.

:class:`Cluster` starts, in order:

1. the host side (:mod:`.hostnet`): the node address 198.19.0.1 on an empty bridge, the
   ``unreachable`` route over 198.19.0.0/16, IP forwarding and the pod guard;
2. a :class:`ControlPlane` in cluster mode listening on the node address;
3. containerd (CRI, overlayfs, runc with the cgroupfs driver), with the pause and CoreDNS images
   imported from OCI archives (nothing is ever pulled from a registry);
4. kubelet (registered Node ``tailnet-node``, cgroup v1 allowed, the machine's resolver never
   handed to pods), kube-scheduler and kube-proxy (nftables mode);
5. CoreDNS as a Deployment in kube-system: the ``kubernetes`` plugin for cluster.local and a
   ``hosts`` plugin over the ``kube-system/tailnet-hosts`` ConfigMap; no ``forward``, so no name
   is ever sent to the machine's resolver.

``stop()`` kills every container, stops every process, unmounts and removes everything the node
wrote and restores the host (sysctls, routes, links, nftables, host paths); ``leftovers()`` lists
whatever survived, for the tests' leak check. Only one local node can run on a machine at a time:
its addresses are fixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from hack import binaries

from . import hostnet
from ._process import ManagedProcess, free_port, socket_dir, wait_until
from .controlplane import SERVICE_CIDR, ControlPlane

NODE_NAME = "tailnet-node"
CLUSTER_DNS = "198.19.128.10"
CLUSTER_DOMAIN = "cluster.local"
HOSTS_CONFIG_MAP = ("kube-system", "tailnet-hosts")
"""The ConfigMap whose ``hosts`` key CoreDNS serves (the DNS reconciler's output)."""
CRI_NAMESPACE = "k8s.io"
START_TIMEOUT = 120.0

Loader = Callable[[], Any]


class Node:
    """containerd, kubelet, kube-scheduler and kube-proxy for one control plane."""

    def __init__(self, workdir: Path, plane: ControlPlane, *, log_dir: Path, run_id: str) -> None:
        self.workdir = workdir
        self.plane = plane
        self.log_dir = log_dir
        self.run_id = run_id
        # containerd refuses a socket path over 104 bytes; see ``socket_dir``.
        self.socket_dir = socket_dir("tnode-")
        self.socket = self.socket_dir / "containerd.sock"
        self.processes: list[ManagedProcess] = []
        self.containerd: ManagedProcess | None = None
        self.pause_ref = ""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, pause_image: Any) -> Node:
        """Start the runtime, import the pause image, then the node agents."""
        self.pause_ref = pause_image.ref
        self._start_containerd()
        self.import_image(pause_image.archive)
        self._start_kubelet()
        self._start_scheduler()
        self._start_kube_proxy()
        wait_until(self._node_ready, timeout=START_TIMEOUT, what=f"node {NODE_NAME} Ready")
        return self

    def stop(self) -> None:
        """Stop everything; containers first, so no shim or container outlives the node."""
        for proc in reversed(self.processes):
            if proc is not self.containerd:
                proc.stop()
        if self.containerd is not None and self.containerd.running():
            self._remove_all_containers()
        if self.containerd is not None:
            self.containerd.stop()
        self._kill_shims()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        hostnet.unmount_all(self.workdir)
        for cgroup in hostnet.cgroup_dirs("kubepods"):
            hostnet.remove_cgroup_tree(cgroup)

    # -- images -----------------------------------------------------------------------------

    def import_image(self, archive: Path) -> None:
        """Import an OCI archive into the CRI namespace (``ctr images import``)."""
        self.ctr("images", "import", "--all-platforms", str(archive))

    def images(self) -> list[str]:
        return [line.split()[0] for line in self.ctr("images", "ls").splitlines()[1:] if line.strip()]

    def ctr(self, *args: str) -> str:
        proc = subprocess.run([str(binaries.binary("ctr")), "--address", str(self.socket), "-n", CRI_NAMESPACE,
                               *args], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    # -- components -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: Sequence[str | os.PathLike[str]],
               env: dict[str, str] | None = None) -> ManagedProcess:
        proc = ManagedProcess(name, argv, log_dir=self.log_dir, run_id=self.run_id, env=env, group=hostnet.NODE_GID)
        self.processes.append(proc)
        proc.start()
        return proc

    def _start_containerd(self) -> None:
        base = self.workdir / "containerd"
        base.mkdir(parents=True, exist_ok=True)
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-tailnet-local.conflist").write_text(json.dumps(cni_config(self.workdir / "cni" / "ipam")))
        config = base / "config.toml"
        config.write_text(containerd_config(base, cni_conf, self.pause_ref, sockets=self.socket_dir,
                                            cni_bin=binaries.binary("bridge").parent,
                                            runc=binaries.binary("runc")))
        path = f"{binaries.binary('containerd').parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.containerd = self._spawn("containerd", [binaries.binary("containerd"), "--config", config],
                                      env={"PATH": path})
        wait_until(self._containerd_serving, timeout=START_TIMEOUT, what="containerd")

    def _containerd_serving(self) -> bool:
        assert self.containerd is not None
        self.containerd.check_running()
        return self.socket.exists() and bool(self.ctr("version"))

    def _start_kubelet(self) -> None:
        root = self.workdir / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("# pods with dnsPolicy Default get no resolver from this machine\n")
        config = self.workdir / "kubelet-config.yaml"
        config.write_text(yaml.safe_dump(kubelet_config(
            ca=self.plane.ca_cert, resolv_conf=resolv, socket=self.socket, pod_logs=self.workdir / "pod-logs",
            port=free_port(), healthz_port=free_port())))
        kubeconfig = self.plane.issue_client("kubelet", user=f"system:node:{NODE_NAME}", groups=("system:nodes",))
        self._spawn("kubelet", [
            binaries.binary("kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--cert-dir={root / 'pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={hostnet.NODE_IP}", "--v=1",
        ])

    def _start_scheduler(self) -> None:
        kubeconfig = self.plane.issue_client("kube-scheduler", user="system:kube-scheduler")
        self._spawn("kube-scheduler", [
            binaries.binary("kube-scheduler"), f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        ])

    def _start_kube_proxy(self) -> None:
        kubeconfig = self.plane.issue_client("kube-proxy", user="system:kube-proxy")
        config = self.workdir / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump(kube_proxy_config(kubeconfig, free_port(), free_port())))
        self._spawn("kube-proxy", [binaries.binary("kube-proxy"), f"--config={config}", "--v=1"])

    def _node_ready(self) -> bool:
        for proc in self.processes:
            proc.check_running()
        node = self.plane.request("GET", f"/api/v1/nodes/{NODE_NAME}")
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True"

    # -- teardown ---------------------------------------------------------------------------

    def _remove_all_containers(self) -> None:
        with contextlib.suppress(Exception):
            for line in self.ctr("tasks", "ls").splitlines()[1:]:
                task = line.split()[0]
                with contextlib.suppress(Exception):
                    self.ctr("tasks", "kill", "--signal", "SIGKILL", task)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                    "RUNNING" in line for line in self.ctr("tasks", "ls").splitlines()[1:]):
                time.sleep(0.1)
            for line in self.ctr("tasks", "ls").splitlines()[1:]:
                with contextlib.suppress(Exception):
                    self.ctr("tasks", "delete", "--force", line.split()[0])
            for line in self.ctr("containers", "ls", "-q").splitlines():
                with contextlib.suppress(Exception):
                    self.ctr("containers", "delete", line.strip())

    def _kill_shims(self) -> None:
        """Shims are started by containerd with its environment, so they carry the run marker."""
        from ._process import marked_processes

        for pid, cmdline in marked_processes(self.run_id):
            if "containerd-shim" in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)


class Cluster:
    """The host network, a control plane in cluster mode, a node, and CoreDNS."""

    host_address = hostnet.NODE_IP
    """Where pods reach a server on this machine: the node address (bind the server there)."""
    enforces_network_policy = False
    """No enforcer works on this kernel (no nftables ``queue``); policies are checked with cyclonus."""
    pods_set_forwarding = False
    """The host network turns IPv4 forwarding on, and the node's pods inherit it."""

    def __init__(self, workdir: Path, *, log_dir: Path, run_id: str) -> None:
        self.workdir = workdir
        self.log_dir = log_dir
        self.run_id = run_id
        self.host = hostnet.HostNetwork()
        self.plane: ControlPlane | None = None
        self.node: Node | None = None
        self.timings: dict[str, float] = {}
        self._stopped: list[str] | None = None

    @property
    def kubeconfig(self) -> Path:
        assert self.plane is not None
        return self.plane.kubeconfig

    def start(self) -> Cluster:
        from hack import image

        started = time.monotonic()
        try:
            self.host.setup(run_id=self.run_id, workdir=self.workdir, reclaim=reclaim_killed_run)
            self.plane = ControlPlane(self.workdir / "controlplane", log_dir=self.log_dir, run_id=self.run_id,
                                      address=hostnet.NODE_IP, cluster=True, group=hostnet.NODE_GID).start()
            self.timings["control plane"] = time.monotonic() - started
            mark = time.monotonic()
            self.node = Node(self.workdir / "node", self.plane, log_dir=self.log_dir, run_id=self.run_id)
            self.node.start(image.pause_image())
            self.timings["node Ready"] = time.monotonic() - mark
            mark = time.monotonic()
            self._start_coredns(image.coredns_image())
            self.timings["CoreDNS Available"] = time.monotonic() - mark
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Tear everything down; ``leftovers()`` says what, if anything, survived.

        What survived is read before the host is handed to the next local node (the lock is
        released last), so another run's node is never mistaken for ours."""
        if self._stopped is not None:
            return
        if self.node is not None:
            self.node.stop()
        if self.plane is not None:
            self.plane.stop()
        shutil.rmtree(self.workdir / "node", ignore_errors=True)
        self._stopped = self._local_leftovers() + self.host.restore()

    def leftovers(self) -> list[str]:
        """What the node left on the host (after ``stop()``), or what it holds now (before)."""
        if self._stopped is not None:
            return list(self._stopped)
        return self.host.leftovers() + self._local_leftovers()

    def _local_leftovers(self) -> list[str]:
        """Mounts under the node's directory and kubelet's cgroups."""
        return [*(f"mount {m}" for m in hostnet.mounts_under(self.workdir)),
                *(f"cgroup {c}" for c in hostnet.cgroup_dirs("kubepods"))]

    # -- workloads --------------------------------------------------------------------------

    def load_image(self, image: Any) -> None:
        """Make a locally built image available to pods (as ``kind load`` does)."""
        assert self.node is not None
        self.node.import_image(image.archive)

    def apply(self, docs: Sequence[dict[str, Any]]) -> None:
        kubectl(self.kubeconfig, "apply", "--server-side", "--force-conflicts", "--field-manager=tailnet-localenv",
                "-f", "-", stdin=yaml.safe_dump_all(docs))

    def _start_coredns(self, coredns: Any) -> None:
        self.load_image(coredns)
        self.apply(coredns_manifests(coredns.ref))
        wait_until(lambda: deployment_available(self.kubeconfig, "kube-system", "coredns"),
                   timeout=START_TIMEOUT, what="the CoreDNS Deployment to be Available")


# -- pure builders --------------------------------------------------------------------------------


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    """A bridge network on 198.19.64.0/24; pods route only 198.18.0.0/15, never a default route."""
    return {
        "cniVersion": "1.0.0", "name": "tailnet-local",
        "plugins": [
            {"type": "bridge", "bridge": hostnet.POD_BRIDGE, "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                      "ranges": [[{"subnet": hostnet.POD_CIDR, "gateway": hostnet.POD_GATEWAY}]],
                      "routes": [{"dst": hostnet.SAFE_RANGE}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}, "backend": "nftables"},
        ],
    }


def containerd_config(base: Path, cni_conf: Path, pause_ref: str, *, cni_bin: Path, runc: Path,
                      sockets: Path | None = None) -> str:
    """containerd 2.x configuration (version 3): its own root, state, socket and CNI; runc with
    cgroupfs; the local pause image pinned; OOM score only ever raised (the VM withholds
    CAP_SYS_RESOURCE, so lowering it fails)."""
    sockets = sockets or base
    return f"""version = 3
root = "{base / 'root'}"
state = "{base / 'state'}"

[grpc]
  address = "{sockets / 'containerd.sock'}"

[ttrpc]
  address = "{sockets / 'containerd.sock.ttrpc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / 'opt'}"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause_ref}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def kubelet_config(*, ca: Path, resolv_conf: Path, socket: Path, pod_logs: Path, port: int,
                   healthz_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This kernel binds every controller to cgroup v1; kubelet 1.36 runs there only when asked.
        "failCgroupV1": False, "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{socket}",
        "address": hostnet.NODE_IP, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"x509": {"clientCAFile": str(ca)}, "webhook": {"enabled": True},
                           "anonymous": {"enabled": False}},
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [CLUSTER_DNS],
        "resolvConf": str(resolv_conf),
        "podLogsDir": str(pod_logs),
        "failSwapOn": False,
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "staticPodPath": "",
        "maxPods": 60,
    }


def kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "nftables", "hostnameOverride": NODE_NAME,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "clusterCIDR": hostnet.POD_CIDR,
        "bindAddress": hostnet.NODE_IP,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "nodePortAddresses": [f"{hostnet.NODE_IP}/32"],
        # Leave the host's conntrack table size and timeouts as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


COREFILE = f""".:5353 {{
    errors
    health :8080
    ready :8181
    hosts /etc/coredns/hosts/hosts {{
        reload 2s
        fallthrough
    }}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{
        pods insecure
        fallthrough in-addr.arpa
    }}
    cache 5 {{
        disable denial
    }}
}}
"""
"""Cluster DNS with no ``forward``: a name that is neither the cluster's nor in the hosts file
gets an error, never a trip to the machine's resolver."""


def coredns_manifests(image_ref: str) -> list[dict[str, Any]]:
    ns = "kube-system"
    labels = {"k8s-app": "kube-dns"}
    hosts_ns, hosts_name = HOSTS_CONFIG_MAP
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": ns}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "coredns", "namespace": ns},
         "data": {"Corefile": COREFILE}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": hosts_name, "namespace": hosts_ns},
         "data": {"hosts": "# names the DNS reconciler writes\n"}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "coredns", "namespace": ns,
                                                                      "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {
                 "serviceAccountName": "coredns", "dnsPolicy": "Default",
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{
                     "name": "coredns", "image": image_ref, "imagePullPolicy": "Never",
                     "args": ["-conf", "/etc/coredns/config/Corefile"],
                     "ports": [{"name": "dns", "containerPort": 5353, "protocol": "UDP"},
                               {"name": "dns-tcp", "containerPort": 5353, "protocol": "TCP"}],
                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
                     "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 10},
                     "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns/config", "readOnly": True},
                                      {"name": "hosts", "mountPath": "/etc/coredns/hosts", "readOnly": True}],
                 }],
                 "volumes": [
                     {"name": "config", "configMap": {"name": "coredns"}},
                     {"name": "hosts", "configMap": {"name": hosts_name, "optional": True}},
                 ],
             }}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
         "spec": {"selector": labels, "clusterIP": CLUSTER_DNS, "ports": [
             {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "targetPort": 5353, "protocol": "TCP"}]}},
    ]


# -- kubectl helpers --------------------------------------------------------------------------------


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(binaries.binary("kubectl")), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, input=stdin, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args[:3])} failed: {proc.stderr.strip()}")
    return proc


def deployment_available(kubeconfig: Path, namespace: str, name: str) -> bool:
    out = kubectl(kubeconfig, "-n", namespace, "get", "deployment", name, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def cleanup() -> list[str]:
    """Undo what a local node that was killed before its teardown left on the host: its
    processes (they carry the run's marker), containers, mounts, cgroups and host changes."""
    lock = hostnet._acquire(hostnet.LOCK, 10)  # a live node holds it: never clean under one
    try:
        return reclaim_killed_run()
    finally:
        os.close(lock)


def reclaim_killed_run() -> list[str]:
    """:func:`cleanup`'s work, for a caller that holds the host's lock (a node starting after a
    killed one); what is still on the host afterwards."""
    from ._process import marked_processes

    record = hostnet.HostNetwork.from_record()
    if record is None:
        return ["no record of a local node on this host"]
    host, run_id, workdir = record
    if run_id:
        for pid, _ in marked_processes(run_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    for cgroup in hostnet.cgroup_dirs("kubepods"):
        hostnet.remove_cgroup_tree(cgroup)
    if workdir is not None:
        hostnet.unmount_all(workdir)
    left = host.restore()
    if not left:
        print(f"local node: cleaned up what run {run_id or '(unnamed)'} left, killed before its teardown",
              file=sys.stderr, flush=True)
    return left


__all__ = ["CLUSTER_DNS", "HOSTS_CONFIG_MAP", "NODE_NAME", "SERVICE_CIDR", "Cluster", "Node", "kubectl"]

