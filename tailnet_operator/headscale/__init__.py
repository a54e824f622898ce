"""Async client of the Headscale REST API, 0.26 to 0.30 (what differs: ``_versions``).

``HeadscaleClient`` is the entry point; the modules behind it are private. Errors form one
hierarchy rooted at :class:`HeadscaleError` (drawn in ``_errors``); results are frozen
dataclasses; ``Transport``/``MockTransport`` are the seam tests use instead of the network.
"""

from ._client import (
    DEFAULT_API_KEY_LIFETIME,
    DEFAULT_ATTEMPTS,
    DEFAULT_BACKOFF,
    DEFAULT_PREAUTH_KEY_LIFETIME,
    DEFAULT_TIMEOUT,
    TAGGED_KEYS_USER,
    Expiration,
    HeadscaleClient,
)
from ._errors import (
    AlreadyExists,
    APIError,
    Conflict,
    ConnectError,
    Forbidden,
    HeadscaleError,
    InvalidRequest,
    NotFound,
    PolicyRejected,
    RequestTimeout,
    ServerError,
    TLSVerificationError,
    TransportError,
    Unauthorized,
    Unsupported,
)
from ._models import ApiKey, Health, NewApiKey, Node, Policy, PreAuthKey, User, mask_key, raw_api_key_prefix
from ._transport import AiohttpTransport, MockTransport, Request, Response, Transport
from ._versions import NEWEST_KNOWN, OLDEST_SUPPORTED, ServerFeatures, parse_version

__all__ = [
    "DEFAULT_API_KEY_LIFETIME",
    "DEFAULT_ATTEMPTS",
    "DEFAULT_BACKOFF",
    "DEFAULT_PREAUTH_KEY_LIFETIME",
    "DEFAULT_TIMEOUT",
    "NEWEST_KNOWN",
    "OLDEST_SUPPORTED",
    "TAGGED_KEYS_USER",
    "APIError",
    "AiohttpTransport",
    "AlreadyExists",
    "ApiKey",
    "Conflict",
    "ConnectError",
    "Expiration",
    "Forbidden",
    "HeadscaleClient",
    "HeadscaleError",
    "Health",
    "InvalidRequest",
    "MockTransport",
    "NewApiKey",
    "Node",
    "NotFound",
    "Policy",
    "PolicyRejected",
    "PreAuthKey",
    "Request",
    "RequestTimeout",
    "Response",
    "ServerError",
    "ServerFeatures",
    "TLSVerificationError",
    "Transport",
    "TransportError",
    "Unauthorized",
    "Unsupported",
    "User",
    "mask_key",
    "parse_version",
    "raw_api_key_prefix",
]
