"""The http expose: TLS terminated on the agent (or none, plaintext), HTTP/1.1 and HTTP/2 to clients
and to the app.

The http exposes on one tailnet port share its listener (:class:`HttpPort`). Each accepted
tailnet connection is paused until :meth:`HttpPort.serve` runs ``loop.start_tls``: the SNI
callback finds the host named in SNI among the hosts of every http expose on that port and
switches to its certificate (an unknown name is refused with ``unrecognized_name``; no SNI means
the first host of the first of those exposes in the file). The host so chosen binds the
connection to its expose (:class:`HttpService`): a request whose Host (or ``:authority``) is not
that host's name or alias gets 421 Misdirected Request. A host with routes sends each request
where its best matching route says (:mod:`.routes`: the Ingress's paths, the HTTPRoute's method,
header and query matches, weighted backends, redirects, rewrites and header edits); one no route
matches goes to the expose's backend, or gets 404 when the host has no fallback. ALPN ``h2`` is
served with the ``h2`` library, anything else by aiohttp's HTTP/1.1 server protocol. A plaintext
expose's port (no TLS, no ALPN) serves HTTP/2 to a connection that opens with the HTTP/2 preface
(prior knowledge, h2c: how gRPC clients call an ``http://`` address) and HTTP/1.1 to any other.

Requests go to the backend over HTTP/1.1 with an aiohttp client (``protocol: http1``) or over
HTTP/2 (``protocol: h2``: h2c with prior knowledge for ``scheme: http``, h2 over TLS for
``https``; :mod:`tailnet_agent.forward.h2backend`); HTTPS to the app is verified against the
expose's CA file (or the system roots) for its server name, always. Hop-by-hop headers are
dropped, X-Forwarded-For/-Proto/-Host set, and the caller's identity from the netmap is sent in the
``Tailnet-*`` headers (:func:`identity_headers`). Every header the client sent in the identity
namespace (``Tailnet-*`` and ``Tailscale-*``, in any case, ``_`` read as ``-``) is dropped, from
HTTP/1.1 and HTTP/2 requests and HTTP/2 request trailers alike, so the only ones a backend
receives are the agent's. Trailers cross only where both sides are HTTP/2 (gRPC): an HTTP/2
client's request trailers reach an h2 backend, an h2 backend's response trailers reach an HTTP/2
client; HTTP/1.1 on either side drops them (aiohttp reads and writes none). A backend that cannot
be reached, or whose certificate does not verify, gives 502 and a log line naming why; one that
fails after the response began resets the stream (HTTP/2) or aborts the connection (HTTP/1.1).

Certificates are read again when their files change (checked, by ``stat``, before each handshake
and for ``/status``): new handshakes get the new certificate, open connections keep theirs. A file
that does not load keeps the certificate in force and shows its error on ``/status``.

One concept a module, each importing only those below it:

* :mod:`.ports`: :class:`SharedPort`, the listener the exposes of one port share;
* :mod:`.sni`: :class:`HttpPort`, the SNI routing to an expose over TLS;
* :mod:`.plain`: :class:`PlainHttpPort`, plaintext HTTP/1.1 and h2c, the host chosen per request by Host;
* :mod:`.service`: :class:`HttpService`, one expose's certificates, backend and connections;
* :mod:`.http1` and :mod:`.http2`: the client side of each HTTP version;
* :mod:`.upstream`: the backend clients and the shape of their answer;
* :mod:`.routes`: request routing (pure);
* :mod:`.handover`: a connection's way from the listener to its HTTP protocol;
* :mod:`.certs`: the certificate store;
* :mod:`.headers` and :mod:`.identity`: the header policy and who the caller is.
"""

from .headers import (
    header_value,
    host_of,
    identity_headers,
    misdirected,
    request_headers,
    response_headers,
    trailer_headers,
)
from .identity import Identity, identify
from .plain import PlainHttpPort
from .ports import SharedPort
from .service import HttpService
from .sni import HttpPort

__all__ = [
    "HttpPort",
    "HttpService",
    "Identity",
    "PlainHttpPort",
    "SharedPort",
    "header_value",
    "host_of",
    "identify",
    "identity_headers",
    "misdirected",
    "request_headers",
    "response_headers",
    "trailer_headers",
]
