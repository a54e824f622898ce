"""``tailnet-operator status|diagnose|check`` as a user runs them, against the test kube-apiserver,
a real Headscale, a tailscaled subnet router and a real agent process.

The operator's controllers run in this process (e2e/operator.py). The control plane has no
kubelet: the agent runs as a process here, joined with the pre-auth key the operator made, and
the test writes its Pod's status as kubelet would. One egress is walked through every state:
tag not owned, route not approved, no grant, healthy (and diagnose and check on it), agent
down, Headscale unreachable.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import TailscaleFactory
from e2e.operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object, unique
from e2e.polling import eventually
from hack.localenv import Environment, Headscale, ManagedProcess, free_port
from hack.localenv.controlplane import ControlPlane
from tailnet_agent.contract import environment as env_names
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import AlreadyExists, NotFound
from tailnet_operator.runtime.kinds import NAMESPACE, SECRET, Resource

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
POD = Resource("", "v1", "pods", "Pod")
TAG = "tag:egress-cli"
ROUTER_TAG = "tag:router-cli"
SITE = "198.18.77.0/24"
TARGET = "198.18.77.10"


def cli(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The entry point as installed (`tailnet-operator status ...`), a process of its own."""
    return subprocess.run([sys.executable, "-m", "tailnet_operator", *args, f"--kubeconfig={kubeconfig}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def first_cause(stdout: str) -> str:
    """The cause the report puts first (the root of the chain's failures), or ""."""
    if "Problems:" not in stdout:
        return ""
    line = stdout.split("Problems:", 1)[1].strip().splitlines()[0]
    return line.removeprefix("- ").split(":", 1)[0]


async def acli(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, kubeconfig, *args)


def set_policy(headscale: Headscale, *, grants: bool) -> None:
    policy: dict[str, Any] = {"tagOwners": {TAG: [], ROUTER_TAG: []},
                              "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}
    if grants:
        policy["grants"].append({"src": [TAG], "dst": [SITE], "ip": ["5432"]})
    headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(policy)})


async def test_status_diagnose_and_check_walk_an_egress_from_broken_to_healthy(
        environment: Environment, crds: ControlPlane, admin: Client, operator_namespace: str,
        headscale: Headscale, tailscale_nodes: TailscaleFactory, processes: list[ManagedProcess]) -> None:
    kubeconfig, ns = crds.kubeconfig, operator_namespace
    ops = ("--operator-namespace", ns)
    async with running_operator(kubeconfig, ns):
        tailnet = unique(f"{ns}-cli")
        await create_bootstrap_secret(admin, ns, f"{tailnet}-bootstrap", headscale.api_key)
        await admin.apply(TAILNET, tailnet_object(tailnet, headscale, ns, secret=f"{tailnet}-bootstrap"))
        await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60, what="Tailnet Ready")

        # Ready comes from the Tailnet reconciler; PolicyApplied follows from the Policy reconciler a
        # moment later (WaitingForAccess until it sees the working key), and status exits 1 till then.
        result = await eventually(lambda: _ok(kubeconfig, "status", f"tailnet/{tailnet}", *ops), timeout=60,
                                  interval=1, what="a healthy Tailnet in status")
        assert "version v0.29.2" in result.stdout and "working key" in result.stdout

        # 1. no policy at all: the egress tag has no owner
        egress: dict[str, Any] = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
                  "metadata": {"name": "ledger", "namespace": ns},
                  "spec": {"tailnetRef": {"name": tailnet}, "tag": TAG, "consumerNamespaces": ["apps"],
                           "targets": [{"name": "books", "address": TARGET, "ports": [{"port": 5432}]}]}}
        await admin.apply(TAILNET_EGRESS, egress)
        await eventually(has_condition(admin, TAILNET_EGRESS, "ledger", "TagOwned", "False", namespace=ns),
                         timeout=60, what="egress TagOwned=False")
        status = ("status", "tailnetegress/ledger", *ops)
        result = await acli(kubeconfig, *status)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "TagNotOwned:" in result.stdout and f'"{TAG}": [] to tagOwners' in result.stdout, result.stdout

        # 2. the tag is owned; a router advertises the site but nobody approved it
        set_policy(headscale, grants=False)
        router_key = headscale.create_preauth_key(tags=[ROUTER_TAG], reusable=True)
        router = tailscale_nodes("cli-router", headscale, authkey=router_key, advertise_routes=[SITE])
        node_id = str((await eventually(lambda: headscale.node_by_name("cli-router"), timeout=30,
                                        what="router listed"))["id"])
        await eventually(has_condition(admin, TAILNET_EGRESS, "ledger", "TagOwned", "True", namespace=ns),
                         timeout=60, what="egress TagOwned=True")

        last: list[str] = []

        async def cause(expected: str) -> subprocess.CompletedProcess[str] | None:
            done = await acli(kubeconfig, *status)
            last[:] = [done.stdout + done.stderr]
            return done if first_cause(done.stdout) == expected else None

        async def first(expected: str) -> subprocess.CompletedProcess[str]:
            try:
                result: subprocess.CompletedProcess[str] = await eventually(
                    lambda: cause(expected), timeout=60, interval=1, what=f"{expected} first")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the last report:\n{last[0] if last else ''}") from None
            return result

        # 3. the agent runs with the operator's pre-auth key and its Pod is Ready; the route is not approved
        secret = await eventually(lambda: _get(admin, SECRET, "ledger-auth-key", ns), timeout=60,
                                  what="the egress's pre-auth key Secret")
        key_file = environment.root / f"{ns}-authkey"
        key_file.write_bytes(base64.b64decode(secret["data"]["authKey"]))
        agent = ManagedProcess(
            f"agent-cli-{ns}", [sys.executable, "-m", "tailnet_agent"],
            env={env_names.AGENT_MODE: env_names.EGRESS, env_names.CONTROL_URL: headscale.url,
                 env_names.AUTH_KEY_FILE: str(key_file), env_names.HOSTNAME: "ledger-agent",
                 env_names.CA_BUNDLE: str(headscale.ca_bundle), env_names.BIND_ADDRESS: "127.0.0.1",
                 env_names.HEALTH_ADDRESS: f"127.0.0.1:{free_port()}", env_names.UDP_PORT: "0",
                 env_names.TARGETS: json.dumps([{"name": "books", "address": TARGET,
                                                 "ports": [{"port": 5432, "listen": free_port()}]}])},
            log_dir=environment.log_dir, run_id=environment.run_id, cwd=REPO)
        agent.start()
        processes.append(agent)
        await eventually(lambda: (headscale.node_by_name("ledger-agent") or {}).get("online"), timeout=60,
                         what="the agent online in Headscale")
        await _pod(admin, ns, "ledger-egress-agent-0", {"tailnet.dev/egress": "ledger"}, ready=True)
        result = await first("NotApproved")
        assert "approve the route on cli-router" in result.stdout
        assert f"cli-router: advertises {SITE}; approved none" in result.stdout

        # 4. approved, but the policy grants the tag nothing there
        headscale.approve_routes(node_id, [SITE])
        result = await first("NoGrant")
        assert f"add a grant from {TAG} to {TARGET} ports 5432" in result.stdout

        # 5. granted: healthy
        set_policy(headscale, grants=True)
        result = await eventually(lambda: _ok(kubeconfig, *status), timeout=60, interval=1, what="a healthy egress")
        for link in ("agent pod ledger-egress-agent-0", "Headscale node ledger-agent", f"tags {TAG}",
                     f"policy entries for {TAG}", f"{TAG} -> {SITE} ip 5432", "route Routed",
                     f"Tailnet {tailnet}", "pre-auth key", "No problem found.", "nc -vz books."):
            assert link in result.stdout, (link, result.stdout)

        # diagnose: from a consumer namespace it is the same healthy chain; from another, the NetworkPolicy
        for namespace in ("apps", "shop"):
            await admin.create(NAMESPACE, {"metadata": {"name": f"{ns}-{namespace}"}})
            await _pod(admin, f"{ns}-{namespace}", "client", {}, ready=True)
        egress["spec"]["consumerNamespaces"] = [f"{ns}-apps"]
        await admin.apply(TAILNET_EGRESS, egress)
        target = f"books.{ns}.svc:5432"
        result = await eventually(lambda: _ok(kubeconfig, "diagnose", f"{ns}-apps/client", target, *ops),
                                  timeout=60, interval=1, what="diagnose from a consumer namespace")
        assert f"kubectl exec -n {ns}-apps client -- nc -vz books.{ns}.svc 5432" in result.stdout
        result = await acli(kubeconfig, "diagnose", f"{ns}-shop/client", target, *ops)
        assert result.returncode == 1
        assert "NamespaceNotAllowed:" in result.stdout and f"add {ns}-shop to consumerNamespaces" in result.stdout

        # check: CRDs and Headscale fine, but no operator Deployment in this namespace
        result = await acli(kubeconfig, "check", *ops)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "[  ok] CRD tailnetegresses.tailnet.dev" in result.stdout
        assert f"[  ok] Tailnet {tailnet}: Headscale v0.29.2" in result.stdout
        assert "OperatorMissing:" in result.stdout

        # 6. the agent goes down
        agent.stop()
        await _pod(admin, ns, "ledger-egress-agent-0", {"tailnet.dev/egress": "ledger"}, ready=False)
        result = await first("AgentDown")
        assert f"kubectl -n {ns} logs ledger-egress-agent-0" in result.stdout
        assert "CrashLoopBackOff" in result.stdout

        # 7. Headscale goes away
        router.stop()
        headscale.stop()
        result = await acli(kubeconfig, *status)
        assert result.returncode == 1
        assert first_cause(result.stdout) == "HeadscaleUnreachable", result.stdout
        assert "kubectl tailnet check" in result.stdout.split("Check next:", 1)[1]
        for namespace in ("apps", "shop"):
            await admin.delete(NAMESPACE, f"{ns}-{namespace}")


async def _get(admin: Client, resource: Resource, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        return await admin.get(resource, name, namespace)
    except NotFound:
        return None


async def _ok(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    done = await acli(kubeconfig, *args)
    return done if done.returncode == 0 else None


async def _pod(admin: Client, namespace: str, name: str, labels: dict[str, str], *, ready: bool) -> None:
    """A Pod object whose status says Running and Ready, or crash-looping, as kubelet would write it
    (the control plane has none)."""
    with contextlib.suppress(AlreadyExists):
        await admin.create(POD, {"metadata": {"name": name, "namespace": namespace, "labels": labels},
                                 "spec": {"containers": [{"name": "agent", "image": "localhost/none"}]}}, namespace)
    state = {"running": {}} if ready else {"waiting": {"reason": "CrashLoopBackOff"}}
    await admin.request("PATCH", POD.path(namespace, name, "status"), content_type="application/merge-patch+json",
                        body={"status": {"phase": "Running", "podIP": "127.0.0.1",
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                                         "containerStatuses": [{"name": "agent", "ready": ready,
                                                                "restartCount": 0 if ready else 3,
                                                                "image": "localhost/none", "imageID": "",
                                                                "state": state}]}})
