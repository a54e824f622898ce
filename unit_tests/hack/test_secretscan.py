"""The secret scanner flags planted secrets in every form it claims to, and leaves masked ones."""

from __future__ import annotations

import base64
import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hack.secretscan import SecretScanner

API_KEY = "hskey-api-AbCdEfGhIjKl-" + "s3cr3t" * 8
AUTH_KEY = "hskey-auth-MnOpQrStUvWx-" + "pr3auth" * 7
NODE_KEY = os.urandom(32)


def scanner() -> SecretScanner:
    return SecretScanner({"api key": API_KEY, "pre-auth key": AUTH_KEY, "node private key": NODE_KEY})


def test_planted_secrets_are_found_in_each_form() -> None:
    lines = [
        f"request failed key={API_KEY}",
        f"joining with {AUTH_KEY}",
        f"dataplane key={NODE_KEY.hex()}",
        f"dataplane key={base64.b64encode(NODE_KEY).decode()}",
        f"key=privkey:{NODE_KEY.hex()}",
    ]
    s = scanner()
    found = s.scan("planted", lines)
    assert {f.what for f in found} >= {"api key", "pre-auth key", "node private key"}
    assert {f.excerpt for f in found}.isdisjoint(lines)  # reports do not repeat the secret
    assert all(s.scan("planted", [line]) for line in lines), "every line is flagged on its own"
    assert s.lines_checked == 2 * len(lines)


def test_key_formats_are_found_without_knowing_the_value() -> None:
    unknown_api = "hskey-api-ZZZZZZZZZZZZ-" + "x" * 40
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    found = SecretScanner({}).scan_text("planted", f"{unknown_api}\nprivkey:{'ab' * 32}\n{pem}")
    assert [f.what for f in found] == ["Headscale API key", "Tailscale private key", "PEM private key"]


def test_a_pem_fragment_is_found() -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    s = SecretScanner({})
    s.add_pem("TLS key", pem)
    assert [f.what for f in s.scan("planted", [f"tls: {pem.splitlines()[1]}"])] == ["TLS key"]


def test_masked_keys_and_public_keys_pass() -> None:
    lines = [
        "minted hskey-api-AbCdEfGhIjKl-***",
        "pre-auth key hskey-auth-MnOpQrStUvWx-*** expires",
        "node_key=[1f2e3] nodekey:" + "00" * 32,
        "-----BEGIN CERTIFICATE-----",
    ]
    assert scanner().scan("clean", lines) == []
