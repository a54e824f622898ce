"""Agent configuration from the environment: defaults, the targets JSON and one-line errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tailnet_agent.config import load
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.contract.targets import PortMapping, Target, parse_targets


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "authkey"
    key.write_text("hskey-auth-secret\n")
    return {"TAILNET_CONTROL_URL": "https://headscale.example:8443", "TAILNET_AUTH_KEY_FILE": str(key),
            "TAILNET_HOSTNAME": "egress-db",
            "TAILNET_TARGETS": '[{"name": "db", "address": "100.64.0.7", "ports": [5432]}]'}


def test_defaults(env: dict[str, str]) -> None:
    cfg = load(env)
    assert cfg.auth_key == "hskey-auth-secret"
    assert "hskey" not in repr(cfg)
    assert cfg.targets == (Target(name="db", address="100.64.0.7", ports=(PortMapping(port=5432, listen=5432),)),)
    assert (cfg.bind_address, cfg.health_host, cfg.health_port) == ("0.0.0.0", "0.0.0.0", 9002)
    assert cfg.accept_routes is True and cfg.ca_bundle is None and cfg.dial_timeout == 30.0
    assert cfg.udp_port == 41641


def test_ingress_defaults_to_no_accept_routes_and_reads_its_exposes_file(env: dict[str, str], tmp_path: Path) -> None:
    del env["TAILNET_TARGETS"]
    with pytest.raises(ConfigError, match=r"^TAILNET_EXPOSES_FILE is not set$"):
        load(env, mode="ingress")
    exposes = tmp_path / "exposes.json"
    exposes.write_text('[{"name": "db", "port": 5432, "backend": {"host": "db.shop.svc", "port": 5432}}]')
    env["TAILNET_EXPOSES_FILE"] = str(exposes)
    cfg = load(env, mode="ingress")
    assert cfg.accept_routes is False and cfg.exposes_file == exposes
    assert [(e.name, e.port, e.address, e.mode) for e in cfg.exposes] == [("db", 5432, "db.shop.svc", "tcp")]


def test_overrides(env: dict[str, str], tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("pem")
    env.update(TAILNET_CA_BUNDLE=str(ca), TAILNET_HEALTH_ADDRESS="127.0.0.1:9100", TAILNET_ACCEPT_ROUTES="false",
               TAILNET_BIND_ADDRESS="127.0.0.1", TAILNET_DIAL_TIMEOUT="2.5")
    cfg = load(env)
    assert cfg.ca_bundle == ca and (cfg.health_host, cfg.health_port) == ("127.0.0.1", 9100)
    assert cfg.accept_routes is False and cfg.bind_address == "127.0.0.1" and cfg.dial_timeout == 2.5


@pytest.mark.parametrize(("text", "port"), [("0", 0), ("50000", 50000), ("off", None), ("OFF", None)])
def test_udp_port(env: dict[str, str], text: str, port: int | None) -> None:
    env["TAILNET_UDP_PORT"] = text
    assert load(env).udp_port == port


def test_targets_file(env: dict[str, str], tmp_path: Path) -> None:
    del env["TAILNET_TARGETS"]
    path = tmp_path / "targets.json"
    path.write_text('[{"name": "web", "address": "web.tailnet", "ports": [{"port": 443, "listen": 8443}]}]')
    env["TAILNET_TARGETS_FILE"] = str(path)
    cfg = load(env)
    assert cfg.targets[0].ports == (PortMapping(port=443, listen=8443),)
    # Followed for changes from the content it was read with (an inline list is not followed).
    assert cfg.targets_file == path
    assert cfg.targets_digest == hashlib.sha256(path.read_bytes()).hexdigest()
    env["TAILNET_TARGETS"] = '[{"name": "db", "address": "100.64.0.7", "ports": [5432]}]'
    assert load(env).targets_file is None


def test_parse_targets_shapes() -> None:
    targets = parse_targets('[{"name": "a", "address": "10.0.0.1", "ports": [80, {"port": 5432, "listen": 15432}]},'
                            ' {"name": "b", "address": " b ", "ports": [{"port": 22}]}]')
    assert targets[0].ports == (PortMapping(port=80, listen=80), PortMapping(port=5432, listen=15432))
    assert targets[1] == Target(name="b", address="b", ports=(PortMapping(port=22, listen=22),))


@pytest.mark.parametrize(("text", "message"), [
    ("[", "TAILNET_TARGETS is not valid JSON"),
    ('{"name": "a"}', "must be a JSON list of targets"),
    ('[{"address": "x", "ports": [1]}]', r"TAILNET_TARGETS\[0\].name must be a non-empty string"),
    ('[{"name": "a", "ports": [1]}]', r"\(a\): address must be a non-empty string"),
    ('[{"name": "a", "address": "x", "ports": []}]', "ports must be a non-empty list"),
    ('[{"name": "a", "address": "x", "ports": [0]}]', r"a ports\[0\] must be a port number 1-65535, got 0"),
    ('[{"name": "a", "address": "x", "ports": [{"port": 1, "listen": "2"}]}]', r"listen must be a port number"),
    ('[{"name": "a", "address": "x", "ports": [true]}]', "must be a port number"),
    ('[{"name": "a", "address": "x", "ports": [80]}, {"name": "b", "address": "y", "ports": [80]}]',
     "listen port 80 is used by both a and b"),
])
def test_bad_targets(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_targets(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"TAILNET_CONTROL_URL": ""}, "TAILNET_CONTROL_URL is not set"),
    ({"TAILNET_CONTROL_URL": "headscale:8080"}, "must be an http\\(s\\) URL"),
    ({"TAILNET_AUTH_KEY_FILE": "/nonexistent/key"}, "TAILNET_AUTH_KEY_FILE: cannot read /nonexistent/key"),
    ({"TAILNET_HOSTNAME": " "}, "TAILNET_HOSTNAME is not set"),
    ({"TAILNET_TARGETS": ""}, "TAILNET_TARGETS is not set"),
    ({"TAILNET_TARGETS": "[]"}, "TAILNET_TARGETS is empty"),
    ({"TAILNET_CA_BUNDLE": "/nonexistent/ca.pem"}, "TAILNET_CA_BUNDLE: /nonexistent/ca.pem is not a file"),
    ({"TAILNET_HEALTH_ADDRESS": "9002"}, "TAILNET_HEALTH_ADDRESS must be host:port"),
    ({"TAILNET_ACCEPT_ROUTES": "maybe"}, "TAILNET_ACCEPT_ROUTES must be true or false"),
    ({"TAILNET_BIND_ADDRESS": "localhost"}, "TAILNET_BIND_ADDRESS must be an IP address"),
    ({"TAILNET_DIAL_TIMEOUT": "-1"}, "TAILNET_DIAL_TIMEOUT must be positive"),
    ({"TAILNET_UDP_PORT": "65536"}, "TAILNET_UDP_PORT must be a port 0-65535 or 'off'"),
    ({"TAILNET_UDP_PORT": "no"}, "TAILNET_UDP_PORT must be a port 0-65535 or 'off'"),
])
def test_errors_are_one_line(env: dict[str, str], change: dict[str, str], message: str) -> None:
    env.update(change)
    with pytest.raises(ConfigError, match=message) as info:
        load(env)
    assert "\n" not in str(info.value) and "hskey" not in str(info.value)


def test_empty_key_file(env: dict[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    env["TAILNET_AUTH_KEY_FILE"] = str(empty)
    with pytest.raises(ConfigError, match="is empty"):
        load(env)


def _ingress_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    exposes = tmp_path / "exposes.json"
    exposes.write_text('[{"name": "db", "port": 5432, "backend": {"host": "db.shop.svc", "port": 5432}}]')
    return {**{k: v for k, v in env.items() if k != "TAILNET_TARGETS"}, "TAILNET_EXPOSES_FILE": str(exposes)}


def test_an_ingress_reads_its_shared_addresses(env: dict[str, str], tmp_path: Path) -> None:
    ingress = _ingress_env(env, tmp_path)
    assert load(ingress, mode="ingress").shared_addresses == ()
    ingress["TAILNET_SHARED_ADDRESS"] = " 198.18.5.10, 2001:db8::10 "
    assert [str(a) for a in load(ingress, mode="ingress").shared_addresses] == ["198.18.5.10", "2001:db8::10"]


@pytest.mark.parametrize(("value", "message"), [
    ("100.64.0.9", r"in the tailnet's own range"),
    ("fd7a:115c:a1e0::9", r"in the tailnet's own range"),
    ("198.18.5.10,198.18.5.11", r"at most one IPv4 and one IPv6 address"),
    ("127.0.0.1", r"not a unicast address a peer can route to"),
    ("shop.example", r"must be IP addresses, got 'shop.example'"),
])
def test_a_bad_shared_address_is_refused_with_its_reason(env: dict[str, str], tmp_path: Path, value: str,
                                                         message: str) -> None:
    ingress = {**_ingress_env(env, tmp_path), "TAILNET_SHARED_ADDRESS": value}
    with pytest.raises(ConfigError, match=rf"^TAILNET_SHARED_ADDRESS.*{message}"):
        load(ingress, mode="ingress")


def test_an_egress_refuses_a_shared_address(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^TAILNET_SHARED_ADDRESS is for ingress agents only$"):
        load({**env, "TAILNET_SHARED_ADDRESS": "198.18.5.10"})
