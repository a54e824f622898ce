"""Where the API server is and how to authenticate, from a kubeconfig or the in-cluster files.

Parsing is delegated to the ``kubernetes`` package's loaders; this module turns their result
into what an aiohttp session needs and keeps the package off every hot path.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path


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


def load(kubeconfig: str | os.PathLike[str] | None = None, *, context: str | None = None) -> RestConfig:
    """Load from ``kubeconfig`` when given; otherwise in-cluster, then $KUBECONFIG / ~/.kube/config."""
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
