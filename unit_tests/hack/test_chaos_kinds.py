"""Which kinds of kill the chaos run leaves out, and why (never silently)."""

from __future__ import annotations

import os
import shutil

import pytest

from hack import chaos


def test_every_kind_runs_as_root_with_ss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert chaos.unavailable_kinds() == {}


def test_the_derp_kill_is_left_out_with_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert chaos.unavailable_kinds() == {"derp": "not root (ss -K needs CAP_NET_ADMIN); no ss (iproute2) on PATH"}
