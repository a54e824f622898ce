"""The transport seam: one async method that turns a :class:`Request` into a :class:`Response`.

The client builds requests and interprets responses; a transport only moves bytes. Failures
without an HTTP answer are raised as :class:`~._errors.TransportError` subclasses, which the
client's retry rule understands. :class:`AiohttpTransport` is the real one;
:class:`MockTransport` wraps a handler function for tests.
"""

from __future__ import annotations

import inspect
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from ._errors import ConnectError, RequestTimeout, TLSVerificationError, TransportError


@dataclass(frozen=True)
class Request:
    """One HTTP request, sent as-is. ``headers`` hold the API key and are left out of the repr."""

    method: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    body: bytes | None = None
    timeout: float = 10.0
    """Seconds this attempt may take, connect to last byte."""


@dataclass(frozen=True)
class Response:
    """One HTTP response. Header names are lower-case."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


class Transport(Protocol):
    """Sends one request. Raises a TransportError subclass when no HTTP answer came back."""

    async def handle(self, request: Request) -> Response: ...


class MockTransport:
    """A transport backed by ``handler(request) -> Response`` (plain or async), for tests.

    The handler may raise a TransportError subclass to simulate a network failure.
    """

    def __init__(self, handler: Callable[[Request], Response | Awaitable[Response]]) -> None:
        self._handler = handler

    async def handle(self, request: Request) -> Response:
        result = self._handler(request)
        if inspect.isawaitable(result):
            return await result
        return result


def ssl_context(ca_bundle: str | Path | None) -> ssl.SSLContext:
    """A verifying TLS context: the system roots when ``ca_bundle`` is None, else only that CA.

    A ``str`` that contains ``-----BEGIN`` is PEM text; any other ``str`` or a ``Path`` is a file.
    """
    if ca_bundle is None:
        return ssl.create_default_context()
    if isinstance(ca_bundle, str) and "-----BEGIN" in ca_bundle:
        return ssl.create_default_context(cadata=ca_bundle)
    return ssl.create_default_context(cafile=str(ca_bundle))


class AiohttpTransport:
    """HTTP over one aiohttp session, opened on the first request and closed by :meth:`aclose`.

    Redirects are not followed: the API never sends one, and following it could carry the
    key to another host.
    """

    def __init__(self, *, ca_bundle: str | Path | None = None, user_agent: str = "tailnet-operator") -> None:
        self._ssl = ssl_context(ca_bundle)
        self._user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    async def handle(self, request: Request) -> Response:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl),
                headers={"User-Agent": self._user_agent},
            )
        timeout = aiohttp.ClientTimeout(total=request.timeout)
        try:
            async with self._session.request(request.method, request.url, headers=dict(request.headers),
                                             data=request.body, timeout=timeout,
                                             allow_redirects=False) as resp:
                body = await resp.read()
                headers = {k.lower(): v for k, v in resp.headers.items()}
                return Response(status=resp.status, headers=headers, body=body)
        except aiohttp.ClientConnectorCertificateError as exc:
            raise TLSVerificationError(f"TLS verification failed for {request.url}: {exc.certificate_error} "
                                       "(is the CA bundle the one that signed Headscale's certificate?)") from exc
        except aiohttp.ClientSSLError as exc:
            raise TLSVerificationError(f"TLS handshake failed for {request.url}: {exc}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectError(f"cannot connect to {request.url}: {exc.os_error}") from exc
        except TimeoutError as exc:
            raise RequestTimeout(f"{request.method} {request.url} took longer than {request.timeout:g}s") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{request.method} {request.url} failed: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the session; a later request opens a new one."""
        if self._session is not None:
            await self._session.close()
            self._session = None
