"""The cluster the ``cluster`` tests run against: the local node, or kind under ``make e2e``.

Both are reached through a kubeconfig and ``kubectl``; what differs is behind
:class:`ClusterUnderTest`: how a locally built image reaches the node, the address at which pods
reach a server the test runs on the host, and whether NetworkPolicy is enforced.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import textwrap
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from hack.localenv import wait_until
from hack.localenv.node import kubectl as _kubectl

EXTERNAL_KUBECONFIG = "TAILNET_E2E_KUBECONFIG"
"""Set by ``make e2e``: run the cluster tests against this cluster (kind) instead of the local node."""


TAILNETS = "tailnets.tailnet.dev"
EGRESSES = "tailnetegresses.tailnet.dev"
INGRESSES = "tailnetingresses.tailnet.dev"
SITES = "tailnetsites.tailnet.dev"
GATEWAYS = "tailnetgateways.tailnet.dev"
"""The kinds as ``kubectl`` names them."""
HOSTS = ("kube-system", "tailnet-hosts")
"""The CoreDNS hosts ConfigMap the cluster's DNS serves (namespace, name)."""
OPEN_BASE = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}\n'
"""A base policy that lets everyone reach everything; the operator adds owners and approvers."""


class Image(Protocol):
    @property
    def ref(self) -> str: ...
    @property
    def archive(self) -> Path: ...


class ClusterUnderTest(Protocol):
    @property
    def kubeconfig(self) -> Path: ...
    @property
    def host_address(self) -> str:
        """Where pods reach a server the test runs on this machine."""
    @property
    def enforces_network_policy(self) -> bool: ...
    @property
    def pods_set_forwarding(self) -> bool:
        """Whether a router pod must set IP forwarding itself (its kubelets allow those sysctls)
        rather than inherit it."""

    def load_image(self, image: Image) -> None: ...


@dataclass
class KindCluster:
    """A kind cluster made by ``make e2e`` (``python -m hack.kind``) on its own dockerd; images go
    in with ``kind load image-archive``.

    ``host_address`` is the IPv4 gateway of the kind network (the host's address there). The node
    image's CNI (ptp) enforces no NetworkPolicy: kind's kindnetd would, but it cannot be built
    here and needs the nftables ``queue`` expression this kernel lacks; a cluster that enforces
    them says so with ``TAILNET_E2E_NETWORK_POLICY=1``. A pod inherits the host's IPv4 forwarding,
    not the node's, so routers set it with their sysctls (:data:`hack.kind.plan.POD_UNSAFE_SYSCTLS`).
    """

    kubeconfig: Path
    name: str
    host_address: str
    enforces_network_policy: bool = False
    pods_set_forwarding: bool = True

    @classmethod
    def from_environment(cls) -> KindCluster:
        from hack.kind import plan

        return cls(Path(os.environ[EXTERNAL_KUBECONFIG]), os.environ.get("TAILNET_E2E_KIND_NAME", plan.CLUSTER_NAME),
                   os.environ.get("TAILNET_E2E_HOST_ADDRESS") or plan.NETWORK_GATEWAY,
                   os.environ.get("TAILNET_E2E_NETWORK_POLICY") == "1")

    def load_image(self, image: Image) -> None:
        from hack import binaries
        from hack.kind import docker

        proc = subprocess.run([str(binaries.binary("kind")), "load", "image-archive", str(image.archive),
                               "--name", self.name], env=docker.environment(), capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise AssertionError(f"kind load image-archive {image.archive} failed: {proc.stderr[-2000:]}")


def kubectl(cluster: ClusterUnderTest, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> str:
    return _kubectl(cluster.kubeconfig, *args, stdin=stdin, check=check, timeout=timeout).stdout


def get_json(cluster: ClusterUnderTest, *args: str) -> Any:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json"))


def apply(cluster: ClusterUnderTest, docs: Sequence[dict[str, Any]]) -> None:
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "--field-manager=e2e", "-f", "-",
            stdin=yaml.safe_dump_all(docs))


def admit_tenant(cluster: ClusterUnderTest, tailnet: str, namespace: str, tags: list[str],
                 dns_names: list[str] | None = None, shared_addresses: list[str] | None = None) -> None:
    """Name ``namespace`` a tenant of ``tailnet`` (spec.tenants), as the cluster admin does, with
    the tags, DNS names and shared-address ranges it may use."""
    tenant: dict[str, Any] = {"namespaces": [namespace], "tags": tags}
    if dns_names:
        tenant["dnsNames"] = dns_names
    if shared_addresses:
        tenant["sharedAddresses"] = shared_addresses
    current = get_json(cluster, TAILNETS, tailnet).get("spec", {}).get("tenants") or []
    patch = json.dumps({"spec": {"tenants": [*current, tenant]}})
    kubectl(cluster, "patch", TAILNETS, tailnet, "--type=merge", "-p", patch)
    # Admission (the installed tenancy policy) reads the Tailnet from its own cache: wait until a
    # dry run of an ingress with the first tag is admitted there.
    probe = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
             "metadata": {"name": "tenancy-probe", "namespace": namespace},
             "spec": {"tailnetRef": {"name": tailnet}, "tag": tags[0].replace("*", "probe"), "hostname": "probe",
                      "exposes": [{"name": "probe", "port": 1, "backend": {"service": "probe", "port": 1}}]}}
    wait_until(lambda: kubectl(cluster, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(probe)) or True,
               timeout=30, what=f"admission to take {namespace} as a tenant of {tailnet}")


def condition(obj: dict[str, Any], kind: str) -> str | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return str(cond["status"])
    return None


def wait_available(cluster: ClusterUnderTest, namespace: str, name: str, timeout: float = 120) -> None:
    def available() -> bool:
        return condition(get_json(cluster, "-n", namespace, "deployment", name), "Available") == "True"

    try:
        wait_until(available, timeout=timeout, what=f"deployment {namespace}/{name} Available")
    except TimeoutError as exc:
        pods = kubectl(cluster, "-n", namespace, "get", "pods", "-o", "wide", check=False)
        events = kubectl(cluster, "-n", namespace, "get", "events", "--sort-by=.lastTimestamp", check=False)
        raise AssertionError(f"{exc}\n{pods}\n{events[-3000:]}") from exc


def wait_pod_running(cluster: ClusterUnderTest, namespace: str, name: str, timeout: float = 120) -> None:
    def running() -> bool:
        pod = get_json(cluster, "-n", namespace, "pod", name)
        return condition(pod, "Ready") == "True"

    wait_until(running, timeout=timeout, what=f"pod {namespace}/{name} Ready")


def remove_tailnet(cluster: ClusterUnderTest, name: str, timeout: float = 120) -> None:
    """Delete the Tailnet ``name`` and wait until it is gone: a Tailnet left behind still holds its
    hosts ConfigMap, which the next module's Tailnet names too, so a leak fails here, where it is."""
    kubectl(cluster, "delete", TAILNETS, name, "--wait=false", "--ignore-not-found", check=False)

    def gone() -> bool:
        return not kubectl(cluster, "get", TAILNETS, name, "--ignore-not-found", "-o", "name", check=False).strip()

    try:
        wait_until(gone, timeout=timeout, what=f"Tailnet {name} deleted")
    except TimeoutError as exc:
        left = kubectl(cluster, "get", TAILNETS, name, "-o", "yaml", check=False)
        raise AssertionError(f"{exc}; it is still there:\n{left[-3000:]}") from exc


@contextmanager
def namespace(cluster: ClusterUnderTest, prefix: str, labels: dict[str, str] | None = None) -> Iterator[str]:
    """A namespace for one test, deleted (without waiting) afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}])
    wait_until(lambda: _default_service_account(cluster, name), timeout=60,
               what=f"the default ServiceAccount of {name}")
    try:
        yield name
    finally:
        kubectl(cluster, "delete", "namespace", name, "--wait=false", check=False)


def _default_service_account(cluster: ClusterUnderTest, ns: str) -> bool:
    return kubectl(cluster, "-n", ns, "get", "serviceaccount", "default", check=False) != ""


RESTRICTED_CONTAINER: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"},
}


VENV_PYTHON = "/opt/venv/bin/python"
"""The image's Python with the project's dependencies (``python3`` is Debian's, with the standard library only)."""


def python_pod(name: str, ns: str, image: str, script: str, *, labels: dict[str, str] | None = None,
               port: int | None = None, python: str = "python3") -> dict[str, Any]:
    """A pod of the project's image running a Python script (the image has no shell tools)."""
    container: dict[str, Any] = {
        "name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": [python, "-c", textwrap.dedent(script)], "securityContext": RESTRICTED_CONTAINER,
    }
    if port is not None:
        container["ports"] = [{"containerPort": port}]
        container["readinessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 1,
                     "enableServiceLinks": False}}


HTTP_SERVER = """
import http.server, socket
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("hello from " + socket.gethostname()).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Hello).serve_forever()
"""

SLEEPER = "import time\nwhile True: time.sleep(3600)\n"


def exec_python(cluster: ClusterUnderTest, ns: str, pod: str, code: str, timeout: float = 30) -> str:
    """Run Python in a pod through ``kubectl exec`` (apiserver -> kubelet -> CRI) and return stdout."""
    return kubectl(cluster, "-n", ns, "exec", pod, "--", "python3", "-c", textwrap.dedent(code), timeout=timeout)


class PythonSession:
    """Python running in a pod while a test talks to it line by line (``kubectl exec -i``): for a
    connection that must stay open across something the test does in between."""

    def __init__(self, cluster: ClusterUnderTest, ns: str, pod: str, code: str) -> None:
        from hack import binaries

        self.proc = subprocess.Popen(
            [str(binaries.binary("kubectl")), f"--kubeconfig={cluster.kubeconfig}", "-n", ns, "exec", "-i", pod,
             "--", "python3", "-u", "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(self, line: str, timeout: float = 30) -> str:
        """Send one line, return the next line the program prints (without its newline)."""
        self.send(line)
        return self.read_line(timeout)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read_line(self, timeout: float = 30) -> str:
        """The next line the program prints (without its newline)."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the program in the pod printed nothing within {timeout}s")
        answer = self.proc.stdout.readline()
        if not answer:
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"the program in the pod ended (exit {self.proc.returncode}): {err[-2000:]}")
        return answer.rstrip("\n")

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)


@contextmanager
def python_session(cluster: ClusterUnderTest, ns: str, pod: str, code: str) -> Iterator[PythonSession]:
    session = PythonSession(cluster, ns, pod, code)
    try:
        yield session
    finally:
        session.close()


def http_get_code(url: str, timeout: float = 3) -> str:
    return f"""
import urllib.request
print(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode())
"""


def operator_logs(cluster: ClusterUnderTest, namespace: str, tail: int = 60) -> str:
    """The last lines of every operator pod, each line prefixed with its pod (with two replicas,
    ``logs deployment/...`` would pick one, perhaps the one not leading)."""
    return kubectl(cluster, "-n", namespace, "logs", "--prefix", f"--tail={tail}",
                   "--selector=app.kubernetes.io/name=tailnet-operator,app.kubernetes.io/component=controller-manager",
                   check=False)


def install_operator_in_cluster(cluster: ClusterUnderTest, image_ref: str, workdir: Path) -> str:
    """``kubectl apply -k`` of an overlay that names ``image_ref``; waits for the operator to be
    Available and returns its namespace."""
    from hack.localenv.install import OPERATOR_NAMESPACE, install_operator, install_overlay

    install_operator(cluster.kubeconfig, install_overlay(workdir, image_ref))
    try:
        wait_available(cluster, OPERATOR_NAMESPACE, "tailnet-operator", timeout=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator logs:\n{operator_logs(cluster, OPERATOR_NAMESPACE, 50)}") from exc
    return OPERATOR_NAMESPACE


def apply_tailnet(cluster: ClusterUnderTest, headscale: Any, namespace: str, prefix: str) -> tuple[str, str]:
    """A Tailnet on ``headscale`` with its bootstrap Secret in ``namespace``; returns (name, Secret name)."""
    from e2e.operator import tailnet_object, unique

    name = unique(prefix)
    secret = f"{name}-bootstrap"
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": namespace},
         "stringData": {"apiKey": headscale.api_key}},
        tailnet_object(name, headscale, namespace, secret=secret),
    ])
    return name, secret
