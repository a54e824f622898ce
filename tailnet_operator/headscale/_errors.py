"""Errors of the Headscale API client: one hierarchy for every server version.

::

    HeadscaleError
    ├── Unsupported                 the server's version lacks the operation (checked before sending)
    ├── TransportError              no HTTP answer came back
    │   ├── ConnectError            the connection could not be opened (refused, unreachable, DNS)
    │   ├── TLSVerificationError    the server's certificate was not trusted (wrong or missing CA bundle)
    │   └── RequestTimeout          one attempt took longer than the client's timeout
    └── APIError                    Headscale (or a proxy in front of it) answered with a failure
        ├── Unauthorized            401, including the plain-text body "Unauthorized" (bad or expired key)
        ├── Forbidden               403
        ├── NotFound                404, gRPC 5, or a 0.29 500 whose message ends in "not found"
        ├── Conflict                409
        │   └── AlreadyExists       gRPC 6, or a 0.29 500 that reports a duplicate (UNIQUE constraint)
        ├── InvalidRequest          400/422, gRPC 3/9/11, and 0.29 validation failures sent as 500 + gRPC 2
        │   └── PolicyRejected      a policy PUT or check was refused; ``message`` is Headscale's, verbatim
        └── ServerError             any other 5xx; ``transient`` says whether repeating it may help

Two error bodies are understood:

* Headscale 0.29 (grpc-gateway): ``{"code": <gRPC code>, "message": "...", "details": [...]}``.
  0.29 turns every plain Go error into gRPC code 2 (Unknown) and HTTP 500, so a 500 is not
  necessarily a server fault: the message decides (see :func:`error_from_response`).
* Headscale 0.30+ (Huma): RFC 7807 ``application/problem+json`` with ``type``, ``title``,
  ``status``, ``detail``; the HTTP status is already the right one.

No exception carries request headers, so the API key never reaches a message or a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_MESSAGE_CHARS = 2000
"""Longest server message kept on an exception; longer bodies (an HTML error page) are cut."""

# gRPC status codes that can appear in a 0.29 error body.
GRPC_UNKNOWN = 2
GRPC_INVALID_ARGUMENT = 3
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_ALREADY_EXISTS = 6
GRPC_PERMISSION_DENIED = 7
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_FAILED_PRECONDITION = 9
GRPC_ABORTED = 10
GRPC_OUT_OF_RANGE = 11
GRPC_INTERNAL = 13
GRPC_UNAVAILABLE = 14
GRPC_UNAUTHENTICATED = 16

TRANSIENT_GRPC_CODES = frozenset({GRPC_DEADLINE_EXCEEDED, GRPC_RESOURCE_EXHAUSTED, GRPC_ABORTED, GRPC_UNAVAILABLE})
"""gRPC codes that say "try again later"; every other code is Headscale's final answer."""

GATEWAY_STATUSES = frozenset({502, 503, 504})
"""Statuses a proxy or a restarting server sends; the request most likely never reached Headscale."""


class HeadscaleError(Exception):
    """Base of every error raised by the Headscale client."""


# -- no HTTP answer ---------------------------------------------------------------------------


class Unsupported(HeadscaleError):
    """The server's Headscale version lacks this operation; nothing was sent.

    ``feature`` names it, ``server`` is the server's version and ``minimum`` the first Headscale
    minor that has it (``"0.29"``).
    """

    def __init__(self, feature: str, *, server: str, minimum: str) -> None:
        super().__init__(f"{feature} needs Headscale {minimum} or newer; the server is {server}")
        self.feature = feature
        self.server = server
        self.minimum = minimum


class TransportError(HeadscaleError):
    """No HTTP response: the connection failed or broke, TLS failed, or the attempt timed out."""

    tls: bool = False
    """True for TLS failures, which point at the CA bundle rather than at the network."""


class ConnectError(TransportError):
    """The connection could not be opened, so the request was never sent; always safe to retry."""


class TLSVerificationError(TransportError):
    """The TLS handshake failed, usually because the server certificate is not trusted. Never retried."""

    tls = True


class RequestTimeout(TransportError):
    """An attempt took longer than the client's timeout; the server may still have acted on it."""


# -- an HTTP answer that is a failure ---------------------------------------------------------


class APIError(HeadscaleError):
    """A failure answer.

    ``message`` is the server's own text (gRPC ``message``, problem ``detail`` or ``title``, or the
    raw body), ``grpc_code`` is set only for 0.29 bodies and ``problem_type`` only for RFC 7807 ones.
    """

    def __init__(self, message: str, *, status: int, grpc_code: int | None = None,
                 problem_type: str | None = None, details: list[Any] | None = None,
                 method: str = "", path: str = "") -> None:
        self.message = message
        self.status = status
        self.grpc_code = grpc_code
        self.problem_type = problem_type
        self.details: list[Any] = details or []
        self.method = method
        self.path = path
        where = f"{method} {path}: " if method else ""
        code = f" (gRPC code {grpc_code})" if grpc_code is not None else ""
        super().__init__(f"{where}HTTP {status}{code}: {message}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(status={self.status}, grpc_code={self.grpc_code}, "
                f"method={self.method!r}, path={self.path!r}, message={self.message!r})")


class Unauthorized(APIError):
    """401: the API key is missing, unknown or expired."""


class Forbidden(APIError):
    """403 (or gRPC PermissionDenied)."""


class NotFound(APIError):
    """The object (or the endpoint) does not exist."""


class Conflict(APIError):
    """409: the request conflicts with the current state."""


class AlreadyExists(Conflict):
    """An object with that name or key already exists."""


class InvalidRequest(APIError):
    """The server rejected the request as invalid; repeating it gives the same answer."""


class PolicyRejected(InvalidRequest):
    """A policy was refused by ``PUT /api/v1/policy`` or ``POST /api/v1/policy/check``.

    ``message`` is Headscale's text verbatim (parse errors, unknown tags, failed policy ``tests``).
    """


class ServerError(APIError):
    """A 5xx that is not a validation failure.

    ``transient`` is true when another attempt may succeed: a gateway status (502/503/504) or a
    body that is not Headscale's own (a proxy page), or gRPC Unavailable/DeadlineExceeded/
    ResourceExhausted/Aborted. A 0.29 gRPC Internal (13) or a problem document with status 500 is
    Headscale's considered answer and is not transient.
    """

    def __init__(self, message: str, *, transient: bool, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.transient = transient


# -- mapping a response to an exception --------------------------------------------------------


def _parse_body(headers: Mapping[str, str], body: bytes) -> tuple[str, int | None, str | None, list[Any], bool]:
    """(message, grpc_code, problem_type, details, from_headscale) of an error body."""
    text = body.decode("utf-8", errors="replace").strip()
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "").lower()
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        if "application/problem+json" in content_type or ("title" in doc and "status" in doc):
            message = str(doc.get("detail") or doc.get("title") or text)
            errors = doc.get("errors")
            problem_type = str(doc.get("type") or "about:blank")
            return message, None, problem_type, errors if isinstance(errors, list) else [], True
        code = doc.get("code")
        if isinstance(code, int) and "message" in doc:
            details = doc.get("details")
            return str(doc["message"]), code, None, details if isinstance(details, list) else [], True
    return text[:MAX_MESSAGE_CHARS] or "(empty body)", None, None, [], False


def _looks_not_found(message: str) -> bool:
    # "user not found", "acl policy not found"; not 'tag not found: "tag:x"', a validation error.
    return message.lower().rstrip(" .").endswith("not found")


def _looks_duplicate(message: str) -> bool:
    lowered = message.lower()
    return "unique constraint" in lowered or "already exists" in lowered


def error_from_response(status: int, headers: Mapping[str, str], body: bytes, *, method: str = "",
                        path: str = "", policy: bool = False) -> APIError:
    """The exception for a failure answer.

    The rule for 5xx, because Headscale 0.29 sends validation failures as HTTP 500:

    1. gRPC code 5/6/3/9/11 map as their 4xx twins (NotFound, AlreadyExists, InvalidRequest).
    2. gRPC code 2 (Unknown, i.e. a plain Go error) is Headscale's final answer: on a policy call
       it is PolicyRejected; otherwise a message ending in "not found" gives NotFound, a duplicate
       gives AlreadyExists, anything else InvalidRequest.
    3. gRPC code 13 (Internal) with a duplicate message gives AlreadyExists (0.29 duplicate user
       names), otherwise a non-transient ServerError.
    4. Every other 5xx is a ServerError; see :class:`ServerError` for ``transient``.

    ``policy=True`` (policy PUT and check) turns an InvalidRequest into PolicyRejected.
    """
    message, grpc_code, problem_type, details, from_headscale = _parse_body(headers, body)
    kwargs: dict[str, Any] = {"status": status, "grpc_code": grpc_code, "problem_type": problem_type,
                              "details": details, "method": method, "path": path}
    cls: type[APIError]
    if status == 401 or grpc_code == GRPC_UNAUTHENTICATED:
        cls = Unauthorized
    elif status == 403 or grpc_code == GRPC_PERMISSION_DENIED:
        cls = Forbidden
    elif status == 404 or grpc_code == GRPC_NOT_FOUND:
        cls = NotFound
    elif grpc_code == GRPC_ALREADY_EXISTS:
        cls = AlreadyExists
    elif status == 409:
        cls = Conflict
    elif status in (400, 422) or grpc_code in (GRPC_INVALID_ARGUMENT, GRPC_FAILED_PRECONDITION, GRPC_OUT_OF_RANGE):
        cls = InvalidRequest
    elif grpc_code == GRPC_UNKNOWN and policy:
        cls = InvalidRequest  # becomes PolicyRejected below
    elif grpc_code == GRPC_UNKNOWN:
        cls = NotFound if _looks_not_found(message) else AlreadyExists if _looks_duplicate(message) else InvalidRequest
    elif grpc_code == GRPC_INTERNAL and _looks_duplicate(message):
        cls = AlreadyExists
    elif status >= 500 or status < 400:
        if grpc_code is not None:
            transient = grpc_code in TRANSIENT_GRPC_CODES
        else:
            transient = status in GATEWAY_STATUSES or not from_headscale
        return ServerError(message, transient=transient, **kwargs)
    else:
        cls = InvalidRequest  # another 4xx: the request itself is at fault
    if policy and cls is InvalidRequest:
        cls = PolicyRejected
    return cls(message, **kwargs)
