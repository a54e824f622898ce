"""etcd + kube-apiserver + kube-controller-manager, as envtest runs them.

By default everything listens on 127.0.0.1 and kube-controller-manager runs only the garbage
collector and the namespace controller, so owner references cascade and namespaces finalize as
they do in a cluster, and nothing else acts on the objects tests create.

With ``cluster=True`` (the control plane of the local node, :mod:`hack.localenv.node`) the
apiserver listens on the node's address, which pods can reach; it authorizes kubelets with the
Node authorizer, admits pods with their ServiceAccounts, never resolves the node's name (it
dials the InternalIP), and kube-controller-manager runs the controllers workloads need.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hack import binaries

from ._pki import CertificateAuthority, KeyPair, signing_key
from ._process import ManagedProcess, free_port, wait_until

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

START_TIMEOUT = 60.0
"""Seconds each component gets to report healthy."""

SERVICE_CIDR = "198.19.128.0/24"
"""ClusterIPs: inside the benchmarking range 198.18.0.0/15, never a real network."""

CLUSTER_CONTROLLERS = (
    "garbagecollector", "namespace", "serviceaccount", "serviceaccount-token",
    "root-ca-certificate-publisher", "deployment", "replicaset", "statefulset", "daemonset", "job",
    "endpointslice", "endpointslice-mirroring", "disruption", "pod-garbage-collector", "ttl",
    "node-lifecycle", "persistentvolume-binder", "resourcequota",
)
"""What a node's workloads need from kube-controller-manager."""


class ControlPlane:
    """A kube-apiserver backed by its own etcd, with an admin kubeconfig.

    ``start()`` blocks until ``/readyz`` passes and the ``default`` namespace exists;
    ``stop()`` stops everything and is safe to call twice.
    """

    def __init__(self, workdir: Path, *, log_dir: Path, run_id: str, address: str = "127.0.0.1",
                 cluster: bool = False) -> None:
        self.workdir = workdir
        self.log_dir = log_dir
        self.run_id = run_id
        self.address = address
        self.cluster = cluster
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.port = free_port()
        self.url = f"https://{address}:{self.port}"
        self.kubeconfig = workdir / "kubeconfig"
        self.etcd: ManagedProcess | None = None
        self.apiserver: ManagedProcess | None = None
        self.controller_manager: ManagedProcess | None = None
        self._admin: KeyPair | None = None
        self._ca: CertificateAuthority | None = None

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        pki = self.workdir / "pki"
        self._ca = CertificateAuthority(pki, "kube")
        serving = self._ca.issue("apiserver", common_name="kube-apiserver", hosts=(
            "localhost", "127.0.0.1", self.address, _first_address(SERVICE_CIDR), "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local"))
        self._admin = self._ca.issue("admin", common_name="admin", organizations=("system:masters",),
                                     client=True)
        service_accounts = signing_key(pki, "service-accounts")
        self._write_kubeconfig()
        self.start_etcd()
        self.apiserver = ManagedProcess("kube-apiserver", [
            binaries.binary("kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}",
            f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self._ca.cert_path}",
            f"--service-account-issuer={self.url}/",
            f"--service-account-key-file={service_accounts.cert}",
            f"--service-account-signing-key-file={service_accounts.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            f"--cert-dir={pki}",
            *(self._cluster_apiserver_flags() if self.cluster else
              ["--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]),
        ], log_dir=self.log_dir, run_id=self.run_id)
        self.start_apiserver()
        controllers = ",".join(CLUSTER_CONTROLLERS) if self.cluster else "garbagecollector,namespace"
        self.controller_manager = ManagedProcess("kube-controller-manager", [
            binaries.binary("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--controllers={controllers}",
            "--leader-elect=false", "--secure-port=0",
            "--concurrent-gc-syncs=5",
            *([f"--service-account-private-key-file={service_accounts.key}",
               f"--root-ca-file={self._ca.cert_path}", "--use-service-account-credentials=false",
               "--node-monitor-grace-period=40s"] if self.cluster else []),
        ], log_dir=self.log_dir, run_id=self.run_id)
        self.controller_manager.start()
        return self

    def _cluster_apiserver_flags(self) -> list[str]:
        assert self._ca is not None
        kubelet_client = self._ca.issue("apiserver-kubelet-client", common_name="kube-apiserver-kubelet-client",
                                        organizations=("system:masters",), client=True)
        return [
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            # Logs and exec dial the node's InternalIP; its hostname would go to the machine's
            # resolver, which may answer with an address outside this machine.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={kubelet_client.cert}",
            f"--kubelet-client-key={kubelet_client.key}",
            "--endpoint-reconciler-type=lease",
        ]

    def issue_client(self, name: str, *, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for ``user`` (in ``groups``), with a client certificate from this plane's CA."""
        assert self._ca is not None
        pair = self._ca.issue(name, common_name=user, organizations=groups, client=True)
        path = self.workdir / f"{name}.kubeconfig"
        self._write_kubeconfig(path, user_cert=(pair.cert, pair.key))
        return path

    @property
    def ca_cert(self) -> Path:
        assert self._ca is not None
        return self._ca.cert_path

    def start_etcd(self) -> None:
        """Start (or restart) etcd on the same ports and data directory."""
        if self.etcd is None:
            peer = f"http://127.0.0.1:{self.etcd_peer_port}"
            self.etcd = ManagedProcess("etcd", [
                binaries.binary("etcd"), f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}", "--unsafe-no-fsync",
                "--log-level=warn",
            ], log_dir=self.log_dir, run_id=self.run_id)
        self.etcd.start()
        wait_until(lambda: self._etcd_healthy(), timeout=START_TIMEOUT, what="etcd /health")

    def start_apiserver(self) -> None:
        """Start (or restart, after ``stop_apiserver``) kube-apiserver and wait for readiness."""
        assert self.apiserver is not None
        self.apiserver.start()
        wait_until(lambda: self._apiserver_ready(), timeout=START_TIMEOUT, what="kube-apiserver /readyz")
        wait_until(lambda: self.request("GET", "/api/v1/namespaces/default"), timeout=START_TIMEOUT,
                   what="the default namespace")

    def extra_apiserver(self, name: str = "kube-apiserver-2") -> tuple[ManagedProcess, Path]:
        """A second kube-apiserver on the same etcd and certificates, with its own kubeconfig.

        Lets a test change objects while the first apiserver is down.
        """
        assert self.apiserver is not None
        port = free_port()
        argv = [a if not a.startswith("--secure-port=") else f"--secure-port={port}"
                for a in self.apiserver.argv[1:]]
        extra = ManagedProcess(name, [self.apiserver.argv[0], *argv], log_dir=self.log_dir,
                               run_id=self.run_id)
        extra.start()
        kubeconfig = self.workdir / f"{name}.kubeconfig"
        self._write_kubeconfig(kubeconfig, f"https://127.0.0.1:{port}")

        def ready() -> bool:
            extra.check_running()
            return bool(self.request("GET", "/readyz", base=f"https://127.0.0.1:{port}") == "ok")

        wait_until(ready, timeout=START_TIMEOUT, what=f"{name} /readyz")
        return extra, kubeconfig

    def kubeconfig_for(self, url: str, path: Path) -> Path:
        """An admin kubeconfig that reaches this control plane through ``url`` (e.g. a proxy)."""
        self._write_kubeconfig(path, url)
        return path

    def stop_apiserver(self) -> None:
        if self.apiserver is not None:
            self.apiserver.stop()

    def stop(self) -> None:
        for proc in (self.controller_manager, self.apiserver, self.etcd):
            if proc is not None:
                proc.stop()

    def compact_etcd(self) -> int:
        """Compact etcd up to its current revision, so every older resourceVersion is gone."""
        status = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{self.etcd_url}/v3/kv/range", data=json.dumps({"key": "AA=="}).encode(), method="POST"),
            timeout=10).read())
        revision = int(status["header"]["revision"])
        urllib.request.urlopen(urllib.request.Request(
            f"{self.etcd_url}/v3/kv/compaction",
            data=json.dumps({"revision": str(revision), "physical": True}).encode(), method="POST"),
            timeout=30).read()
        return revision

    def processes(self) -> list[ManagedProcess]:
        return [p for p in (self.etcd, self.apiserver, self.controller_manager) if p is not None]

    # -- access -----------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        assert self._ca is not None and self._admin is not None
        ctx = ssl.create_default_context(cafile=str(self._ca.cert_path))
        ctx.load_cert_chain(str(self._admin.cert), str(self._admin.key))
        return ctx

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", *, base: str | None = None) -> Any:
        """A minimal admin request, for readiness checks and test setup."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request((base or self.url) + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=10) as resp:
            payload = resp.read()
        return json.loads(payload) if payload.startswith(b"{") else payload.decode()

    def api_client(self) -> ApiClient:
        """A synchronous ``kubernetes`` client bound to this control plane's admin user."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    # -- internals --------------------------------------------------------------------------

    def _etcd_healthy(self) -> bool:
        assert self.etcd is not None
        self.etcd.check_running()
        with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")

    def _apiserver_ready(self) -> bool:
        assert self.apiserver is not None
        self.apiserver.check_running()
        return bool(self.request("GET", "/readyz") == "ok")

    def _write_kubeconfig(self, path: Path | None = None, server: str | None = None,
                          user_cert: tuple[Path, Path] | None = None) -> None:
        assert self._ca is not None and self._admin is not None
        path = path or self.kubeconfig
        cert, key = user_cert or (self._admin.cert, self._admin.key)
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "tailnet-local",
            "clusters": [{"name": "tailnet-local", "cluster": {
                "server": server or self.url, "certificate-authority-data": b64encode(self._ca.pem).decode()}}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": b64encode(cert.read_bytes()).decode(),
                "client-key-data": b64encode(key.read_bytes()).decode()}}],
            "contexts": [{"name": "tailnet-local", "context": {"cluster": "tailnet-local", "user": "admin"}}],
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)


def _first_address(cidr: str) -> str:
    """The ClusterIP of the ``kubernetes`` Service: the first address of the Service range."""
    return str(next(ipaddress.ip_network(cidr).hosts()))
