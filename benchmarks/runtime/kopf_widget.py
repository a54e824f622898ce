"""The Widget controller of the runtime benchmark on kopf, run in kopf's own virtualenv:
``kopf run --standalone --namespace NS benchmarks/runtime/kopf_widget.py`` with KUBECONFIG set.

Idiomatic settings: posting of k8s Events off, standalone (no peering), ``WIDGET_WORKERS`` workers
(the benchmark's ``--workers``, 32 when unset). kopf keeps
no cache of other kinds, so the ConfigMap is applied on every handling; kopf itself records the
handled spec in an annotation (its diff base) next to the status the handler sets.
"""
# This file is not imported by the project: it runs in a separate virtualenv with kopf installed.
# mypy: ignore-errors

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf
import yaml

GROUP, VERSION, PLURAL = "test.tailnet.dev", "v1", "widgets"
FIELD_MANAGER = "widget-controller"


class Api:
    session: aiohttp.ClientSession | None = None
    server = ""


def _ssl_context() -> ssl.SSLContext:
    config = yaml.safe_load(open(os.environ["KUBECONFIG"]))  # noqa: SIM115
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    Api.server = cluster["server"]
    directory = tempfile.mkdtemp()

    def write(name: str, data: str) -> str:
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    ctx = ssl.create_default_context(cafile=write("ca.crt", cluster["certificate-authority-data"]))
    ctx.load_cert_chain(write("tls.crt", user["client-certificate-data"]), write("tls.key", user["client-key-data"]))
    return ctx


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False
    settings.execution.max_workers = int(os.environ.get("WIDGET_WORKERS", "32"))
    Api.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=_ssl_context()))


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if Api.session is not None:
        await Api.session.close()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(spec: Any, meta: Any, name: str, namespace: str, uid: str, patch: Any, **_: Any) -> None:
    value = spec.get("value", "")
    body = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{name}-data", "namespace": namespace, "ownerReferences": [{
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}]},
        "data": {"value": value},
    }
    assert Api.session is not None
    url = f"{Api.server}/api/v1/namespaces/{namespace}/configmaps/{name}-data"
    async with Api.session.patch(url, data=json.dumps(body),
                                 params={"fieldManager": FIELD_MANAGER, "force": "true"},
                                 headers={"Content-Type": "application/apply-patch+yaml"}) as resp:
        if resp.status >= 300:
            raise kopf.TemporaryError(f"ConfigMap apply: {resp.status} {await resp.text()}", delay=1)
    patch.status["observedGeneration"] = meta["generation"]
    patch.status["value"] = value
