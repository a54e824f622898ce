"""Version selection of the binaries: the pins, the ranges and the env vars that pick from them."""

from __future__ import annotations

import pytest

from hack import binaries, versions


def test_ranges_end_with_the_pins_and_are_ordered() -> None:
    assert versions.HEADSCALE_RANGE[-1] == versions.HEADSCALE
    assert versions.TAILSCALE_RANGE[-1] == versions.TAILSCALE
    for rng in (versions.HEADSCALE_RANGE, versions.TAILSCALE_RANGE):
        keys = [tuple(int(p) for p in v.split(".")) for v in rng]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
    # One entry per even tailscale minor from 1.80 to 1.98.
    assert [int(v.split(".")[1]) for v in versions.TAILSCALE_RANGE] == list(range(80, 100, 2))


def test_env_var_selects_a_listed_version_with_its_own_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILNET_HEADSCALE_VERSION", raising=False)
    assert binaries.selected(binaries.HEADSCALE) is binaries.HEADSCALE
    monkeypatch.setenv("TAILNET_HEADSCALE_VERSION", "0.26.1")
    chosen = binaries.selected(binaries.HEADSCALE)
    assert chosen.version == "0.26.1"
    assert chosen.directory.name == "headscale-0.26.1"
    assert chosen.packages == binaries.HEADSCALE.packages
    monkeypatch.setenv("TAILNET_HEADSCALE_VERSION", "0.25.0")
    with pytest.raises(KeyError, match="not in the headscale range"):
        binaries.selected(binaries.HEADSCALE)


def test_specs_name_a_component_and_optionally_a_listed_version() -> None:
    assert binaries.parse_spec("tailscale@1.80.3").directory.name == "tailscale-1.80.3"
    assert binaries.parse_spec("etcd") is binaries.ETCD
    with pytest.raises(KeyError, match="not listed"):
        binaries.parse_spec("tailscale@1.81.0")
    with pytest.raises(KeyError, match="pinned"):
        binaries.at_version(binaries.ETCD, "3.5.0")
    with pytest.raises(KeyError, match="unknown component"):
        binaries.parse_spec("nope")
