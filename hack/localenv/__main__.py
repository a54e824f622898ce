"""``make run``: the local environment plus the operator, in the foreground until Ctrl-C.

Under ``_artifacts/localenv`` (or ``$TAILNET_LOCALENV_DIR``) it starts the local single-node
cluster (:mod:`hack.localenv.node`, needs root) and a Headscale that pods reach, builds the
project's image and loads it into the node, installs the operator with ``kubectl apply -k
manifests/`` as a user would, applies the samples (the sample Tailnet pointed at the local
Headscale) and follows the operator's logs. Ctrl-C tears everything down.

``$TAILNET_RUN_OPERATOR=source`` (``make run OPERATOR=source``) keeps the fast loop: the
operator runs from the source tree against the same local cluster, with no image build.
``$TAILNET_LOCALENV_NODE=0``, or a machine where the node cannot run (not root), starts only
etcd, kube-apiserver and kube-controller-manager, with the operator from the source tree.

A cluster configured elsewhere (``$KUBECONFIG``, ``~/.kube/config``) is never read or written:
every command gets this environment's kubeconfig explicitly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hack import binaries
from hack.crds import install_crds, load_samples

from . import Cluster, ControlPlane, Environment, EnvironmentStartError, Headscale, default_root, wait_until
from .hostnet import HostNetwork
from .install import install_operator, install_overlay, operator_available

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "tailnet-system"
BOOTSTRAP_SECRET = "headscale-bootstrap"


def _apply(plane: ControlPlane, docs: list[dict[str, Any]]) -> None:
    from kubernetes import dynamic

    client = dynamic.DynamicClient(plane.api_client())
    for doc in docs:
        resource = client.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        namespace = doc["metadata"].get("namespace") or ("default" if resource.namespaced else None)
        client.server_side_apply(resource, body=doc, name=doc["metadata"]["name"], namespace=namespace,
                                 field_manager="tailnet-localenv", force_conflicts=True)


METRICS_ADDRESS = os.environ.get("TAILNET_LOCALENV_METRICS", "127.0.0.1:8080")
PROBES_ADDRESS = os.environ.get("TAILNET_LOCALENV_PROBES", "127.0.0.1:8081")
"""Where the operator serves /metrics and /healthz, /readyz; override when the ports are taken."""

SAMPLE_NAMESPACES = {"TailnetEgress": OPERATOR_NAMESPACE, "TailnetIngress": "monitoring"}
"""Where the namespaced samples go: egresses live in the operator's namespace, the ingress in the
namespace the sample Tailnet names as its tenant."""

BASE_POLICY = """// The base policy the sample Tailnet renders on top of (HuJSON: comments allowed).
{
  "groups": {"group:platform": []},
  "tagOwners": {},
  "grants": [],
}
"""


def _point_samples_at(headscale: Headscale, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aim the sample Tailnet at the local Headscale and its bootstrap Secret."""
    for doc in samples:
        if doc["kind"] in SAMPLE_NAMESPACES:
            doc["metadata"].setdefault("namespace", SAMPLE_NAMESPACES[doc["kind"]])
        if doc["kind"] == "Tailnet":
            spec = doc["spec"]
            spec["loginURL"] = headscale.url
            spec.pop("apiURL", None)
            spec["caBundle"] = headscale.ca_bundle.read_text()
            spec.pop("caSecretRef", None)
            spec["bootstrapKeySecretRef"] = {"namespace": OPERATOR_NAMESPACE, "name": BOOTSTRAP_SECRET,
                                             "key": "apiKey"}
    return samples


def _link_kubectl(env: Environment) -> Path:
    bin_dir = env.root / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "kubectl"
    link.unlink(missing_ok=True)
    link.symlink_to(binaries.binary("kubectl"))
    return bin_dir


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wants_node() -> str | None:
    """None when the local node should run, else why not."""
    if os.environ.get("TAILNET_LOCALENV_NODE", "1") == "0":
        return "TAILNET_LOCALENV_NODE=0"
    return HostNetwork.available()


def _prepare(plane: ControlPlane, headscale: Headscale, env: Environment) -> Path:
    """CRDs, the operator's namespace and Secrets, the samples; returns the bootstrap key file."""
    key_file = env.root / "headscale-bootstrap-key"
    key_file.write_text(headscale.api_key)
    key_file.chmod(0o600)
    install_crds(plane.api_client())
    _apply(plane, [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": BOOTSTRAP_SECRET, "namespace": OPERATOR_NAMESPACE},
         "stringData": {"apiKey": headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "tailnet-policy-base", "namespace": OPERATOR_NAMESPACE},
         "data": {"policy.hujson": BASE_POLICY}},
    ])
    samples = _point_samples_at(headscale, load_samples())
    _apply(plane, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                   for ns in sorted({d["metadata"]["namespace"] for d in samples
                                     if d["metadata"].get("namespace")})])
    _apply(plane, samples)
    return key_file


def _install_in_cluster(cluster: Cluster, env: Environment, prebuild: subprocess.Popen[bytes] | None) -> None:
    from hack import image

    print("building the project's image (cached by content) ...", flush=True)
    if prebuild is not None:
        prebuild.wait()  # then cached, or built (and its error told) below
    built = image.project_image()
    cluster.load_image(built)
    install_operator(cluster.kubeconfig, install_overlay(env.root / "install", built.ref))
    print("waiting for the operator's Deployment ...", flush=True)
    wait_until(lambda: operator_available(cluster.kubeconfig), timeout=180,
               what="the tailnet-operator Deployment to be Available")


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)  # stop everything as Ctrl-C does
    root = default_root()
    if root.exists():
        shutil.rmtree(root)
    env = Environment(root, run_id=f"localenv-{os.getpid()}")
    operator: subprocess.Popen[bytes] | None = None
    prebuild: subprocess.Popen[bytes] | None = None
    from_source = os.environ.get("TAILNET_RUN_OPERATOR", "cluster") == "source"
    try:
        no_node = _wants_node()
        if no_node is None and not from_source:
            from hack import image

            # The image does not need the binaries: it builds while they do, or while the node starts.
            prebuild = image.build_in_background(env.log_dir / "image-build.log", "project")
        cluster: Cluster | None = None
        if no_node is None:
            print("starting the local node: control plane, containerd, kubelet, kube-proxy, CoreDNS ...", flush=True)
            cluster = env.cluster()
            assert cluster.plane is not None
            plane = cluster.plane
            print("starting Headscale ...", flush=True)
            headscale = env.headscale("headscale", address=cluster.host_address)
        else:
            print(f"no local node ({no_node}): etcd, kube-apiserver and kube-controller-manager only", flush=True)
            from_source = True
            plane = env.control_plane()
            print("starting Headscale ...", flush=True)
            headscale = env.headscale("headscale")
        key_file = _prepare(plane, headscale, env)
        if cluster is not None and not from_source:
            _install_in_cluster(cluster, env, prebuild)
        bin_dir = _link_kubectl(env)
        where = "from the source tree" if from_source else "in the cluster (kubectl -n tailnet-system logs follows)"
        print(f"""
local environment ready (state and logs: {env.root})
  kubeconfig:      {plane.kubeconfig}
  kube-apiserver:  {plane.url}
  Headscale:       {headscale.url}  (CA: {headscale.ca_bundle}; bootstrap key in {key_file})
  component logs:  {env.log_dir}
  operator:        {where}{f", http://{METRICS_ADDRESS}/metrics, http://{PROBES_ADDRESS}/readyz" if from_source else ""}

look at the samples from another shell:
  export KUBECONFIG={plane.kubeconfig} PATH={bin_dir}:$PATH
  kubectl get tailnet          # every kind of the project (category 'tailnet')
  kubectl get tailnets,tailnetsites,tailnetgateways
  kubectl get tailnetegresses,tailnetingresses -A
  kubectl explain tailnetegress.spec

running tailnet-operator; Ctrl-C stops everything.
""", flush=True)
        if from_source:
            operator = subprocess.Popen([sys.executable, "-m", "tailnet_operator", "--kubeconfig",
                                         str(plane.kubeconfig), "--metrics-bind-address", METRICS_ADDRESS,
                                         "--health-probe-bind-address", PROBES_ADDRESS], cwd=REPO)
        else:
            operator = subprocess.Popen([str(binaries.binary("kubectl")), f"--kubeconfig={plane.kubeconfig}",
                                         "-n", OPERATOR_NAMESPACE, "logs", "-f", "deployment/tailnet-operator"])
        watched = [*plane.processes(), headscale.process, *(cluster.node.processes if cluster and cluster.node else [])]
        while operator.poll() is None:
            for proc in watched:
                proc.check_running()
            time.sleep(1)
        return operator.returncode or 0
    except KeyboardInterrupt:
        return 0
    except EnvironmentStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if prebuild is not None:
            from hack import image

            image.stop_background(prebuild)
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(15)
            except subprocess.TimeoutExpired:
                operator.kill()
        print("stopping the local environment ...", flush=True)
        env.close()


def cleanup_main() -> int:
    """``python -m hack.localenv cleanup``: undo a local node that was killed before its teardown."""
    from .node import cleanup

    left = cleanup()
    print("\n".join(left) if left else "the host is clean")
    return 1 if left and left != ["no record of a local node on this host"] else 0


if __name__ == "__main__":
    sys.exit(cleanup_main() if sys.argv[1:] == ["cleanup"] else main())
