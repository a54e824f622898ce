"""The kernel-mode proxy's rules (containerboot's, as the benchmark sets them) and its pod."""

from __future__ import annotations

from benchmarks import kernel_proxy
from tailnet_operator.resources.agent import DEFAULT_RESOURCES


def chains(rules: list[list[str]]) -> dict[tuple[str, str], list[list[str]]]:
    """The rules as they end up in each (table, chain), ``-I CHAIN 1`` and ``-A CHAIN`` applied in order."""
    out: dict[tuple[str, str], list[list[str]]] = {}
    for rule in rules:
        table, verb, chain = rule[1], rule[2], rule[3]
        body = rule[5:] if verb == "-I" else rule[4:]
        listed = out.setdefault((table, chain), [])
        if verb == "-I":
            listed.insert(int(rule[4]) - 1, body)
        else:
            listed.append(body)
    return out


def test_egress_sends_what_does_not_come_from_the_tunnel_to_the_target_as_the_proxy() -> None:
    got = chains(kernel_proxy.egress_rules("100.64.0.4", "198.18.7.2"))
    assert got[("nat", "PREROUTING")] == [
        ["-p", "udp", "--dport", "41641", "-j", "RETURN"],
        ["!", "-i", "tailscale0", "-j", "DNAT", "--to-destination", "198.18.7.2"]], \
        "tailscaled's own port is left alone, ahead of containerboot's DNAT"
    assert got[("nat", "POSTROUTING")] == [["-d", "198.18.7.2/32", "-j", "SNAT", "--to-source", "100.64.0.4"]]
    assert got[("mangle", "FORWARD")] == [["-o", "tailscale0", "-p", "tcp", "--tcp-flags", "SYN,RST", "SYN",
                                           "-j", "TCPMSS", "--clamp-mss-to-pmtu"]]


def test_ingress_sends_the_tailnet_address_to_the_cluster_ip_and_masquerades_it() -> None:
    got = chains(kernel_proxy.ingress_rules("100.64.0.9", "198.19.128.20"))
    assert got[("nat", "PREROUTING")] == [["-d", "100.64.0.9", "-j", "DNAT", "--to-destination", "198.19.128.20"]]
    assert got[("nat", "POSTROUTING")] == [["-d", "198.19.128.20/32", "!", "-o", "tailscale0", "-j", "MASQUERADE"]]
    assert ("mangle", "FORWARD") in got


def test_rules_run_in_the_pods_network_namespace() -> None:
    assert kernel_proxy.in_namespace(42, ["iptables", "-L"]) == ["nsenter", "-t", "42", "-n", "--", "iptables", "-L"]
    assert kernel_proxy.forwarding()[-1] == "net.ipv4.ip_forward=1"


def test_the_pod_is_kernel_mode_root_with_net_admin_only_and_the_given_limits() -> None:
    class Headscale:
        url = "https://headscale.example.internal"

        class ca_bundle:
            @staticmethod
            def read_text() -> str:
                return "CA"

    objects = kernel_proxy.kernel_objects("ns", "proxy", "ref", Headscale(), "key",  # type: ignore[arg-type]
                                          DEFAULT_RESOURCES, "235929KiB", 9000)
    by_kind = {o["kind"]: o for o in objects}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--tun=tailscale0" in container["args"] and "--port=41641" in container["args"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert container["securityContext"]["runAsUser"] == 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"name": "tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}} in pod["volumes"]
    assert container["resources"] == DEFAULT_RESOURCES
    assert {"name": "GOMEMLIMIT", "value": "235929KiB"} in container["env"]
    assert '"NetfilterMode": "off"' in by_kind["Secret"]["stringData"]["tailscaled.json"]
    assert by_kind["Service"]["spec"]["ports"] == [{"port": 9000, "targetPort": 9000, "name": "proxied"}]
