"""The names and labels of what the operator makes: running clusters hold objects by these values."""

from __future__ import annotations

import pytest

from tailnet_operator.names import MANAGED_BY, auth_key_secret_name, managed_by_operator


def test_pre_auth_key_secrets_keep_their_names() -> None:
    """A renamed Secret would not be found again: its key would be neither rotated nor expired."""
    assert auth_key_secret_name("TailnetEgress", "db") == "db-auth-key"
    assert auth_key_secret_name("TailnetIngress", "shop") == "shop-ingress-auth-key"
    assert auth_key_secret_name("TailnetGateway", "edge") == "edge-gateway-auth-key"


def test_a_kind_without_a_pre_auth_key_is_refused() -> None:
    with pytest.raises(ValueError, match="Tailnet has no pre-auth key"):
        auth_key_secret_name("Tailnet", "home")


def test_managed_by() -> None:
    assert dict(MANAGED_BY) == {"app.kubernetes.io/managed-by": "tailnet-operator"}
    assert managed_by_operator({"metadata": {"labels": dict(MANAGED_BY)}})
    assert not managed_by_operator({"metadata": {"labels": {"app.kubernetes.io/managed-by": "Helm"}}})
    assert not managed_by_operator({"metadata": {}})
