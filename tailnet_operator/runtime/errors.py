"""Errors of the Kubernetes API, mirroring the ``reason`` of its Status objects.

::

    KubeError
    ├── TransportError          the request never got an HTTP answer (connect, TLS, timeout)
    └── APIError                kube-apiserver answered with a failure Status
        ├── BadRequest          400
        ├── Unauthorized        401
        ├── Forbidden           403
        ├── NotFound            404
        ├── Conflict            409 (optimistic-lock or apply conflicts)
        │   └── AlreadyExists   409 with reason AlreadyExists
        ├── Gone                410: the resourceVersion is too old (reason Expired or Gone)
        ├── Invalid             422: the object failed validation; ``causes`` name the fields
        ├── TooManyRequests     429
        └── ServerError         5xx
"""

from __future__ import annotations

from typing import Any


class KubeError(Exception):
    """Base of every error raised by the runtime's API client."""


class TransportError(KubeError):
    """No HTTP response: the connection failed, TLS failed, or the request timed out."""

    def __init__(self, message: str, *, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent
        """The connection was never made, so kube-apiserver never saw the request."""


def certainly_not_written(exc: BaseException) -> bool:
    """Whether a failed write is known not to have happened: refused with a 4xx answer, or never
    sent. A timeout, a broken connection or a 5xx (etcd may have committed it) leaves it open."""
    if isinstance(exc, APIError):
        return exc.status < 500
    return isinstance(exc, TransportError) and exc.unsent


class APIError(KubeError):
    """A failure Status from kube-apiserver."""

    def __init__(self, status: int, reason: str, message: str, *, details: dict[str, Any] | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}" if reason else f"{status}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details or {}
        self.retry_after = retry_after

    @property
    def causes(self) -> list[dict[str, Any]]:
        causes: list[dict[str, Any]] = self.details.get("causes", [])
        return causes


class BadRequest(APIError):
    pass


class Unauthorized(APIError):
    pass


class Forbidden(APIError):
    pass


class NotFound(APIError):
    pass


class Conflict(APIError):
    pass


class AlreadyExists(Conflict):
    pass


class Gone(APIError):
    """The requested resourceVersion is no longer available: relist."""


class Invalid(APIError):
    pass


class TooManyRequests(APIError):
    pass


class ServerError(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 410: Gone,
    422: Invalid, 429: TooManyRequests,
}


def from_status(code: int, body: Any, retry_after: float | None = None) -> APIError:
    """The most specific error for an HTTP status and its (possibly non-Status) body."""
    status = body if isinstance(body, dict) and body.get("kind") == "Status" else {}
    reason = str(status.get("reason", ""))
    message = str(status.get("message") or (body if isinstance(body, str) else "")).strip()
    details = status.get("details") if isinstance(status.get("details"), dict) else None
    if code == 409 and reason == "AlreadyExists":
        cls: type[APIError] = AlreadyExists
    elif code == 500 and reason in ("Expired", "Gone"):
        cls = Gone
    else:
        cls = _BY_STATUS.get(code, ServerError if code >= 500 else APIError)
    return cls(code, reason, message or f"HTTP {code}", details=details, retry_after=retry_after)
