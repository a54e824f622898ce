"""Where the API server is and how to authenticate, from a kubeconfig or the in-cluster files.

A kubeconfig whose context names only a server, its CA and a client certificate or a token
(what kubeadm, kind and the local environment write) is read here (:func:`load_plain`); anything
else (exec plugins, auth providers, proxies, several files in ``$KUBECONFIG``) and the in-cluster
files go to the ``kubernetes`` package's loaders. Importing that package costs 0.1-0.3 s of a
process's start (its generated client), which a controller's cold start pays before its first
list. This module turns either result into what an aiohttp session needs and keeps the package
off every hot path.
"""

from __future__ import annotations

import atexit
import base64
import os
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(RuntimeError):
    """No usable cluster configuration was found; the message says where we looked."""


@dataclass(frozen=True)
class RestConfig:
    """Connection settings for kube-apiserver.

    ``token`` is a bearer token (in-cluster service accounts); client certificates are files.
    """

    host: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    verify_ssl: bool = True

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.host.startswith("https"):
            return False
        if not self.verify_ssl:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def __repr__(self) -> str:
        token = "<set>" if self.token else None
        return f"RestConfig(host={self.host!r}, ca_file={self.ca_file!r}, token={token})"


PLAIN_CLUSTER_FIELDS = frozenset({"server", "certificate-authority", "certificate-authority-data",
                                  "insecure-skip-tls-verify", "extensions"})
PLAIN_USER_FIELDS = frozenset({"client-certificate", "client-certificate-data", "client-key", "client-key-data",
                               "token", "extensions"})
"""What :func:`load_plain` reads; a context using any other field is left to the ``kubernetes`` package."""


def load_plain(kubeconfig: str | os.PathLike[str], *, context: str | None = None) -> RestConfig | None:
    """The kubeconfig's context (default: its current one) when it names only the fields of
    :data:`PLAIN_CLUSTER_FIELDS` and :data:`PLAIN_USER_FIELDS`; None otherwise. Embedded
    certificates and keys go to private files that live as long as the process."""
    import yaml

    path = Path(kubeconfig)
    doc = yaml.safe_load(path.read_text()) or {}
    name = context or doc.get("current-context")
    ctx = _named(doc, "contexts", name, "context")
    if ctx is None:
        return None
    cluster = _named(doc, "clusters", ctx.get("cluster"), "cluster")
    user = _named(doc, "users", ctx.get("user"), "user")
    if cluster is None or user is None or not cluster.get("server") \
            or set(cluster) - PLAIN_CLUSTER_FIELDS or set(user) - PLAIN_USER_FIELDS:
        return None
    base = path.resolve().parent
    return RestConfig(
        host=str(cluster["server"]).rstrip("/"),
        ca_file=_file(cluster, "certificate-authority", base),
        cert_file=_file(user, "client-certificate", base),
        key_file=_file(user, "client-key", base),
        token=user.get("token") or None,
        verify_ssl=not cluster.get("insecure-skip-tls-verify", False),
    )


def _named(doc: dict[str, Any], section: str, name: object, field: str) -> dict[str, Any] | None:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(field), dict):
            return dict(entry[field])
    return None


_DATA_DIR: list[str] = []


def _file(section: dict[str, Any], field: str, base: Path) -> str | None:
    """The file of ``field`` (relative to the kubeconfig), or ``field-data`` written to a private file."""
    if section.get(f"{field}-data"):
        if not _DATA_DIR:
            _DATA_DIR.append(tempfile.mkdtemp(prefix="kubeconfig-"))
            atexit.register(shutil.rmtree, _DATA_DIR[0], True)
        fd, name = tempfile.mkstemp(dir=_DATA_DIR[0])
        with os.fdopen(fd, "wb") as out:
            out.write(base64.b64decode(section[f"{field}-data"]))
        return name
    if section.get(field):
        return str(base / str(section[field]))
    return None


def load(kubeconfig: str | os.PathLike[str] | None = None, *, context: str | None = None) -> RestConfig:
    """Load from ``kubeconfig`` when given; otherwise in-cluster, then $KUBECONFIG / ~/.kube/config
    (a plain kubeconfig by :func:`load_plain`, any other by the ``kubernetes`` package)."""
    plain = _plain_file(kubeconfig)
    if plain is not None:
        found = load_plain(plain, context=context)
        if found is not None:
            return found
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            if not Path(kubeconfig).is_file():
                raise ConfigError(f"kubeconfig {kubeconfig} does not exist")
            config.load_kube_config(config_file=str(kubeconfig), context=context,
                                    client_configuration=configuration)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(context=context, client_configuration=configuration)
    except ConfigException as exc:
        raise ConfigError(f"no usable cluster configuration: {exc}") from exc
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    if token and token.lower().startswith("bearer "):
        token = token[len("bearer "):]
    return RestConfig(
        host=configuration.host.rstrip("/"),
        ca_file=configuration.ssl_ca_cert,
        cert_file=configuration.cert_file,
        key_file=configuration.key_file,
        token=token or None,
        verify_ssl=bool(configuration.verify_ssl),
    )


def _plain_file(kubeconfig: str | os.PathLike[str] | None) -> Path | None:
    """The one kubeconfig file ``load`` would read, if it reads one (not in-cluster, not several)."""
    if kubeconfig is not None:
        return Path(kubeconfig) if Path(kubeconfig).is_file() else None
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    env = os.environ.get("KUBECONFIG", "")
    if os.pathsep in env:
        return None
    path = Path(env) if env else Path.home() / ".kube" / "config"
    return path if path.is_file() else None
