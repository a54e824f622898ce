"""The proxy users of the Tailscale operator get: tailscaled in kernel mode in a pod, forwarding with netfilter.

The Tailscale operator's egress and ingress proxies are containerboot running tailscaled on a TUN
device with ``NET_ADMIN``, and containerboot sets up the packet rewriting (cmd/containerboot's
``installEgressForwardingRule`` and ``installIngressForwardingRule`` of the pinned tailscale
module, through util/linuxfw):

- egress (``TS_TAILNET_TARGET_IP``): everything arriving at the pod not on ``tailscale0`` is
  DNATed to the tailnet target, SNATed to the proxy's tailnet address on the way out, with the
  MSS of forwarded SYNs clamped to the path MTU;
- ingress (``TS_DEST_IP``): what arrives for the proxy's tailnet address is DNATed to the
  Service's ClusterIP, with the same MSS clamp. The replies find their way back because
  tailscaled's own netfilter rules (``--netfilter-mode=on``, the default) masquerade what it
  forwards from ``tailscale0``.

The benchmark builds that shape from the pinned tailscaled (the scratch tailscale image, as the
userspace row) and sets the same rules itself, from the host, in the pod's network namespace:
the image has no iptables and no shell, and containerboot is not built here. tailscaled runs with
``--netfilter-mode=off`` (as the tailnet hosts of :mod:`hack.localenv` do), so the rules of
netfilter mode it would add (the ``ts-*`` chains, and the masquerade of forwarded traffic) are
replaced by the one the path needs: :func:`ingress_rules` adds that masquerade. IP forwarding is
turned on in the pod's namespace from the host, as containerboot does from inside a privileged pod.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hack.localenv import Headscale

__all__ = ["TUN", "egress_rules", "forwarding", "ingress_rules", "install", "kernel_objects", "pod_pid"]

TUN = "/dev/net/tun"
TUN_NAME = "tailscale0"
SOCKET = "/state/tailscaled.sock"
WIREGUARD_PORT = 41641
"""The kernel-mode pod's tailscaled listens here (``--port``), so that :func:`egress_rules` can leave it alone."""

Rule = list[str]


def mss_clamp() -> Rule:
    """util/linuxfw's ``ClampMSSToPMTU``: forwarded SYNs into the tunnel carry an MSS that fits it."""
    return ["-t", "mangle", "-A", "FORWARD", "-o", TUN_NAME, "-p", "tcp", "--tcp-flags", "SYN,RST", "SYN",
            "-j", "TCPMSS", "--clamp-mss-to-pmtu"]


def egress_rules(tailnet_ip: str, target_ip: str, wireguard_port: int = WIREGUARD_PORT) -> list[Rule]:
    """iptables arguments of containerboot's egress proxy to ``target_ip`` (``TS_TAILNET_TARGET_IP``):
    ``DNATNonTailscaleTraffic``, ``EnsureSNATForDst`` and ``ClampMSSToPMTU``, in that order, then one
    rule containerboot does not set, inserted ahead of its DNAT: UDP to tailscaled's own port is left
    alone. The DNAT sends every new flow that does not come in on ``tailscale0`` to the target; a peer
    elsewhere only ever answers the pod's own flows (conntrack takes those past the DNAT), but on the
    local node the site router is a host process that reaches the pod across the bridge from an address
    the pod never sent to, so its first WireGuard and disco packets would be sent to the target and the
    pod would never go direct."""
    return [["-t", "nat", "-I", "PREROUTING", "1", "!", "-i", TUN_NAME, "-j", "DNAT", "--to-destination", target_ip],
            ["-t", "nat", "-A", "POSTROUTING", "-d", f"{target_ip}/32", "-j", "SNAT", "--to-source", tailnet_ip],
            mss_clamp(),
            ["-t", "nat", "-I", "PREROUTING", "1", "-p", "udp", "--dport", str(wireguard_port), "-j", "RETURN"]]


def ingress_rules(tailnet_ip: str, destination_ip: str) -> list[Rule]:
    """iptables arguments of containerboot's ingress proxy to ``destination_ip`` (``TS_DEST_IP``, a
    ClusterIP): ``AddDNATRule`` and ``ClampMSSToPMTU``, then the masquerade of forwarded traffic that
    tailscaled's netfilter mode would add (here off), so that the backend answers the proxy."""
    return [["-t", "nat", "-I", "PREROUTING", "1", "-d", tailnet_ip, "-j", "DNAT", "--to-destination",
             destination_ip],
            mss_clamp(),
            ["-t", "nat", "-A", "POSTROUTING", "-d", f"{destination_ip}/32", "!", "-o", TUN_NAME, "-j", "MASQUERADE"]]


def forwarding() -> list[str]:
    """What turns IPv4 forwarding on in a namespace (containerboot's ``enableIPForwarding``)."""
    return ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]


def in_namespace(pid: int, argv: Sequence[str]) -> list[str]:
    """``argv`` run in the network namespace of process ``pid`` (with this machine's tools)."""
    return ["nsenter", "-t", str(pid), "-n", "--", *argv]


def install(pid: int, rules: Sequence[Rule]) -> list[str]:
    """Turn forwarding on and add ``rules`` in the network namespace of ``pid``; returns the rules
    as ``iptables-save`` then lists them there, for the record."""
    subprocess.run(in_namespace(pid, forwarding()), check=True, capture_output=True, text=True)
    for rule in rules:
        subprocess.run(in_namespace(pid, ["iptables", *rule]), check=True, capture_output=True, text=True)
    saved = subprocess.run(in_namespace(pid, ["iptables-save"]), check=True, capture_output=True, text=True).stdout
    return [line for line in saved.splitlines() if line.startswith("-A ")]


def pod_pid(pod_uid: str, command: str = "tailscaled") -> int:
    """The PID of the pod's process named ``command``, from the node's cgroups."""
    marker = pod_uid.replace("-", "_")
    for procs in Path("/sys/fs/cgroup").rglob("cgroup.procs"):
        if pod_uid not in str(procs) and marker not in str(procs):
            continue
        for pid in procs.read_text().split():
            try:
                if (Path("/proc") / pid / "comm").read_text().strip() == command:
                    return int(pid)
            except OSError:
                continue
    raise RuntimeError(f"no {command} process in pod {pod_uid}")


def kernel_objects(ns: str, name: str, ref: str, headscale: Headscale, authkey: str, resources: dict[str, Any],
                   gomemlimit: str | None, port: int) -> list[dict[str, Any]]:
    """A kernel-mode tailscaled proxy pod (Deployment) with its config, CA and a Service on ``port``.

    The container is root with ``NET_ADMIN`` only (every other capability dropped, no privilege
    escalation, a read-only root filesystem) and the TUN device from the host, as a Tailscale
    operator proxy's container; its namespace must admit the ``privileged`` Pod Security level.
    It gets ``resources`` and ``gomemlimit`` as the userspace pod does, so the rows compare under
    the same limits.
    """
    security = {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "runAsUser": 0, "runAsGroup": 0, "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]},
                "seccompProfile": {"type": "RuntimeDefault"}}
    return tailscaled_pod(
        ns, name, ref, headscale, authkey, resources, gomemlimit, port=(port, "proxied"), security=security,
        args=[f"--tun={TUN_NAME}", "--statedir=/state", f"--socket={SOCKET}", f"--port={WIREGUARD_PORT}"],
        config={"NetfilterMode": "off"},
        devices=[({"name": "tun", "mountPath": TUN}, {"name": "tun", "hostPath": {"path": TUN, "type": "CharDevice"}})])


def tailscaled_pod(ns: str, name: str, ref: str, headscale: Headscale, authkey: str, resources: dict[str, Any],
                   gomemlimit: str | None, *, port: tuple[int, str], security: dict[str, Any], args: list[str],
                   config: dict[str, Any] | None = None,
                   devices: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()) -> list[dict[str, Any]]:
    """A tailscaled pod built by hand, as each benchmark's row needs it: its config file (``config``
    added), the Headscale CA, a Deployment running ``args`` with ``security``, ``resources`` and
    ``gomemlimit``, and a Service on ``port`` (number, name). ``devices`` are (mount, volume) pairs."""
    labels = {"app": name}
    settings = {"Version": "alpha0", "ServerURL": headscale.url, "AuthKey": authkey, "Hostname": name,
                "AcceptDNS": False, "AcceptRoutes": True, **(config or {})}
    number, port_name = port
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
         "stringData": {"tailscaled.json": json.dumps(settings)}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-ca", "namespace": ns},
         "data": {"ca.crt": headscale.ca_bundle.read_text()}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"automountServiceAccountToken": False, "containers": [{
                 "name": "tailscaled", "image": ref, "imagePullPolicy": "IfNotPresent",
                 "args": [*args, "--no-logs-no-support", "--config=/config/tailscaled.json"],
                 "env": [{"name": "SSL_CERT_FILE", "value": "/ca/ca.crt"},
                         {"name": "TS_NO_LOGS_NO_SUPPORT", "value": "true"},
                         {"name": "TS_DEBUG_OMIT_LOCAL_ADDRS", "value": "true"},
                         *([{"name": "GOMEMLIMIT", "value": gomemlimit}] if gomemlimit else [])],
                 "ports": [{"containerPort": number, "name": port_name}],
                 "resources": resources,
                 "securityContext": security,
                 "volumeMounts": [{"name": "state", "mountPath": "/state"}, {"name": "tmp", "mountPath": "/tmp"},
                                  *(mount for mount, _ in devices),
                                  {"name": "config", "mountPath": "/config", "readOnly": True},
                                  {"name": "ca", "mountPath": "/ca", "readOnly": True}]}],
                 "volumes": [{"name": "state", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                             *(volume for _, volume in devices),
                             {"name": "config", "secret": {"secretName": name}},
                             {"name": "ca", "configMap": {"name": f"{name}-ca"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
         "spec": {"selector": labels, "ports": [{"port": number, "targetPort": number, "name": port_name}]}},
    ]
