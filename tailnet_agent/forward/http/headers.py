"""The header policy: which headers cross the agent, which it drops and which it adds.

Pure functions of header lists, so that HTTP/1.1 and HTTP/2 (and their trailers) follow one rule.
Hop-by-hop headers (and those ``Connection`` names) are dropped, X-Forwarded-For/-Proto/-Host are
set, and the caller's identity is sent in the ``Tailnet-*`` headers (:func:`identity_headers`).
Every header the client sent in the identity namespace (:func:`identity_named`) is dropped first,
so the only ones a backend receives are the agent's.
"""

from __future__ import annotations

import email.charset
from collections.abc import Iterable

from tailnet_agent.contract.exposes import FORWARDED, HOP_BY_HOP, VirtualHost, identity_named

from .identity import Identity

USER_LOGIN, USER_NAME = "Tailnet-User-Login", "Tailnet-User-Name"
NODE_NAME, NODE_TAGS = "Tailnet-Node-Name", "Tailnet-Node-Tags"
Headers = list[tuple[str, str]]


# -- the host a request names ---------------------------------------------------------------------

def host_of(authority: str | None) -> str:
    """The host of a Host header or ``:authority``: lower-case, without port and trailing dot."""
    text = (authority or "").strip().lower()
    if text.startswith("["):
        text = text[:text.find("]") + 1]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def misdirected(host: VirtualHost, authority: str | None) -> bool:
    """The request names a host the one the TLS connection was made for does not answer to."""
    return host.match(host_of(authority)) is None


def misdirected_text(host: VirtualHost, authority: str) -> str:
    """The body of the 421 answer, the same for HTTP/1.1 and HTTP/2."""
    return f"421 Misdirected Request: this connection is for {host.name}, not {host_of(authority) or '(no host)'}\n"


# -- identity headers -----------------------------------------------------------------------------

def header_value(text: str) -> str:
    """``text`` as a header value: printable ASCII as is, anything else RFC 2047 Q-encoded UTF-8
    (as ``tailscale serve`` encodes its identity headers)."""
    if all(c == "\t" or " " <= c <= "~" for c in text):
        return text
    charset = email.charset.Charset("utf-8")
    charset.header_encoding = email.charset.QP
    return charset.header_encode(text)


def identity_headers(identity: Identity | None) -> Headers:
    """``Tailnet-Node-Name`` always; ``Tailnet-Node-Tags`` (comma-separated) for a tagged node, else
    ``Tailnet-User-Login`` and ``Tailnet-User-Name`` when the netmap has the owner's profile."""
    if identity is None:
        return []
    out = [(NODE_NAME, header_value(identity.node_name))]
    if identity.tags:
        return [*out, (NODE_TAGS, header_value(",".join(identity.tags)))]
    if identity.login_name:
        out.append((USER_LOGIN, header_value(identity.login_name)))
    if identity.display_name:
        out.append((USER_NAME, header_value(identity.display_name)))
    return out


# -- requests, responses, trailers ----------------------------------------------------------------

def wants_trailers(headers: Iterable[tuple[str, str]]) -> bool:
    """The client said ``TE: trailers`` (gRPC does; it is the only TE value HTTP/2 allows)."""
    return any(k.lower() == "te" and "trailers" in {t.strip().lower() for t in v.split(",")} for k, v in headers)


def _connection_named(items: Headers) -> set[str]:
    """The headers ``Connection`` names: hop-by-hop for this message, whatever their name."""
    return {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}


def request_headers(headers: Iterable[tuple[str, str]], *, client: str, authority: str,
                    identity: Identity | None = None, trailers: bool = False, host: str | None = None,
                    scheme: str = "https") -> Headers:
    """Headers for the backend: hop-by-hop (and those ``Connection`` names), the client's
    forwarding headers and every header in the identity namespace (:func:`identity_named`)
    dropped; Host kept (or ``host``, a route's rewrite); X-Forwarded-For/-Proto/-Host (the
    client's ``authority``; -Proto the ``scheme`` the client spoke) and the identity headers set;
    ``TE: trailers`` kept when ``trailers`` (an HTTP/2 backend)."""
    items = [(k, v) for k, v in headers if not k.startswith(":")]
    named = _connection_named(items)
    te = [("te", "trailers")] if trailers and wants_trailers(items) else []
    out = [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | FORWARDED | named | {"host"}
           and not identity_named(k)]
    return [("Host", host or authority), *out, *te, ("X-Forwarded-For", client), ("X-Forwarded-Proto", scheme),
            ("X-Forwarded-Host", authority), *identity_headers(identity)]


def response_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    """The backend's response headers without hop-by-hop ones."""
    items = list(headers)
    named = _connection_named(items)
    return [(k, v) for k, v in items if k.lower() not in HOP_BY_HOP | named]


def trailer_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    """Trailers as they may be forwarded: no pseudo-headers, no hop-by-hop fields, lower-case names."""
    return [(k.lower(), v) for k, v in headers if not k.startswith(":") and k.lower() not in HOP_BY_HOP]


def request_trailers(headers: Iterable[tuple[str, str]]) -> Headers:
    """A client's trailers for the backend: :func:`trailer_headers` without the identity namespace."""
    return [(k, v) for k, v in trailer_headers(headers) if not identity_named(k)]
