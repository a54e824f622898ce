"""etcd + kube-apiserver + kube-controller-manager on 127.0.0.1, as envtest runs them.

kube-controller-manager runs only the garbage collector and the namespace controller, so
owner references cascade and namespaces finalize as they do in a cluster.
"""

from __future__ import annotations

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


class ControlPlane:
    """A kube-apiserver backed by its own etcd, with an admin kubeconfig.

    ``start()`` blocks until ``/readyz`` passes and the ``default`` namespace exists;
    ``stop()`` stops everything and is safe to call twice.
    """

    def __init__(self, workdir: Path, *, log_dir: Path, run_id: str) -> None:
        self.workdir = workdir
        self.log_dir = log_dir
        self.run_id = run_id
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
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
        serving = self._ca.issue("apiserver", common_name="kube-apiserver",
                                 hosts=("localhost", "127.0.0.1", "kubernetes.default.svc"))
        self._admin = self._ca.issue("admin", common_name="admin", organizations=("system:masters",),
                                     client=True)
        service_accounts = signing_key(pki, "service-accounts")
        self._write_kubeconfig()
        self.start_etcd()
        self.apiserver = ManagedProcess("kube-apiserver", [
            binaries.binary("kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self._ca.cert_path}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.url}/",
            f"--service-account-key-file={service_accounts.cert}",
            f"--service-account-signing-key-file={service_accounts.key}",
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount",
            "--enable-priority-and-fairness=false",
            f"--cert-dir={pki}",
        ], log_dir=self.log_dir, run_id=self.run_id)
        self.start_apiserver()
        self.controller_manager = ManagedProcess("kube-controller-manager", [
            binaries.binary("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            "--controllers=garbagecollector,namespace",
            "--leader-elect=false", "--secure-port=0",
            "--concurrent-gc-syncs=5",
        ], log_dir=self.log_dir, run_id=self.run_id)
        self.controller_manager.start()
        return self

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

    def _write_kubeconfig(self, path: Path | None = None, server: str | None = None) -> None:
        assert self._ca is not None and self._admin is not None
        path = path or self.kubeconfig
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "tailnet-local",
            "clusters": [{"name": "tailnet-local", "cluster": {
                "server": server or self.url, "certificate-authority-data": b64encode(self._ca.pem).decode()}}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": b64encode(self._admin.cert.read_bytes()).decode(),
                "client-key-data": b64encode(self._admin.key.read_bytes()).decode()}}],
            "contexts": [{"name": "tailnet-local", "context": {"cluster": "tailnet-local", "user": "admin"}}],
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
