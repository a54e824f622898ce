"""The pure builders of a TailnetGateway's objects: routes, the router StatefulSet and its
identity (no privileged container, NET_ADMIN alone, the operator's image, a ServiceAccount and a
Role per router), the zone."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hack import versions
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.resources import gateway as build

IMAGE = "registry.example/tailscale:v1.98.10"
ROUTER = build.Router(namespace="tailnet-gateway", tailnet="tn", control_url="https://hs.example:443",
                      image=IMAGE, routes=("10.96.0.53/32", "192.168.10.0/24"))


def gateway(**spec: Any) -> TailnetGateway:
    body = {"tailnetRef": {"name": "tn"}, "tag": "tag:gateway",
            "dns": {"zone": "corp.example", "image": "coredns/coredns:1.12.1"}, **spec}
    return TailnetGateway.model_validate({"metadata": {"name": "edge"}, "spec": body})


def container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_routes_are_sorted_deduplicated_and_names_are_skipped() -> None:
    gw = gateway(siteRoutes=["192.168.10.0/24", "10.1.0.0/16"], advertiseLoadBalancerRange="10.250.0.0/24")
    routes = build.advertised_routes(gw, ["198.18.1.10", "db.corp.example", "198.18.1.10", "fd00::5"], "10.96.0.53")
    assert routes == ("10.1.0.0/16", "10.96.0.53/32", "10.250.0.0/24", "192.168.10.0/24", "198.18.1.10/32",
                      "fd00::5/128")
    assert build.advertised_routes(gateway(), [], None) == ()
    assert build.host_route("not-an-ip") == ""


def test_the_router_is_one_kernel_mode_pod_with_its_state_in_the_secret_and_on_delete_updates() -> None:
    sts = build.stateful_set(gateway(), ROUTER)
    spec = sts["spec"]
    assert spec["replicas"] == 1 and spec["updateStrategy"] == {"type": "OnDelete"}
    assert spec["serviceName"] == "edge-gateway" and "ownerReferences" not in sts["metadata"]
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "edge-gateway" and pod["automountServiceAccountToken"] is True
    main = container(sts)
    assert main["image"] == IMAGE
    assert {"name": "tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}} in pod["volumes"]
    env = {e["name"]: e for e in main["env"]}
    assert env["TS_KUBE_SECRET"]["value"] == "edge-gateway-state"
    assert env["TS_ROUTES"]["value"] == "10.96.0.53/32,192.168.10.0/24"
    assert env["TS_LOGIN_SERVER"]["value"] == "https://hs.example:443"
    script = main["command"][2]
    assert 'tailscaled --state="kube:${TS_KUBE_SECRET}"' in script and "--tun=userspace" not in script
    assert '--advertise-routes="$TS_ROUTES"' in script and '${TS_AUTHKEY:+--authkey="$TS_AUTHKEY"}' in script
    assert env["TS_AUTHKEY"]["valueFrom"]["secretKeyRef"] == {"name": "edge-gateway-auth-key", "key": "authKey",
                                                              "optional": True}
    assert "SSL_CERT_FILE" not in env


def test_the_router_runs_no_privileged_container_and_keeps_net_admin_alone() -> None:
    pod = build.stateful_set(gateway(), ROUTER)["spec"]["template"]["spec"]
    assert "initContainers" not in pod, "IP forwarding needs no privileged init container"
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsUser"] == 0, "root, for NET_ADMIN to be effective; nothing else comes with it"
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/net/tun"}
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    hostpaths = [v for v in pod["volumes"] if "hostPath" in v]
    assert hostpaths == [{"name": "tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}}]
    assert not [k for k in pod if k.startswith("host")], "no host network, PID or IPC"


def test_the_router_runs_the_operators_image_never_the_one_the_gateway_names() -> None:
    sts = build.stateful_set(gateway(image="attacker.example/root-shell:latest"), ROUTER)
    assert [c["image"] for c in sts["spec"]["template"]["spec"]["containers"]] == [IMAGE]
    default = build.Router(namespace="tailnet-gateway", tailnet="tn", control_url="https://hs.example:443")
    assert container(build.stateful_set(gateway(), default))["image"] == build.DEFAULT_ROUTER_IMAGE
    assert build.DEFAULT_ROUTER_IMAGE.endswith(f":v{versions.TAILSCALE}"), "the tailscale version the tests run"


def test_forwarding_is_set_with_the_pods_sysctls_only_when_the_operator_is_told_the_kubelets_allow_them() -> None:
    plain = build.stateful_set(gateway(), ROUTER)["spec"]["template"]["spec"]
    assert "sysctls" not in plain["securityContext"]
    told = build.stateful_set(gateway(), build.Router(**{**ROUTER.__dict__, "forwarding_sysctls": True}))
    assert told["spec"]["template"]["spec"]["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_forward", "value": "1"}, {"name": "net.ipv6.conf.all.forwarding", "value": "1"}]


def _run_script(tmp_path: Path, ipv4: str, ipv6: str, routes: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The router's script with /proc/sys and /tmp under ``tmp_path`` and a tailscaled that only
    records that it was started (and exits, which ends the script)."""
    sysctl = tmp_path / "sys"
    (sysctl / "net/ipv4").mkdir(parents=True)
    (sysctl / "net/ipv6/conf/all").mkdir(parents=True)
    (sysctl / "net/ipv4/ip_forward").write_text(ipv4 + "\n")
    (sysctl / "net/ipv6/conf/all/forwarding").write_text(ipv6 + "\n")
    bin_dir, started = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    for program in ("tailscaled", "tailscale"):
        stub = bin_dir / program
        stub.write_text(f"#!/bin/sh\necho {program} >> {started}\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    script = build.ROUTER_SCRIPT.replace("/tmp", str(tmp_path)).replace("/proc/sys", str(sysctl))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TS_ROUTES": routes, "TS_KUBE_SECRET": "s",
           "TS_LOGIN_SERVER": "https://hs.example", "TS_HOSTNAME": "edge-gateway"}
    result = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30,
                            check=False)
    return result, started


def test_the_router_stops_at_once_saying_why_when_ipv4_forwarding_is_off(tmp_path: Path) -> None:
    result, started = _run_script(tmp_path, ipv4="0", ipv6="0", routes="192.168.10.0/24")
    assert result.returncode == 1 and not started.exists(), "no node registers that could route nothing"
    assert "IPv4 forwarding is off" in result.stderr and "gateway.router.forwardingSysctls" in result.stderr


@pytest.mark.parametrize(("ipv6", "warned"), [("0", True), ("1", False)])
def test_the_router_starts_with_ipv4_forwarding_and_warns_of_ipv6_routes_it_cannot_serve(
        tmp_path: Path, ipv6: str, warned: bool) -> None:
    result, started = _run_script(tmp_path, ipv4="1", ipv6=ipv6, routes="192.168.10.0/24,fd00::/64")
    assert started.read_text().splitlines()[0] == "tailscaled", result.stderr
    assert ("IPv6 forwarding is off" in result.stderr) == warned


def test_each_router_has_its_own_service_account_and_a_role_for_its_own_state_secret() -> None:
    gw = gateway()
    account = build.router_service_account(gw, "tailnet-gateway")
    role = build.router_role(gw, "tailnet-gateway")
    binding = build.router_role_binding(gw, "tailnet-gateway")
    assert account["metadata"]["name"] == role["metadata"]["name"] == binding["metadata"]["name"] == "edge-gateway"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["edge-gateway-state"],
                              "verbs": ["get", "update", "patch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "edge-gateway"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "edge-gateway", "namespace": "tailnet-gateway"}]
    pod = build.stateful_set(gw, ROUTER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    lab = TailnetGateway.model_validate({"metadata": {"name": "lab"},
                                         "spec": {"tailnetRef": {"name": "tn"}, "tag": "tag:gateway"}})
    assert build.router_role(lab, "tailnet-gateway")["rules"][0]["resourceNames"] == ["lab-gateway-state"], \
        "another router's Role reaches another Secret"


def test_the_template_hash_follows_the_operators_image_and_the_routes_only() -> None:
    base = build.stateful_set(gateway(), ROUTER)
    same = build.stateful_set(gateway(image="tailscale/tailscale:v1.98.11"), ROUTER)
    image = build.stateful_set(gateway(), build.Router(**{**ROUTER.__dict__, "image": "registry.example/ts:2"}))
    routes = build.stateful_set(gateway(), build.Router(**{**ROUTER.__dict__, "routes": ("10.96.0.53/32",)}))
    digest = [s["spec"]["template"]["metadata"]["annotations"][build.TEMPLATE_HASH_ANNOTATION]
              for s in (base, same, image, routes)]
    assert digest[0] == digest[1] and len({digest[0], digest[2], digest[3]}) == 3
    assert build.template_hash(base["spec"]["template"]) == digest[0]


def test_a_ca_bundle_is_mounted_from_the_config_map_and_trusted() -> None:
    router = build.Router(**{**ROUTER.__dict__, "ca_bundle": "-----BEGIN CERTIFICATE-----\n"})
    sts = build.stateful_set(gateway(), router)
    env = {e["name"]: e.get("value") for e in container(sts)["env"]}
    assert env["SSL_CERT_FILE"] == "/etc/tailnet-gateway/ca/ca.crt"
    cm = build.config_map(gateway(), router, {})
    assert cm["data"]["ca.crt"].startswith("-----BEGIN")


def test_the_corefile_serves_the_zone_authoritatively_from_its_zone_file() -> None:
    text = build.corefile("Corp.Example.")
    assert text.startswith("corp.example:1053 {")
    assert "file /etc/coredns/zone.db corp.example {" in text
    assert "hosts" not in text and "template" not in text and "forward" not in text


def test_the_zone_file_has_the_soa_and_one_record_per_name_and_a_serial_that_follows_the_records() -> None:
    text = build.zone_file("corp.example", {"db.corp.example": "10.0.0.1", "V6.Corp.Example.": "fd00::1"})
    lines = text.splitlines()
    assert lines[0] == "$ORIGIN corp.example."
    assert lines[1].startswith("@ 30 IN SOA ns.corp.example. hostmaster.corp.example. ")
    assert lines[2:] == ["db.corp.example. 30 IN A 10.0.0.1", "v6.corp.example. 30 IN AAAA fd00::1"]
    serial = lines[1].split()[6]
    assert build.zone_file("corp.example", {"v6.corp.example": "fd00::1", "db.corp.example": "10.0.0.1"}) == text
    changed = build.zone_file("corp.example", {"db.corp.example": "10.0.0.2"}).splitlines()[1].split()[6]
    assert changed != serial and 1 <= int(serial) <= 0xFFFFFFFF


def test_the_config_map_holds_the_zone_and_is_empty_without_dns() -> None:
    cm = build.config_map(gateway(), ROUTER, {"a.corp.example": "10.0.0.1"})
    assert "a.corp.example. 30 IN A 10.0.0.1" in cm["data"]["zone.db"] and "Corefile" in cm["data"]
    assert build.config_map(gateway(dns=None), ROUTER, {"x": "10.0.0.1"})["data"] == {}


def test_coredns_meets_the_restricted_level_and_listens_unprivileged() -> None:
    dep = build.dns_deployment(gateway(), ROUTER)
    pod = dep["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] and sc["capabilities"] == {"drop": ["ALL"]} and not sc["allowPrivilegeEscalation"]
    assert pod["automountServiceAccountToken"] is False
    assert {p["containerPort"] for p in pod["containers"][0]["ports"]} == {build.DNS_PORT}
    svc = build.dns_service(gateway(), ROUTER)
    assert [(p["port"], p["protocol"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        (53, "UDP", build.DNS_PORT), (53, "TCP", build.DNS_PORT)]


def test_every_object_carries_the_gateway_labels() -> None:
    gw = gateway()
    objects = [build.stateful_set(gw, ROUTER), build.router_service(gw, ROUTER), build.dns_service(gw, ROUTER),
               build.dns_deployment(gw, ROUTER), build.config_map(gw, ROUTER, {}),
               build.state_secret(gw, "tailnet-gateway", "uid-1"),
               build.router_service_account(gw, "tailnet-gateway"), build.router_role(gw, "tailnet-gateway"),
               build.router_role_binding(gw, "tailnet-gateway")]
    pods = [o["spec"]["template"] for o in objects[:4:3]]
    for obj in objects + pods:
        labels = obj["metadata"]["labels"]
        assert labels["tailnet.dev/gateway"] == "edge" and labels["app.kubernetes.io/managed-by"] == "tailnet-operator"
        assert obj in pods or obj["metadata"]["namespace"] == "tailnet-gateway"
