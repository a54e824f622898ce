"""Key text forms, clamping and the optional machine key file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tailnet_agent.control.keys import NodeKeys, PublicKey, load_or_create_machine_key, machine_public


def test_text_forms_and_clamping() -> None:
    keys = NodeKeys.generate()
    for key, prefix in ((keys.machine, "mkey:"), (keys.node, "nodekey:"), (keys.disco, "discokey:")):
        text = str(key.public)
        assert text.startswith(prefix) and len(text) == len(prefix) + 64
        assert PublicKey.parse(text, prefix) == key.public
        assert key.raw[0] & 7 == 0 and key.raw[31] & 0xC0 == 0x40
        assert key.raw.hex() not in repr(key)
    assert keys.with_new_node_key().node != keys.node
    assert keys.with_new_node_key().machine == keys.machine


def test_parse_rejects_wrong_prefix_and_length() -> None:
    with pytest.raises(ValueError):
        machine_public("nodekey:" + "00" * 32)
    with pytest.raises(ValueError):
        machine_public("mkey:" + "00" * 31)


def test_machine_key_file_is_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "machine.key"
    first = load_or_create_machine_key(path)
    assert path.read_text().startswith("privkey:")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_machine_key(path) == first
    assert NodeKeys.generate(machine_key_file=path).machine == first
