"""``python -m tailnet_agent`` refuses to start without a valid AGENT_MODE, in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "AGENT_MODE" and not k.startswith("TAILNET_")}
    return subprocess.run([sys.executable, "-m", "tailnet_agent"], env={**base, **env}, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize(("env", "message"), [
    ({}, "tailnet-agent: AGENT_MODE is unset; set it to one of: egress, ingress"),
    ({"AGENT_MODE": "sideways"}, "tailnet-agent: AGENT_MODE is 'sideways'; set it to one of: egress, ingress"),
    ({"AGENT_MODE": "ingress"}, "tailnet-agent: TAILNET_CONTROL_URL is not set"),
    ({"AGENT_MODE": "egress"}, "tailnet-agent: TAILNET_CONTROL_URL is not set"),
])
def test_exits_non_zero_with_one_line(env: dict[str, str], message: str) -> None:
    proc = run(env)
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [message]
    assert proc.stdout == ""
