"""The REST client: the one place that speaks HTTP to kube-apiserver.

One aiohttp session carries every request. Failures become the exceptions of
:mod:`tailnet_operator.runtime.errors`; every request, failed or not, is counted in
``rest_client_requests_total{code,method,host}`` (``code`` is ``<error>`` when no HTTP answer
came back, as in client-go).

Server-side apply is the only way the operator writes objects it owns: one field manager,
``force=true``, on the object and separately on its ``/status``.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from tailnet_operator.types import JSON

from ..errors import Gone, KubeError, TransportError, from_status
from ..kinds import Resource
from .config import RestConfig
from .ownwrite import OwnWrite, record

DEFAULT_TIMEOUT = 30.0
"""Seconds a non-watch request may take from start to end."""

DEFAULT_PAGE_SIZE = 500

METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
"""Accept headers that ask the apiserver for objects' metadata only (what controller-runtime's
metadata client sends); the body of a Secret or ConfigMap never crosses the wire."""
"""Objects per page of a list, as client-go's pager."""

MIN_WATCH_TIMEOUT = 300.0
"""Server-side watch timeouts are drawn from [MIN, 2*MIN) seconds, as client-go's reflector."""

WATCH_INACTIVITY_TIMEOUT = 70.0
"""Seconds without a byte on a watch (bookmarks arrive about once a minute) before it is
treated as dead and reconnected."""

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"


class RequestCounter(Protocol):
    """Receives one call per finished request (see runtime.metrics.RestClientMetrics)."""

    def request_done(self, *, code: str, method: str, host: str) -> None: ...


@dataclass
class WatchEvent:
    """One line of a watch: ADDED, MODIFIED, DELETED or BOOKMARK, with the object."""

    type: str
    object: JSON

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


@dataclass
class ObjectList:
    """The items of a (possibly paged) list and the resourceVersion to watch from."""

    items: list[JSON]
    resource_version: str
    kind: str = ""
    extra: JSON = field(default_factory=dict)


WriteObserver = Callable[[Resource, JSON], None]
"""Told every object a write stored (create, replace, apply, patch), e.g. to update a cache."""


DEFAULT_FIELD_MANAGER = "controller-manager"
"""The field manager (and user agent) of a client that is given none; a program names itself."""


class Client:
    """Async access to kube-apiserver. Use as ``async with Client(config) as client``.

    ``field_manager`` names the writer in managedFields (every apply without its own uses it),
    ``user_agent`` in the apiserver's logs and audit (default: the field manager). Implements
    :class:`~.interfaces.Writer` and :class:`~.interfaces.ListerWatcher`.
    """

    def __init__(self, config: RestConfig, *, field_manager: str = DEFAULT_FIELD_MANAGER,
                 metrics: RequestCounter | None = None, timeout: float = DEFAULT_TIMEOUT,
                 user_agent: str | None = None) -> None:
        self.config = config
        self.field_manager = field_manager
        self._metrics = metrics
        self._timeout = timeout
        self._host = urlsplit(config.host).netloc
        self._user_agent = user_agent or field_manager
        self._session: aiohttp.ClientSession | None = None
        self._observers: list[WriteObserver] = []

    def add_write_observer(self, observer: WriteObserver) -> None:
        """Call ``observer(resource, stored)`` after every successful write that returns the object."""
        self._observers.append(observer)

    def _stored(self, resource: Resource, result: JSON, sent: JSON) -> JSON:
        """Record the write (:func:`.ownwrite.record`: a controller tells the events of its own
        writes from others' by it), then tell the observers of ``result``."""
        if result.get("metadata", {}).get("resourceVersion"):
            record(OwnWrite(resource, sent, result))
            for observer in self._observers:
                observer(resource, result)
        return result

    async def __aenter__(self) -> Client:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def open(self) -> None:
        if self._session is None:
            headers = {"User-Agent": self._user_agent, "Accept": "application/json"}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context(), limit=0)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- reads ------------------------------------------------------------------------------

    async def get(self, resource: Resource, name: str, namespace: str | None = None,
                  *, subresource: str | None = None) -> JSON:
        return await self.request("GET", resource.path(namespace, name, subresource))

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str | None = None, field_selector: str | None = None,
                   page_size: int = DEFAULT_PAGE_SIZE, resource_version: str | None = None,
                   metadata_only: bool = False) -> ObjectList:
        """All objects, fetched in pages of ``page_size`` (0: one unpaged request); with
        ``metadata_only`` the server sends each object's metadata only (PartialObjectMetadata)."""
        params: dict[str, str] = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        if page_size:
            params["limit"] = str(page_size)
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        items: list[JSON] = []
        while True:
            page = await self.request("GET", resource.path(namespace), params=params,
                                      accept=METADATA_LIST_ACCEPT if metadata_only else None)
            found = page.get("items") or []
            items += found if metadata_only else [resource.typed(item) for item in found]
            meta = page.get("metadata", {})
            token = meta.get("continue")
            if not token:
                return ObjectList(items, str(meta.get("resourceVersion", "")), str(page.get("kind", "")))
            params = {k: v for k, v in params.items() if k != "resourceVersion"} | {"continue": token}

    async def watch(self, resource: Resource, namespace: str | None = None, *, resource_version: str,
                    label_selector: str | None = None, field_selector: str | None = None,
                    timeout_seconds: float | None = None, bookmarks: bool = True,
                    inactivity_timeout: float = WATCH_INACTIVITY_TIMEOUT,
                    metadata_only: bool = False) -> AsyncIterator[WatchEvent]:
        """Stream events after ``resource_version`` until the server ends the watch (objects as
        metadata only with ``metadata_only``).

        Raises :class:`Gone` when the version is too old (the caller relists) and
        :class:`TransportError` when the stream breaks or stays silent longer than
        ``inactivity_timeout`` seconds. Lines of any length are accepted.
        """
        if timeout_seconds is None:
            timeout_seconds = MIN_WATCH_TIMEOUT * (1 + random.random())
        params = {"watch": "true", "resourceVersion": resource_version,
                  "timeoutSeconds": str(int(timeout_seconds)),
                  "allowWatchBookmarks": "true" if bookmarks else "false"}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=inactivity_timeout)
        async with self._open("GET", resource.path(namespace), params=params, timeout=timeout,
                              accept=METADATA_ACCEPT if metadata_only else None) as resp:
            try:
                async for line in _lines(resp.content):
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object", {})
                        raise from_status(int(status.get("code", 500)), status)
                    yield WatchEvent(str(event["type"]), event["object"])
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise TransportError(f"watch {resource} broke: {exc!r}") from exc

    # -- writes -----------------------------------------------------------------------------

    async def create(self, resource: Resource, body: JSON, namespace: str | None = None) -> JSON:
        return self._stored(resource, await self.request("POST", resource.path(namespace or _ns(body)), body=body),
                            body)

    async def replace(self, resource: Resource, body: JSON, *, subresource: str | None = None) -> JSON:
        """PUT the whole object; ``metadata.resourceVersion`` in ``body`` makes it conditional."""
        namespace, name = _ns(body), body["metadata"]["name"]
        return self._stored(resource, await self.request("PUT", resource.path(namespace, name, subresource), body=body),
                            body)

    async def apply(self, resource: Resource, body: JSON, *, subresource: str | None = None,
                    force: bool = True, field_manager: str | None = None) -> JSON:
        """Server-side apply ``body`` (only the fields this manager owns) and return the result.

        ``subresource="status"`` applies the status, which needs the object to exist.
        ``field_manager`` overrides the client's for one part of an object that another
        reconciler also applies (each manager owns only the fields it sends).
        """
        body = {"apiVersion": resource.api_version, "kind": resource.kind, **body}
        path = resource.path(_ns(body), body["metadata"]["name"], subresource)
        params = {"fieldManager": field_manager or self.field_manager}
        if force:
            params["force"] = "true"
        return self._stored(resource, await self.request("PATCH", path, body=body, params=params,
                                                         content_type=APPLY_CONTENT_TYPE), body)

    async def apply_status(self, resource: Resource, body: JSON, *, field_manager: str | None = None) -> JSON:
        return await self.apply(resource, body, subresource="status", field_manager=field_manager)

    async def merge_patch(self, resource: Resource, name: str, patch: JSON, namespace: str | None = None,
                          *, subresource: str | None = None) -> JSON:
        return self._stored(resource, await self.request("PATCH", resource.path(namespace, name, subresource),
                                                         body=patch, content_type=MERGE_PATCH_CONTENT_TYPE), patch)

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str | None = None, resource_version: str | None = None,
                     propagation: str | None = None) -> JSON:
        """Delete, optionally only if the object still has ``uid`` / ``resource_version``."""
        body: JSON = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            body["preconditions"] = preconditions
        if propagation:
            body["propagationPolicy"] = propagation
        return await self.request("DELETE", resource.path(namespace, name), body=body)

    # -- the one request method ------------------------------------------------------------

    async def request(self, method: str, path: str, *, body: Any = None,
                      params: Mapping[str, str] | None = None,
                      content_type: str = "application/json", accept: str | None = None) -> JSON:
        """Send one request and decode the JSON answer; failures raise KubeError subclasses."""
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with self._open(method, path, body=body, params=params, content_type=content_type,
                              timeout=timeout, accept=accept) as resp:
            try:
                payload = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise TransportError(f"{method} {path}: reading the answer failed: {exc!r}") from exc
        result: JSON = json.loads(payload) if payload else {}
        return result

    def _open(self, method: str, path: str, *, timeout: aiohttp.ClientTimeout, body: Any = None,
              params: Mapping[str, str] | None = None,
              content_type: str = "application/json", accept: str | None = None) -> _Response:
        if self._session is None:
            raise KubeError("the client is not open: use 'async with Client(...)'")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        if accept:
            headers["Accept"] = accept
        return _Response(self, method, self.config.host + path, params=params, data=data,
                         headers=headers, timeout=timeout)

    def _count(self, code: str, method: str) -> None:
        if self._metrics is not None:
            self._metrics.request_done(code=code, method=method, host=self._host)


class _Response:
    """Context manager around one aiohttp request: maps errors, counts the request."""

    def __init__(self, client: Client, method: str, url: str, **kwargs: Any) -> None:
        self._client = client
        self._method = method
        self._url = url
        self._kwargs = kwargs
        self._resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        session = self._client._session
        assert session is not None
        try:
            resp = await session.request(self._method, self._url, **self._kwargs)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._client._count("<error>", self._method)
            raise TransportError(f"{self._method} {self._url}: {exc!r}",
                                 unsent=isinstance(exc, aiohttp.ClientConnectorError)) from exc
        self._client._count(str(resp.status), self._method)
        if resp.status >= 400:
            try:
                text = await resp.text()
            finally:
                resp.release()
            try:
                decoded: Any = json.loads(text)
            except ValueError:
                decoded = text
            retry_after = resp.headers.get("Retry-After")
            raise from_status(resp.status, decoded, float(retry_after) if retry_after else None)
        self._resp = resp
        return resp

    async def __aexit__(self, *exc: object) -> None:
        if self._resp is not None:
            self._resp.release()


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Split a stream on newlines with no limit on line length (aiohttp's readline has one)."""
    buffer = bytearray()
    async for chunk in stream.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end]).strip()
            del buffer[: end + 1]
            if line:
                yield line
    if buffer.strip():
        yield bytes(buffer).strip()


def _ns(body: JSON) -> str | None:
    namespace = body.get("metadata", {}).get("namespace")
    return str(namespace) if namespace else None


__all__ = ["JSON", "Client", "Gone", "ObjectList", "WatchEvent"]
