"""The pure builders of an ingress's objects: the agent pod passes Pod Security `restricted`, the
exposes file is what the agent parses, TLS Secrets and CAs are projected, the pod template does not
depend on the exposes' ports or backends, cert-manager Certificates name the host and its aliases,
and DNS names follow the template and the zones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from pydantic import ValidationError

from tailnet_agent.contract.endpoints import HEALTH_PORT
from tailnet_agent.contract.exposes import HeaderEdits, Match, PathChange, Redirect, Rewrite, parse_exposes
from tailnet_operator.api.ingress import HostPath, TailnetIngress
from tailnet_operator.resources import agent as pod
from tailnet_operator.resources import egress as egress_build
from tailnet_operator.resources import ingress as build

OWNER = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
         "metadata": {"name": "shop", "namespace": "tenant", "uid": "u-1"}}
AGENT = build.AgentSpec(image="img:1", control_url="https://hs.test", auth_secret="shop-ingress-auth-key",
                        ca_bundle="-----BEGIN CERTIFICATE-----\n", operator_labels={"app": "op"})
ZONES = ["apps.example.internal", "corp.example.internal"]

DB = {"name": "db", "port": 5432, "backend": {"service": "postgres", "port": 5432}}
WEB = {"name": "web", "mode": "http", "port": 443,
       "backend": {"service": "web", "port": 8443, "scheme": "https", "caSecretRef": {"name": "web-ca", "key": "ca"}},
       "hosts": [{"name": "shop.apps.example.internal", "alias": "shop", "tls": {"secretName": "shop-tls"}},
                 {"name": "admin.apps.example.internal",
                  "tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}}]}


def ingress(exposes: list[dict[str, Any]], **spec: Any) -> TailnetIngress:
    return TailnetIngress.model_validate({**OWNER, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop", "hostname": "shop-gw",
        "exposes": exposes, **spec}})


def test_the_agent_pod_passes_the_restricted_pod_security_standard() -> None:
    spec = build.deployment(OWNER, ingress([DB, WEB]), AGENT)["spec"]["template"]["spec"]
    [container] = spec["containers"]
    sc, pod_sc = container["securityContext"], spec["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True and pod_sc["runAsNonRoot"]
    assert sc["seccompProfile"]["type"] == pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert {k for v in spec["volumes"] for k in v if k != "name"} <= {"configMap", "secret", "emptyDir", "projected"}
    assert spec["automountServiceAccountToken"] is False and len(spec["containers"]) == 1


def test_the_agent_container_runs_in_ingress_mode_with_its_files_probes_and_metrics() -> None:
    container = build.deployment(OWNER, ingress([DB]), AGENT)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["AGENT_MODE"] == "ingress" and env["TAILNET_HOSTNAME"] == "shop-gw"
    assert env["TAILNET_EXPOSES_FILE"] == f"{pod.CONFIG_DIR}/exposes.json"
    assert env["TAILNET_CA_BUNDLE"].startswith(pod.CONFIG_DIR) and env["TAILNET_AUTH_KEY_FILE"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": HEALTH_PORT}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": HEALTH_PORT}
    assert container["ports"] == [{"name": "metrics", "containerPort": HEALTH_PORT, "protocol": "TCP"}]
    assert all("subPath" not in m for m in container["volumeMounts"]), "subPath mounts never update"
    assert not any(v["name"] == "certs" for v in build.deployment(OWNER, ingress([DB]), AGENT)["spec"]["template"][
        "spec"]["volumes"]), "a tcp-only ingress mounts no certificates"


def test_every_tls_secret_and_backend_ca_is_projected_optionally_where_the_exposes_file_points() -> None:
    obj = ingress([DB, WEB])
    spec = build.deployment(OWNER, obj, AGENT)["spec"]["template"]["spec"]
    [certs] = [v for v in spec["volumes"] if v["name"] == "certs"]
    sources = {s["secret"]["name"]: s["secret"] for s in certs["projected"]["sources"]}
    assert set(sources) == {"shop-tls", "shop-admin.apps.example.internal-tls", "web-ca"}
    assert all(s["optional"] for s in sources.values()), "an unissued certificate must not block the pod"
    paths = {i["path"] for s in sources.values() for i in s["items"]}
    doc = json.loads(build.exposes_document(obj, ZONES))
    web = next(e for e in doc if e["name"] == "web")
    files = [h["tls"][k] for h in web["hosts"] for k in ("certFile", "keyFile")] + [web["backend"]["caFile"]]
    assert {f.removeprefix(build.CERTS_DIR + "/") for f in files} == paths
    assert sources["web-ca"]["items"] == [{"key": "ca", "path": "ca/web/ca.crt"}]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "certs")
    assert mount == {"name": "certs", "mountPath": build.CERTS_DIR, "readOnly": True}


def test_the_exposes_file_is_what_the_agent_parses() -> None:
    [db, web] = parse_exposes(build.exposes_document(ingress([DB, WEB]), ZONES))
    assert (db.mode, db.port, db.backend.host, db.backend.port) == ("tcp", 5432, "postgres.tenant.svc", 5432)
    assert (web.mode, web.port, web.backend.scheme) == ("http", 443, "https")
    assert web.backend.host == "web.tenant.svc" and web.backend.ca_file == f"{build.CERTS_DIR}/ca/web/ca.crt"
    shop = web.hosts[0]
    assert set(shop.names) == {"shop.apps.example.internal", "shop", "shop.corp.example.internal"}
    assert shop.cert_file == f"{build.CERTS_DIR}/tls/shop-tls/tls.crt"
    assert build.exposes_document(ingress([DB, WEB]), ZONES) == build.exposes_document(ingress([DB, WEB]), ZONES)


def test_a_hosts_paths_become_routes_to_their_services_spoken_to_as_the_exposes_backend() -> None:
    paths = [{"path": "/api", "backend": {"service": "api", "port": 8080}},
             {"path": "/api/v2", "pathType": "Exact", "backend": {"service": "v2", "port": 80}}]
    shop_host, admin_host = cast(list[dict[str, Any]], WEB["hosts"])
    routed = {**WEB, "hosts": [{**shop_host, "paths": paths, "unmatchedPaths": "NotFound"}, admin_host]}
    [web] = parse_exposes(build.exposes_document(ingress([routed]), ZONES))
    shop, admin = web.hosts
    backends = [r.backend for r in shop.routes if r.backend is not None]
    assert [(r.path, r.type) for r in shop.routes] == [("/api", "Prefix"), ("/api/v2", "Exact")]
    assert [(b.host, b.port) for b in backends] == [("api.tenant.svc", 8080), ("v2.tenant.svc", 80)]
    assert {(b.scheme, b.ca_file) for b in backends} == {("https", web.backend.ca_file)}
    assert not shop.fallback
    assert admin.routes == () and admin.fallback  # a host without paths is as before


def test_a_paths_matches_weights_redirect_rewrite_and_header_edits_reach_the_agent() -> None:
    paths = [
        {"path": "/app", "method": "POST", "headers": [{"name": "X-Env", "value": "canary"}],
         "queryParams": [{"name": "v", "value": "2"}],
         "backends": [{"service": "blue", "port": 80, "weight": 9}, {"service": "green", "port": 80}],
         "rewrite": {"hostname": "inside.svc", "path": {"type": "ReplacePrefixMatch", "value": "/"}},
         "requestHeaders": {"set": [{"name": "X-A", "value": "1"}], "remove": ["X-B"]},
         "responseHeaders": {"add": [{"name": "X-C", "value": "2"}]}},
        {"path": "/old", "pathType": "Exact",
         "redirect": {"scheme": "http", "port": 8080, "path": {"type": "ReplaceFullPath", "value": "/new"},
                      "statusCode": 301}},
    ]
    shop_host, _ = cast(list[dict[str, Any]], WEB["hosts"])
    [web] = parse_exposes(build.exposes_document(ingress([{**WEB, "hosts": [{**shop_host, "paths": paths}]}]), ZONES))
    app, old = web.hosts[0].routes
    assert (app.method, app.headers, app.query) == ("POST", (Match(name="X-Env", value="canary"),),
                                                    (Match(name="v", value="2"),))
    assert [(w.backend.host, w.weight, w.backend.scheme) for w in app.backends] == [
        ("blue.tenant.svc", 9, "https"), ("green.tenant.svc", 1, "https")]
    assert app.rewrite == Rewrite(hostname="inside.svc", path=PathChange(type="ReplacePrefixMatch", value="/"))
    assert app.request_headers == HeaderEdits(set=(Match(name="X-A", value="1"),), remove=("X-B",))
    assert app.response_headers == HeaderEdits(add=(Match(name="X-C", value="2"),))
    assert old.backend is None and old.redirect == Redirect(
        scheme="http", port=8080, path=PathChange(type="ReplaceFullPath", value="/new"), status=301)


def test_a_plaintext_expose_reaches_the_agent_without_certificates() -> None:
    plain = {"name": "plain", "mode": "http", "plaintext": True, "port": 80,
             "backend": {"service": "web", "port": 8080}, "hosts": [{"name": "plain.apps.example.internal"}]}
    obj = ingress([plain, WEB])
    [web, tls] = parse_exposes(build.exposes_document(obj, ZONES))
    assert web.plaintext and web.hosts[0].cert_file == "" and not tls.plaintext
    assert build.tls_secret_names(obj) == build.tls_secret_names(ingress([WEB]))


def test_wildcard_hosts_answer_names_no_exact_host_answers_and_have_no_name_in_dns() -> None:
    """A Gateway API listener without a hostname or with a wildcard one, and routes without one."""
    plain = {"name": "plain", "mode": "http", "plaintext": True, "port": 80,
             "backend": {"service": "web", "port": 8080},
             "hosts": [{"name": "plain.apps.example.internal"}, {"name": "*.apps.example.internal"}, {"name": "*"}]}
    tls = {**WEB, "hosts": [{"name": "*", "tls": {"secretName": "any-tls"}},
                            {"name": "*.web.example.internal", "tls": {"secretName": "web-tls"}}]}
    obj = ingress([plain, tls])
    web, secure = parse_exposes(build.exposes_document(obj, ZONES))
    assert [h.name for h in web.hosts] == ["plain.apps.example.internal", "*.apps.example.internal", "*"]
    assert [h.name for h in secure.hosts] == ["*", "*.web.example.internal"]
    assert build.dns_names(obj, ZONES) == ["plain.apps.example.internal"]
    for host in ({"name": "*", "alias": "web"}, {"name": "*.apps.example.internal", "alias": "web"}):
        with pytest.raises(ValidationError, match="takes no alias"):
            ingress([{**plain, "hosts": [host]}])
    with pytest.raises(ValidationError):
        ingress([{**plain, "hosts": [{"name": "*apps.example.internal"}]}])


def test_the_http_exposes_of_a_port_are_all_plaintext_or_all_tls() -> None:
    plain = {"name": "plain", "mode": "http", "plaintext": True, "port": 443,
             "backend": {"service": "web", "port": 8080}, "hosts": [{"name": "plain.apps.example.internal"}]}
    with pytest.raises(ValidationError, match="all plaintext or all TLS"):
        ingress([plain, WEB])


PG = {"name": "pg", "mode": "tls", "port": 443, "backend": {"service": "postgres", "port": 5432},
      "hosts": [{"name": "pg.apps.example.internal", "alias": "pg"}, {"name": "*.pg.apps.example.internal"}]}


def test_a_tls_expose_reaches_the_agent_as_names_only_and_its_names_reach_dns() -> None:
    mq = {**PG, "name": "mq", "backend": {"service": "rabbit", "port": 5671}, "hosts": [{"name": "*"}]}
    obj = ingress([PG, mq, {**WEB, "port": 8443}])
    pg, anything, web = parse_exposes(build.exposes_document(obj, ZONES))
    assert (pg.mode, pg.port, pg.backend.host, pg.backend.port) == ("tls", 443, "postgres.tenant.svc", 5432)
    assert [h.names for h in pg.hosts] == [("pg.apps.example.internal", "pg", "pg.corp.example.internal"),
                                           ("*.pg.apps.example.internal",)]
    assert all(not h.cert_file for h in (*pg.hosts, *anything.hosts)) and web.mode == "http"
    entry = json.loads(build.exposes_document(ingress([PG]), ZONES))[0]
    assert entry["backend"] == {"host": "postgres.tenant.svc", "port": 5432} and "plaintext" not in entry
    assert build.dns_names(obj, ZONES) == ["pg.apps.example.internal", "pg.corp.example.internal",
                                           "shop.apps.example.internal", "shop.corp.example.internal",
                                           "admin.apps.example.internal"], "a tls host's names as an http host's"
    assert build.tls_secret_names(obj) == build.tls_secret_names(ingress([WEB])), "a tls host has no certificate"


def test_an_exposes_backend_of_another_namespace_is_the_gateway_translations_alone() -> None:
    """A TLSRoute's or TCPRoute's Service in another namespace (a ReferenceGrant permits it) is
    dialled there; the field is not in the CRD, so a tenant's object never carries it."""
    routed = {**PG, "backend": {"service": "vault", "port": 8443, "namespace": "secrets"}}
    [pg] = parse_exposes(build.exposes_document(ingress([routed]), ZONES))
    assert (pg.backend.host, pg.backend.port) == ("vault.secrets.svc", 8443)
    crd = yaml.safe_load((Path(__file__).parents[2] / "manifests/crd/tailnetingresses.tailnet.dev.yaml").read_text())
    expose = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["exposes"]
    assert "namespace" not in expose["items"]["properties"]["backend"]["properties"]


@pytest.mark.parametrize(("change", "error"), [
    ({"hosts": []}, "hosts is required for modes http and tls"),
    ({"hosts": [{"name": "pg.apps.example.internal", "tls": {"secretName": "pg-tls"}}]},
     "a tls expose's hosts are names only"),
    ({"hosts": [{"name": "pg.apps.example.internal",
                 "paths": [{"path": "/", "backend": {"service": "a", "port": 1}}]}]},
     "a tls expose's hosts are names only"),
    ({"hosts": [{"name": "pg.apps.example.internal", "unmatchedPaths": "NotFound"}]},
     "a tls expose's hosts are names only"),
    ({"plaintext": True}, "plaintext goes with mode http"),
    ({"backend": {"service": "postgres", "port": 5432, "scheme": "https"}}, "need mode http"),
    ({"backend": {"service": "postgres", "port": 5432, "protocol": "h2"}}, "need mode http"),
])
def test_a_bad_tls_expose_is_refused_with_what_to_change(change: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ingress([{**PG, **change}])


def test_tls_exposes_share_a_port_with_their_kind_only_and_may_repeat_a_name_on_another_port() -> None:
    other = {**PG, "name": "other", "hosts": [{"name": "other.apps.example.internal"}]}
    assert len(ingress([PG, other]).spec.exposes) == 2
    for clash in ({**WEB, "port": 443}, {**DB, "port": 443}):
        with pytest.raises(ValidationError, match="shared only by exposes of one mode, http or tls"):
            ingress([PG, clash])
    with pytest.raises(ValidationError, match="only one expose of a port"):
        ingress([PG, {**other, "hosts": [{"name": "pg.apps.example.internal"}]}])
    again = {**PG, "name": "again", "port": 5432}
    web = {**WEB, "hosts": [{"name": "pg.apps.example.internal", "tls": {"secretName": "pg-tls"}}], "port": 8443}
    assert len(ingress([PG, again, web]).spec.exposes) == 3, "no certificate: a name repeats across ports"


@pytest.mark.parametrize(("path", "error"), [
    ({"path": "/", "backend": {"service": "a", "port": 1}, "redirect": {}},
     "set exactly one of backend, backends and redirect"),
    ({"path": "/", "redirect": {}, "rewrite": {"hostname": "b"}}, "a redirect goes to no backend"),
    ({"path": "/a", "pathType": "Exact", "backend": {"service": "a", "port": 1},
      "rewrite": {"path": {"type": "ReplacePrefixMatch", "value": "/"}}},
     "ReplacePrefixMatch goes with pathType Prefix"),
    ({"path": "/", "backend": {"service": "a", "port": 1},
      "headers": [{"name": "X-A", "value": "1"}, {"name": "x-a", "value": "2"}]}, "headers names x-a twice"),
    ({"path": "/", "backend": {"service": "a", "port": 1}, "responseHeaders": {"remove": ["Tailscale-User-Login"]}},
     "Tailscale-User-Login is the agent's to write"),
])
def test_a_bad_path_is_refused_with_what_to_change(path: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        HostPath.model_validate(path)


def test_the_pod_template_does_not_depend_on_ports_or_backends() -> None:
    one = build.deployment(OWNER, ingress([DB, WEB]), AGENT)
    moved = {**DB, "port": 6543, "backend": {"service": "other", "port": 1}}
    two = build.deployment(OWNER, ingress([moved, WEB]), AGENT)
    assert one["spec"]["template"] == two["spec"]["template"]


def test_a_new_tag_changes_the_pod_template_so_the_agent_registers_again() -> None:
    before = build.deployment(OWNER, ingress([DB]), AGENT)["spec"]["template"]["metadata"]
    after = build.deployment(OWNER, ingress([DB], tag="tag:ingress-shop2"), AGENT)["spec"]["template"]["metadata"]
    assert before["annotations"] == {"tailnet.dev/tag": "tag:ingress-shop"}
    assert after["annotations"] == {"tailnet.dev/tag": "tag:ingress-shop2"}


def test_a_cert_manager_host_gets_a_certificate_for_its_name_and_aliases_from_its_issuer() -> None:
    obj = ingress([{**WEB, "hosts": [{"name": "shop.apps.example.internal", "alias": "shop",
                                     "tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}}]}])
    host = obj.spec.exposes[0].hosts[0]  # type: ignore[index]
    cert = build.certificate(OWNER, obj, host, ZONES)
    assert cert["apiVersion"] == "cert-manager.io/v1" and cert["kind"] == "Certificate"
    assert cert["metadata"]["name"] == "shop-shop.apps.example.internal"
    assert cert["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert cert["spec"]["dnsNames"] == ["shop.apps.example.internal", "shop.corp.example.internal"]
    assert cert["spec"]["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert cert["spec"]["secretName"] == build.host_secret_name(obj, host) == "shop-shop.apps.example.internal-tls"


def test_long_names_are_cut_to_a_valid_length_and_stay_distinct() -> None:
    long = "a" * 60 + "." + "b" * 60 + "." + "c" * 60 + "." + "d" * 60
    tls = {"certManager": {"issuerRef": {"name": "ca"}}}
    one = ingress([{**WEB, "hosts": [{"name": long, "tls": tls}]}])
    two = ingress([{**WEB, "hosts": [{"name": long[:-1] + "e", "tls": tls}]}])
    names = [build.host_secret_name(i, i.spec.exposes[0].hosts[0]) for i in (one, two)]  # type: ignore[index]
    assert all(len(n) <= 253 and n.endswith("-tls") for n in names) and names[0] != names[1]


def test_dns_names_are_the_template_name_then_each_host_and_its_aliases() -> None:
    obj = ingress([DB, WEB], dnsTemplate="{hostname}.{namespace}.apps.example.internal")
    assert build.dns_names(obj, ZONES) == ["shop-gw.tenant.apps.example.internal", "shop.apps.example.internal",
                                           "shop.corp.example.internal", "admin.apps.example.internal"]
    assert build.dns_names(ingress([DB]), ZONES) == [], "no template, no hosts: no names"


def test_the_network_policy_admits_only_the_operator_from_its_namespace_and_leaves_egress_open() -> None:
    policy = build.network_policy(OWNER, ingress([DB, WEB]), AGENT, "tailnet-system")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"], "the agent must reach backends, Headscale and DERP"
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": HEALTH_PORT}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "op"}},
                             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tailnet-system"}}}]
    bare = build.network_policy(OWNER, ingress([DB]), build.AgentSpec("img", "https://hs", "s"), "tailnet-system")
    assert bare["spec"]["ingress"] == [], "without the operator's labels nothing is admitted"


def test_the_network_policy_admits_the_metrics_namespaces_to_the_health_port_only() -> None:
    agent = build.AgentSpec("img", "https://hs", "s", operator_labels={"app": "op"},
                            metrics_namespaces={"kubernetes.io/metadata.name": "monitoring"})
    _, metrics = build.network_policy(OWNER, ingress([DB]), agent, "tailnet-system")["spec"]["ingress"]
    assert metrics == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                       "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]}


def test_egress_and_ingress_agents_share_one_pod_shape() -> None:
    from tailnet_operator.api.egress import TailnetEgress

    egress = TailnetEgress.model_validate({**OWNER, "kind": "TailnetEgress", "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:e", "consumerNamespaces": ["a"],
        "targets": [{"name": "t", "address": "198.18.1.1", "ports": [{"port": 1}]}]}})
    e = egress_build.deployment(OWNER, egress, AGENT)["spec"]["template"]["spec"]
    i = build.deployment(OWNER, ingress([DB]), AGENT)["spec"]["template"]["spec"]
    for key in ("securityContext", "automountServiceAccountToken", "enableServiceLinks",
                "terminationGracePeriodSeconds"):
        assert e[key] == i[key]
    for key in ("securityContext", "livenessProbe", "readinessProbe", "lifecycle", "ports", "resources", "command"):
        assert e["containers"][0][key] == i["containers"][0][key]


def test_an_ingress_rollout_surges_and_the_old_agent_drains_before_it_stops() -> None:
    """Issue 24: one replica, never a second one, but a rollout starts the new pod first; the old
    one sleeps in preStop while its endpoint goes, then drains within the grace period."""
    deployment = build.deployment(OWNER, ingress([DB]), AGENT)
    spec, template = deployment["spec"], deployment["spec"]["template"]["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert template["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": pod.PRE_STOP_SECONDS}}
    assert template["terminationGracePeriodSeconds"] == pod.TERMINATION_GRACE_SECONDS
    assert pod.TERMINATION_GRACE_SECONDS > pod.PRE_STOP_SECONDS + pod.DRAIN_SECONDS


def test_replicas_that_share_an_address_get_it_a_budget_and_a_spread() -> None:
    one = ingress([DB])
    assert build.deployment(OWNER, one, AGENT)["spec"]["replicas"] == 1
    assert build.disruption_budget(OWNER, one) is None
    env = build.deployment(OWNER, one, AGENT)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "TAILNET_SHARED_ADDRESS" not in {e["name"] for e in env}

    shared = ingress([DB], replicas=3, sharedAddress="198.18.5.10")
    deployment = build.deployment(OWNER, shared, AGENT)
    pod_spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert {"name": "TAILNET_SHARED_ADDRESS", "value": "198.18.5.10"} in pod_spec["containers"][0]["env"]
    assert pod_spec["topologySpreadConstraints"] == [pod.topology_spread(build.agent_labels(shared))]
    budget = build.disruption_budget(OWNER, shared)
    assert budget is not None and budget["spec"]["maxUnavailable"] == 1
    assert budget["metadata"]["namespace"] == "tenant"
