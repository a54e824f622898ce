"""A Headscale of the local environment makes its socket directory only when it starts."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from hack.localenv.headscale import Headscale


def test_a_headscale_never_started_leaves_no_socket_directory(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    Headscale(tmp_path / "hs", log_dir=tmp_path / "logs", run_id="unit")

    assert list((tmp_path / "tmp").iterdir()) == []
