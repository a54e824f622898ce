"""Types shared by every package of the operator."""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]
"""A decoded JSON object: a Kubernetes object, a Headscale API answer, a request body."""

__all__ = ["JSON"]
