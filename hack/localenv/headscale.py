"""A real Headscale on 127.0.0.1 (or the local node's address, for pods): TLS from a test CA,
embedded DERP, policy in the database.

Each instance has its own state directory (a fresh SQLite database). The bootstrap API key
is created through Headscale's own CLI over its unix socket, as an administrator would.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from hack import binaries

from ._pki import CertificateAuthority
from ._process import ManagedProcess, free_port, socket_dir, wait_until

BASE_DOMAIN = "tailnet.test"
"""The MagicDNS base domain: a node's name is ``<given name>.tailnet.test``."""

START_TIMEOUT = 30.0


class HeadscaleError(RuntimeError):
    """An API call to the test Headscale failed; carries the status and body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"headscale API returned {status}: {body}")
        self.status = status
        self.body = body


class Headscale:
    """One Headscale server. ``url`` is both the login URL and the API URL."""

    def __init__(self, workdir: Path, *, log_dir: Path, run_id: str, name: str = "headscale",
                 ca: CertificateAuthority | None = None, address: str = "127.0.0.1",
                 extra_records: list[dict[str, str]] | None = None, stun_ipv6: bool = False) -> None:
        self.workdir = workdir
        self.stun_ipv6 = stun_ipv6
        """STUN answers on ``[::1]`` only and the DERP map names ``::1`` beside the IPv4 address: a node
        learns only an IPv6 endpoint from STUN (its DERP connection stays on IPv4)."""
        self.extra_records = list(extra_records or ())
        """``dns.extra_records`` (``{"name", "type", "value"}``): tailnet DNS names that are not nodes."""
        self.split_dns: dict[str, list[str]] = {}
        """``dns.nameservers.split``: a zone's nameservers, which clients reach over the tailnet."""
        self.name = name
        self.address = address
        self.port = free_port()
        self.stun_port = free_port()
        self.url = f"https://{address}:{self.port}"
        self.config_path = workdir / "config.yaml"
        self._socket_dir: Path | None = None
        """Made by :meth:`start`, removed by :meth:`stop`: a server never started leaves none behind."""
        self.ca = ca or CertificateAuthority(workdir / "pki", "headscale")
        self.api_key = ""
        self.version = binaries.selected(binaries.HEADSCALE).version
        """The Headscale release this server runs (the pin, or ``$TAILNET_HEADSCALE_VERSION``)."""
        self.process = ManagedProcess(name, [binaries.binary("headscale"), "-c", self.config_path, "serve"],
                                      log_dir=log_dir, run_id=run_id)

    @property
    def minor(self) -> tuple[int, int]:
        """``(0, 29)`` for 0.29.2: what tests compare to decide which behaviour to expect."""
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def ca_bundle(self) -> Path:
        """PEM file with the CA that signed Headscale's serving certificate."""
        return self.ca.cert_path

    def start(self) -> Headscale:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._socket_dir is None:
            self._socket_dir = socket_dir("tnhs-")
        serving = self.ca.issue(f"{self.name}-serving", common_name="headscale",
                                hosts=tuple(dict.fromkeys(("127.0.0.1", "localhost", self.address))))
        self._serving = serving
        self.config_path.write_text(yaml.safe_dump(self._config(serving.cert, serving.key)))
        self.process.start()
        wait_until(self._healthy, timeout=START_TIMEOUT, what=f"{self.name} /health")
        self.api_key = self.cli("apikeys", "create", "--expiration", "24h").strip().splitlines()[-1]
        return self

    def restart(self) -> None:
        """Stop and start on the same port and database, as an upgrade or crash would."""
        self.process.stop()
        self.process.start()
        wait_until(self._healthy, timeout=START_TIMEOUT, what=f"{self.name} /health")

    def set_split_dns(self, split: dict[str, list[str]]) -> None:
        """Send each zone's queries to its nameservers: Headscale reads DNS settings only from its
        configuration file, so this rewrites the file and restarts (as its operator would)."""
        self.split_dns = {zone: list(servers) for zone, servers in split.items()}
        self.config_path.write_text(yaml.safe_dump(self._config(self._serving.cert, self._serving.key)))
        self.restart()

    def stop(self) -> None:
        self.process.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    # -- the admin surfaces -----------------------------------------------------------------

    def cli(self, *args: str) -> str:
        """Run the headscale CLI against this server's unix socket; return stdout."""
        proc = subprocess.run([str(binaries.binary("headscale")), "-c", str(self.config_path), *args],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"headscale {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_bundle))

    def api(self, method: str, path: str, body: Any = None, *, api_key: str | None = None) -> Any:
        """Call the REST API (``/api/v1/...``) with the bootstrap key unless another is given."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers={
            "Authorization": f"Bearer {api_key or self.api_key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=10) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise HeadscaleError(exc.code, exc.read().decode(errors="replace")) from None

    def create_user(self, name: str) -> dict[str, Any]:
        user: dict[str, Any] = self.api("POST", "/api/v1/user", {"name": name})["user"]
        return user

    def create_preauth_key(self, *, user_id: str | None = None, tags: list[str] | None = None,
                           reusable: bool = False, ephemeral: bool = False,
                           lifetime: dt.timedelta = dt.timedelta(hours=1)) -> str:
        """A pre-auth key; tagged when ``tags`` are given (then no user is needed from 0.28 on; before,
        the key is made under the user ``tagged-devices``, as the operator's client does)."""
        expiration = (dt.datetime.now(dt.UTC) + lifetime).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: dict[str, Any] = {"reusable": reusable, "ephemeral": ephemeral, "expiration": expiration}
        if user_id is None and tags and self.minor < (0, 28):
            found = self.api("GET", "/api/v1/user?name=tagged-devices").get("users") or []
            user_id = found[0]["id"] if found else self.create_user("tagged-devices")["id"]
        if user_id is not None:
            body["user"] = user_id
        if tags:
            body["aclTags"] = tags
        key: str = self.api("POST", "/api/v1/preauthkey", body)["preAuthKey"]["key"]
        return key

    def nodes(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.api("GET", "/api/v1/node").get("nodes", [])
        return nodes

    def node_by_name(self, name: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes() if n.get("givenName") == name or n.get("name") == name), None)

    def approve_routes(self, node_id: str, routes: list[str]) -> dict[str, Any]:
        node: dict[str, Any] = self.api("POST", f"/api/v1/node/{node_id}/approve_routes",
                                        {"routes": routes})["node"]
        return node

    # -- internals --------------------------------------------------------------------------

    def _healthy(self) -> bool:
        self.process.check_running()
        with urllib.request.urlopen(f"{self.url}/health", context=self.ssl_context(), timeout=2) as resp:
            return bool(json.loads(resp.read()).get("status") == "pass")

    def _config(self, cert: Path, key: Path) -> dict[str, Any]:
        state = self.workdir
        assert self._socket_dir is not None, "configured by start()"
        return {
            "server_url": self.url,
            "listen_addr": f"{self.address}:{self.port}",
            "metrics_listen_addr": "",
            "grpc_listen_addr": "127.0.0.1:0",
            "unix_socket": str(self._socket_dir / "headscale.sock"),
            "unix_socket_permission": "0770",
            "disable_check_updates": True,
            "tls_cert_path": str(cert),
            "tls_key_path": str(key),
            "noise": {"private_key_path": str(state / "noise_private.key")},
            "prefixes": {"v4": "100.64.0.0/10", "v6": "fd7a:115c:a1e0::/48", "allocation": "sequential"},
            "derp": {
                "server": {
                    "enabled": True, "region_id": 999, "region_code": "local", "region_name": "local",
                    "stun_listen_addr": f"{'[::1]' if self.stun_ipv6 else self.address}:{self.stun_port}",
                    "private_key_path": str(state / "derp_server_private.key"),
                    "automatically_add_embedded_derp_region": True,
                    "ipv4": self.address,
                    **({"ipv6": "::1"} if self.stun_ipv6 else {}),
                },
                "urls": [], "paths": [], "auto_update_enabled": False, "update_frequency": "24h",
            },
            "database": {"type": "sqlite", "sqlite": {"path": str(state / "db.sqlite"),
                                                      "write_ahead_log": True}},
            "policy": {"mode": "database"},
            "dns": {"magic_dns": True, "base_domain": BASE_DOMAIN, "override_local_dns": False,
                    "nameservers": {"global": [], "split": self.split_dns}, "extra_records": self.extra_records},
            "node": {"ephemeral": {"inactivity_timeout": "70s"}},
            "log": {"level": "info", "format": "text"},
            "logtail": {"enabled": False},
        }
