"""`make run`'s environment: it comes up with the CRDs and samples, and Ctrl-C stops all of it.

This runs the fast loop (``TAILNET_LOCALENV_NODE=0``: control plane only, operator from the source
tree): one local node runs per machine and the test session's ``cluster`` may hold it. The node
and the in-cluster install that ``make run`` uses by default are the ``cluster`` tests' own
(``Cluster``, ``install_operator``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hack.localenv import free_port, marked_processes, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


def test_local_environment_serves_the_samples_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    from kubernetes import client, config

    probes = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "TAILNET_LOCALENV_DIR": str(tmp_path / "localenv"),
           "KUBECONFIG": str(tmp_path / "must-not-be-touched"), "TAILNET_LOCALENV_NODE": "0",
           "TAILNET_LOCALENV_PROBES": probes, "TAILNET_LOCALENV_METRICS": f"127.0.0.1:{free_port()}"}
    proc = subprocess.Popen([sys.executable, "-m", "hack.localenv"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(output)
        assert "Ctrl-C stops everything" in text, text
        kubeconfig = next(line.split(":", 1)[1].strip() for line in output if "kubeconfig:" in line)

        api = client.ApiClient(config.new_client_from_config(config_file=kubeconfig).configuration)
        custom = client.CustomObjectsApi(api)
        tailnets = custom.list_cluster_custom_object("tailnet.dev", "v1alpha1", "tailnets")["items"]
        assert [t["metadata"]["name"] for t in tailnets] == ["headscale"]
        assert tailnets[0]["spec"]["loginURL"].startswith("https://127.0.0.1:")
        egresses = custom.list_namespaced_custom_object("tailnet.dev", "v1alpha1", "tailnet-system",
                                                        "tailnetegresses")["items"]
        assert len(egresses) == 1

        wait_until(lambda: _ready(f"http://{probes}/readyz"), timeout=30, what="the operator's /readyz")

        def tailnet_ready() -> bool:
            obj = custom.get_cluster_custom_object("tailnet.dev", "v1alpha1", "tailnets", "headscale")
            conditions = (obj.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        wait_until(tailnet_ready, timeout=60, what="the sample Tailnet to be Ready against the local Headscale")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, "".join(output[-20:])
    assert not (tmp_path / "must-not-be-touched").exists()
    assert list(marked_processes(f"localenv-{proc.pid}")) == []


def _ready(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.read() == b"ok")
