"""A plain kubeconfig (server, CA, client certificate or token) is read without importing the
``kubernetes`` package, whose import is a tenth to a third of a second of a controller's cold
start; any other goes to the package's loader, as before."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailnet_operator.runtime.client import config


def kubeconfig(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "c", "cluster": cluster}, {"name": "other", "cluster": {"server": "https://x"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}},
                     {"name": "there", "context": {"cluster": "other", "user": "u"}}]}))
    return path


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_embedded_certificates_go_to_private_files(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443/", "certificate-authority-data": b64("CA")},
                      {"client-certificate-data": b64("CERT"), "client-key-data": b64("KEY")})
    found = config.load(path)
    assert found.host == "https://127.0.0.1:6443"
    assert found.ca_file and Path(found.ca_file).read_text() == "CA"
    assert found.cert_file and Path(found.cert_file).read_text() == "CERT"
    assert found.key_file and Path(found.key_file).read_text() == "KEY"
    assert Path(found.key_file).stat().st_mode & 0o077 == 0, "the key is readable by its owner alone"
    assert found.token is None and found.verify_ssl


def test_files_relative_to_the_kubeconfig_a_token_and_another_context(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"server": "https://a", "certificate-authority": "ca.crt",
                                 "insecure-skip-tls-verify": True}, {"token": "secret"})
    found = config.load(path)
    assert (found.ca_file, found.token, found.verify_ssl) == (str(tmp_path / "ca.crt"), "secret", False)
    assert config.load(path, context="there").host == "https://x"


@pytest.mark.parametrize("user", [
    {"exec": {"command": "get-token", "apiVersion": "client.authentication.k8s.io/v1"}},
    {"username": "a", "password": "b"},
])
def test_anything_else_is_left_to_the_kubernetes_package(tmp_path: Path, user: dict[str, Any]) -> None:
    path = kubeconfig(tmp_path, {"server": "https://a"}, user)
    assert config.load_plain(path) is None


def test_a_plain_kubeconfig_does_not_import_the_kubernetes_package(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"server": "https://a"}, {"token": "t"})
    code = (f"import sys; from tailnet_operator.runtime.client import config; config.load({str(path)!r}); "
            "print('kubernetes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
