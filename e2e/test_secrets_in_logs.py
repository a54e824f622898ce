"""No secret in a full run's logs, Events, status or metrics.

One run of a Tailnet and an egress against kube-apiserver, a real Headscale and a tailscaled peer:
the operator (in-process) mints its working API key from the bootstrap key, applies the policy,
mints the egress's pre-auth key into its Secret; the agent joins with that key and forwards a
request to a server behind the peer. A second Tailnet carries a wrong bootstrap key, so the
Headscale client's error paths run too.

Every line the run logged (structlog and the standard library, any level, operator and agent
alike), every Event, the status of every object, the agent's ``/status`` document and both
metrics registries are then scanned for the secrets the run created (API keys, pre-auth keys,
the agent's machine/node/disco private keys, the TLS private keys of the test CA and Headscale)
and for key formats in general (:mod:`hack.secretscan`). Two canary lines, one through each
logging path, prove that the capture sees what the code logs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import generate_latest

from e2e.conftest import TailscaleFactory
from e2e.test_agent_egress import get, local_server, running_agent, target, wait_peer_sees
from hack.localenv import ControlPlane, Headscale
from hack.secretscan import SecretScanner
from tailnet_agent.status import egress_status
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.controllers.policy import POLICY_KEY
from tailnet_operator.controllers.preauth import AUTH_KEY_FIELD
from tailnet_operator.controllers.tailnet import working_key_secret_name
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, EVENT, SECRET

from .operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object
from .polling import eventually

pytestmark = pytest.mark.integration

TAG = "tag:egress-secrets"
BASE = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name} {record.levelname} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.extend(text.splitlines())


@pytest.fixture
def stdlib_logs() -> Iterator[_Lines]:
    """Every standard-library log record of the test, at every level."""
    handler = _Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def tls_private_keys(*roots: Path) -> Iterator[tuple[str, str]]:
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path.stat().st_size < 64 << 10:
                text = path.read_text(errors="replace")
                if "PRIVATE KEY-----" in text:
                    yield f"TLS private key {path.name}", text


async def secret_value(admin: Client, name: str, namespace: str, field: str) -> str | None:
    try:
        secret = await admin.get(SECRET, name, namespace)
    except NotFound:
        return None
    raw = (secret.get("data") or {}).get(field)
    return base64.b64decode(raw).decode() if raw else None


async def test_no_secret_in_logs_events_status_or_metrics(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
    tailscale_nodes: TailscaleFactory, capfd: pytest.CaptureFixture[str], stdlib_logs: _Lines,
) -> None:
    ns = operator_namespace
    tailnet, broken, egress = f"{ns}-tn", f"{ns}-broken", "web"
    wrong_key = "hskey-api-" + base64.urlsafe_b64encode(os.urandom(9)).decode() + "-" + os.urandom(24).hex()
    scanner = SecretScanner({"bootstrap API key": headscale.api_key, "wrong bootstrap key": wrong_key})
    for name, pem in tls_private_keys(headscale.workdir, control_plane.workdir):
        scanner.add_pem(name, pem)

    await create_bootstrap_secret(admin, ns, "bootstrap", headscale.api_key)
    await create_bootstrap_secret(admin, ns, "wrong", wrong_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": ns}, "data": {POLICY_KEY: BASE}})
    policy = {"baseConfigMapRef": {"namespace": ns, "name": "base", "key": POLICY_KEY}, "mode": "Apply"}
    peer_key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    scanner.add("peer pre-auth key", peer_key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nhello from behind the peer\n")
        await writer.drain()
        writer.close()

    async with running_operator(control_plane.kubeconfig, ns) as op, local_server(handler) as port:
        peer = tailscale_nodes("ts-secrets", headscale, authkey=peer_key)
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, ns, policy=policy))
        await admin.create(TAILNET, tailnet_object(broken, headscale, ns, secret="wrong"))
        await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60, what="Ready")
        await eventually(has_condition(admin, TAILNET, broken, "Ready", "False"), timeout=60,
                         what="the broken Tailnet refused")
        working = await secret_value(admin, working_key_secret_name(tailnet), ns, "apiKey")
        assert working
        scanner.add("working API key", working)

        await admin.create(TAILNET_EGRESS, {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": egress, "namespace": ns},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": TAG, "consumerNamespaces": [ns],
                     "targets": [{"name": "web", "address": peer.ipv4(), "ports": [{"port": port}]}]}}, ns)
        key_secret = auth_key_secret_name("TailnetEgress", egress)
        auth_key = await eventually(lambda: secret_value(admin, key_secret, ns, AUTH_KEY_FIELD),
                                    timeout=60, what="the egress's pre-auth key")
        scanner.add("egress pre-auth key", auth_key)

        async with running_agent(headscale, "agent-secrets", auth_key, [target("web", peer.ipv4(), port)]) as agent:
            keys = agent.node.control.keys
            for name, key in (("machine", keys.machine), ("node", keys.node), ("disco", keys.disco)):
                scanner.add(f"agent {name} private key", key.raw)
            await wait_peer_sees(peer, "agent-secrets")
            listen = agent.listen_port("web", port)
            assert (await get(listen, "/", timeout=30)).endswith(b"hello from behind the peer\n")
            scanner.scan_text("agent /status", json.dumps(egress_status(agent.node, agent.forwarder, None), indent=1))
            scanner.scan_text("agent /metrics", agent.metrics.render().decode())

        scanner.scan_text("operator /metrics", generate_latest(op.manager.registry).decode())
        for resource, name in ((TAILNET, tailnet), (TAILNET, broken), (TAILNET_EGRESS, egress)):
            obj: dict[str, Any] = await admin.get(resource, name, ns if resource is TAILNET_EGRESS else None)
            scanner.scan_text(f"{resource.kind} {name}", json.dumps({"status": obj.get("status"),
                                                                    "annotations": obj["metadata"].get("annotations")},
                                                                   indent=1))

    events = [e for namespace in (ns, "default") for e in (await admin.list(EVENT, namespace)).items]
    assert {e.get("reason") for e in events} & {"WorkingKeyMinted"}, "the run recorded Events"
    for event in events:
        scanner.scan_text(f"Event {event.get('reason')}", json.dumps(
            {k: event.get(k) for k in ("reason", "note", "message", "action", "regarding")}))

    # Canaries: one line through each logging path, found like any leak would be.
    canary = os.urandom(32)
    structlog.get_logger("secrets-canary").debug("canary", key=f"privkey:{canary.hex()}")
    logging.getLogger("secrets-canary").debug("canary %s", base64.b64encode(canary).decode())

    captured = capfd.readouterr()
    log_lines = [*captured.out.splitlines(), *captured.err.splitlines(), *stdlib_logs.lines]
    assert len(log_lines) > 100, "the run logged"
    forms = (canary.hex(), base64.b64encode(canary).decode())
    canary_lines = [line for line in log_lines if any(form in line for form in forms)]
    assert len(canary_lines) == 2, canary_lines
    assert all(SecretScanner({"canary": canary}).scan("canary", [line]) for line in canary_lines)
    scanner.scan("logs", [line for line in log_lines if line not in canary_lines])
    leaks = scanner.findings
    assert not leaks, "\n".join(f"{f.source}: {f.what}: {f.excerpt}" for f in leaks)
    print(f"\nsecret scan: {scanner.lines_checked} lines checked ({len(log_lines)} log lines, {len(stdlib_logs.lines)} "
          f"of them from the standard library, {len(events)} Events), "
          f"{scanner.forms} secret forms, 0 leaks")
