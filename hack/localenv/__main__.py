"""``make run``: the local environment plus the operator, in the foreground until Ctrl-C.

It starts a control plane and a Headscale under ``_artifacts/localenv`` (or
``$TAILNET_LOCALENV_DIR``), installs the CRDs and the samples (the sample Tailnet pointed at
the local Headscale), runs ``tailnet-operator`` against that control plane only, and stops
everything on exit. A cluster configured elsewhere (``$KUBECONFIG``, ``~/.kube/config``) is
never read or written: the operator gets this environment's kubeconfig explicitly.
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
from tailnet_operator.api.crds import install_crds, load_samples

from . import ControlPlane, Environment, EnvironmentStartError, Headscale, default_root

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

SAMPLE_NAMESPACES = {"TailnetEgress": OPERATOR_NAMESPACE, "TailnetIngress": "default"}
"""Where the namespaced samples go: egresses live in the operator's namespace."""

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


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)  # stop everything as Ctrl-C does
    root = default_root()
    if root.exists():
        shutil.rmtree(root)
    env = Environment(root, run_id=f"localenv-{os.getpid()}")
    operator: subprocess.Popen[bytes] | None = None
    try:
        print("starting etcd, kube-apiserver and kube-controller-manager ...", flush=True)
        plane = env.control_plane()
        print("starting Headscale ...", flush=True)
        headscale = env.headscale("headscale")
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
        bin_dir = _link_kubectl(env)

        print(f"""
local environment ready (state and logs: {env.root})
  kubeconfig:      {plane.kubeconfig}
  kube-apiserver:  {plane.url}
  Headscale:       {headscale.url}  (CA: {headscale.ca_bundle}; bootstrap key in {key_file})
  component logs:  {env.log_dir}
  operator:        http://{METRICS_ADDRESS}/metrics, http://{PROBES_ADDRESS}/readyz

look at the samples from another shell:
  export KUBECONFIG={plane.kubeconfig} PATH={bin_dir}:$PATH
  kubectl get tailnet          # every kind of the project (category 'tailnet')
  kubectl get tailnets,tailnetsites,tailnetgateways
  kubectl get tailnetegresses,tailnetingresses -A
  kubectl explain tailnetegress.spec

running tailnet-operator against this environment; Ctrl-C stops everything.
""", flush=True)
        operator = subprocess.Popen([sys.executable, "-m", "tailnet_operator", "--kubeconfig",
                                     str(plane.kubeconfig), "--metrics-bind-address", METRICS_ADDRESS,
                                     "--health-probe-bind-address", PROBES_ADDRESS], cwd=REPO)
        while operator.poll() is None:
            for proc in env_processes(plane, headscale):
                proc.check_running()
            time.sleep(1)
        return operator.returncode or 0
    except KeyboardInterrupt:
        return 0
    except EnvironmentStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(15)
            except subprocess.TimeoutExpired:
                operator.kill()
        print("stopping the local environment ...", flush=True)
        env.close()


def env_processes(plane: ControlPlane, headscale: Headscale) -> list[Any]:
    return [*plane.processes(), headscale.process]


if __name__ == "__main__":
    sys.exit(main())
