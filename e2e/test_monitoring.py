"""The monitoring bundle against a real Prometheus 3 (built from its Go module, hack/versions.py).

* The chart's PrometheusRule passes ``promtool check rules``, and ``promtool test rules`` runs
  e2e/monitoring/alerts_test.yaml: a firing and a non-firing case for every alert. The same tests
  fail against rules rendered with another threshold, so they do test the rules.
* Every alert has summary, description and a runbook_url naming a page in docs/runbooks/.
* A real Prometheus on 127.0.0.1, configured from the chart's ServiceMonitor and the agents'
  PodMonitor (their port, path, interval, relabelings and job naming), scrapes the operator run
  from source against the test kube-apiserver and a Headscale, and an egress agent process joined
  to that Headscale: it sees ``controller_runtime_reconcile_total``, the working key's expiry (equal
  to the Tailnet's status), the agent's control connection, and evaluates every alert rule
  without error. Every metric a dashboard panel queries was seen in that scrape.
* The dashboard ConfigMap carries the sidecar label and its JSON loads through kube-apiserver.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.operator import create_bootstrap_secret, tailnet_object, unique
from e2e.polling import eventually
from hack import binaries
from hack.localenv import Environment, Headscale, ManagedProcess, free_port
from hack.localenv.controlplane import ControlPlane
from hack.render_install import CHART, helm_template
from tailnet_agent.contract import environment as env_names
from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.kinds import CONFIG_MAP

REPO = Path(__file__).resolve().parent.parent
ALERT_TESTS = Path(__file__).resolve().parent / "monitoring" / "alerts_test.yaml"
RUNBOOKS = REPO / "docs" / "runbooks"
DASHBOARD = CHART / "files" / "dashboards" / "tailnet-operator.json"
NAMESPACE = "tailnet-system"
SCRAPE = "2s"
"""The test's scrape interval (a chart value; the default is 30s)."""


def render(*values: str) -> list[dict[str, Any]]:
    result = helm_template(*(arg for v in values for arg in ("--set", v)))
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def one(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in documents if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def rules_file(directory: Path, *values: str) -> Path:
    rule = one(render("prometheusRule.enabled=true", *values), "PrometheusRule")
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return path


def promtool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binaries.binary("promtool")), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rules")
    rules_file(directory)
    shutil.copy(ALERT_TESTS, directory / "alerts_test.yaml")
    return directory


def alerts() -> list[dict[str, Any]]:
    rule = one(render("prometheusRule.enabled=true"), "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


# -- rules ------------------------------------------------------------------------------------------

def test_promtool_checks_the_rules(rules_dir: Path) -> None:
    result = promtool("check", "rules", "rules.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout + result.stderr


def test_promtool_unit_tests_of_every_alert_pass(rules_dir: Path) -> None:
    result = promtool("test", "rules", "alerts_test.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names == {"TailnetOperatorDown", "TailnetOperatorReconcileErrors", "TailnetKeyExpiringSoon",
                     "TailnetPreAuthKeyExpiringSoon", "TailnetUnreachable", "TailnetRoutesNotApproved",
                     "TailnetAgentDisconnected", "TailnetPolicyRejected"}
    assert names <= firing, names - firing
    assert names <= quiet, names - quiet


def test_the_unit_tests_fail_against_rules_with_another_threshold(tmp_path: Path) -> None:
    rules_file(tmp_path, "prometheusRule.workingKeyExpiryWarningSeconds=60")
    shutil.copy(ALERT_TESTS, tmp_path / "alerts_test.yaml")
    result = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert result.returncode != 0
    assert "TailnetKeyExpiringSoon" in result.stdout + result.stderr


def test_every_alert_has_summary_description_severity_and_a_runbook() -> None:
    for alert in alerts():
        name, annotations = alert["alert"], alert["annotations"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert annotations["summary"] and annotations["description"], name
        url = annotations["runbook_url"]
        assert url.endswith(f"/docs/runbooks/{name}.md"), url
        page = RUNBOOKS / f"{name}.md"
        assert page.is_file(), page
        assert page.read_text().startswith(f"# {name}\n"), page
        assert name in (RUNBOOKS / "README.md").read_text()


def test_the_operator_job_follows_the_monitor_kind() -> None:
    def down(*values: str) -> str:
        rule = one(render("prometheusRule.enabled=true", *values), "PrometheusRule")
        return str(next(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]
                        if r.get("alert") == "TailnetOperatorDown"))

    assert down("metrics.serviceMonitor.enabled=true") == 'absent(up{job="tailnet-operator-metrics"} == 1)'
    assert down("metrics.podMonitor.enabled=true") == f'absent(up{{job="{NAMESPACE}/tailnet-operator"}} == 1)'
    assert down("prometheusRule.operatorJob=ops/op") == 'absent(up{job="ops/op"} == 1)'


# -- dashboard --------------------------------------------------------------------------------------

_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "time", "by",
              "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "topk",
              "bottomk", "abs", "clamp_min", "clamp_max", "label_replace", "absent", "vector", "scalar", "le"}


def dashboard_metrics(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Metric names in each panel's queries (label matchers and strings removed first)."""
    out: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\{[^}]*\}", "", re.sub(r'"[^"]*"', "", target["expr"]))
            expr = re.sub(r"\[[^\]]*\]", "", expr)
            expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
            names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in _FUNCTIONS}
            out.setdefault(panel["title"], set()).update(names)
    return out


def test_the_dashboard_parses_and_every_panel_queries_something() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tailnet-operator"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    per_panel = dashboard_metrics(dashboard)
    for panel in panels:
        assert panel["targets"] and per_panel[panel["title"]], panel["title"]
    cm = one(render("dashboards.enabled=true"), "ConfigMap", "tailnet-operator-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["tailnet-operator.json"]) == dashboard


# -- a real Prometheus ------------------------------------------------------------------------------

def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def _relabel(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """prometheus-operator's RelabelConfig (camelCase) -> Prometheus' relabel_config."""
    out = []
    for entry in entries or []:
        converted = {_snake(k): v for k, v in entry.items()}
        if "action" in converted:
            converted["action"] = str(converted["action"]).lower()
        out.append(converted)
    return out


def scrape_configs(documents: list[dict[str, Any]], ports: dict[str, int],
                   pod_labels: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Scrape jobs for the chart's monitors, as prometheus-operator generates them, with static
    targets on 127.0.0.1 in place of Kubernetes service discovery.

    ``ports`` maps each monitor's name to the port its named port resolves to here; ``pod_labels``
    the labels of the pod behind it (what Kubernetes SD would expose as ``__meta_*`` labels).
    """
    jobs = []
    for doc in documents:
        if doc["kind"] not in ("ServiceMonitor", "PodMonitor"):
            continue
        name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
        endpoints = doc["spec"].get("endpoints") or doc["spec"].get("podMetricsEndpoints")
        for index, endpoint in enumerate(endpoints):
            assert endpoint["port"] == "metrics"
            meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
                    for k, v in pod_labels[name].items()}
            if doc["kind"] == "ServiceMonitor":
                selector = doc["spec"]["selector"]["matchLabels"].items()
                [service] = [d["metadata"]["name"] for d in documents
                             if d["kind"] == "Service" and selector <= d["metadata"]["labels"].items()]
                kind, job = "serviceMonitor", service
            else:
                kind, job = "podMonitor", f"{namespace}/{name}"
            jobs.append({
                "job_name": f"{kind}/{namespace}/{name}/{index}",
                "metrics_path": endpoint.get("path", "/metrics"),
                "scheme": endpoint.get("scheme", "http"),
                "scrape_interval": endpoint["interval"],
                "scrape_timeout": endpoint["scrapeTimeout"],
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "static_configs": [{"targets": [f"127.0.0.1:{ports[name]}"],
                                    "labels": {"namespace": namespace, "pod": f"{name}-0", **meta}}],
                # prometheus-operator sets job to the Service's name (ServiceMonitor) or
                # <namespace>/<PodMonitor name>
                "relabel_configs": [{"target_label": "job", "replacement": job},
                                    *_relabel(endpoint.get("relabelings"))],
                "metric_relabel_configs": _relabel(endpoint.get("metricRelabelings")),
            })
    return jobs


class Prometheus:
    def __init__(self, environment: Environment, workdir: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.process = ManagedProcess(
            "prometheus", [binaries.binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                           f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                           "--log.level=info"],
            log_dir=environment.log_dir, run_id=environment.run_id, cwd=workdir)

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["data"]["result"]
        return result

    def ready(self) -> bool:
        self.process.check_running()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.mark.integration
async def test_a_real_prometheus_scrapes_the_operator_and_an_agent_with_the_shipped_monitors(
        environment: Environment, crds: ControlPlane, admin: Client, operator_namespace: str, headscale: Headscale,
        tmp_path: Path, processes: list[ManagedProcess]) -> None:
    control_plane_kubeconfig = crds.kubeconfig

    # the operator, from source, against the test kube-apiserver and Headscale
    metrics_port, probes_port = free_port(), free_port()
    operator = ManagedProcess(
        "operator-monitoring", [sys.executable, "-m", "tailnet_operator", f"--kubeconfig={control_plane_kubeconfig}",
                                f"--namespace={operator_namespace}", "--leader-elect",
                                f"--metrics-bind-address=127.0.0.1:{metrics_port}",
                                f"--health-probe-bind-address=127.0.0.1:{probes_port}", "--log-format=json"],
        log_dir=environment.log_dir, run_id=environment.run_id, cwd=REPO)
    operator.start()
    processes.append(operator)
    tailnet = unique(f"{operator_namespace}-mon")
    await create_bootstrap_secret(admin, operator_namespace, f"{tailnet}-bootstrap", headscale.api_key)
    await admin.apply(TAILNET, tailnet_object(tailnet, headscale, operator_namespace, secret=f"{tailnet}-bootstrap"))

    async def key_expiry() -> str | None:
        obj = await admin.get(TAILNET, tailnet)
        return ((obj.get("status") or {}).get("apiKey") or {}).get("expiresAt")

    expires_at = await eventually(key_expiry, timeout=60, what="the Tailnet's working key in status")

    # an egress agent joined to the same Headscale, its /metrics on 127.0.0.1
    agent_port = free_port()
    key_file = tmp_path / "authkey"
    key_file.write_text(headscale.create_preauth_key(tags=["tag:egress-mon"], reusable=True, ephemeral=True))
    agent = ManagedProcess(
        "agent-monitoring", [sys.executable, "-m", "tailnet_agent"],
        env={env_names.AGENT_MODE: env_names.EGRESS, env_names.CONTROL_URL: headscale.url,
             env_names.AUTH_KEY_FILE: str(key_file), env_names.HOSTNAME: "agent-monitoring",
             env_names.CA_BUNDLE: str(headscale.ca_bundle),
             env_names.TARGETS: json.dumps([{"name": "ledger", "address": "100.64.0.250",
                                             "ports": [{"port": 5432, "listen": free_port()}]}]),
             env_names.BIND_ADDRESS: "127.0.0.1", env_names.HEALTH_ADDRESS: f"127.0.0.1:{agent_port}",
             env_names.UDP_PORT: "0", env_names.LOG_FORMAT: "json"},
        log_dir=environment.log_dir, run_id=environment.run_id, cwd=REPO)
    agent.start()
    processes.append(agent)
    def agent_ready() -> bool:
        agent.check_running()
        return _http_ok(f"http://127.0.0.1:{agent_port}/readyz")

    await eventually(agent_ready, timeout=60, what="the agent Ready")

    # Prometheus configured from the chart's monitors and loaded with its rules
    documents = render("metrics.serviceMonitor.enabled=true", f"metrics.serviceMonitor.interval={SCRAPE}",
                       "metrics.serviceMonitor.scrapeTimeout=1s", "agents.podMonitor.enabled=true",
                       f"agents.podMonitor.interval={SCRAPE}", "agents.podMonitor.scrapeTimeout=1s")
    agent_labels = {"app.kubernetes.io/name": "tailnet-agent", "app.kubernetes.io/instance": "mon",
                    "app.kubernetes.io/component": "egress"}
    service_monitor = one(documents, "ServiceMonitor")
    selected = service_monitor["spec"]["selector"]["matchLabels"]
    metrics_service = one(documents, "Service", "tailnet-operator-metrics")
    assert selected.items() <= metrics_service["metadata"]["labels"].items(), "the ServiceMonitor selects the Service"
    assert metrics_service["spec"]["ports"][0]["name"] == "metrics"
    agent_monitor = one(documents, "PodMonitor", "tailnet-operator-agents")
    assert agent_monitor["spec"]["selector"]["matchLabels"].items() <= agent_labels.items()
    jobs = scrape_configs(documents, {"tailnet-operator": metrics_port, "tailnet-operator-agents": agent_port},
                          {"tailnet-operator": {}, "tailnet-operator-agents": agent_labels})
    rules = rules_file(tmp_path)
    prometheus = Prometheus(environment, tmp_path, {
        "global": {"scrape_interval": SCRAPE, "evaluation_interval": "1s"},
        "rule_files": [str(rules)], "scrape_configs": jobs})
    prometheus.process.start()
    processes.append(prometheus.process)
    await eventually(prometheus.ready, timeout=60, what="Prometheus ready")

    def up() -> list[dict[str, Any]]:
        result = prometheus.query("up == 1")
        return result if len(result) == 2 else []

    targets = await eventually(up, timeout=60, what="both targets up")
    assert {t["metric"]["job"] for t in targets} == {"tailnet-operator-metrics", f"{NAMESPACE}/tailnet-operator-agents"}

    reconciles = await eventually(lambda: prometheus.query(
        'sum by (controller) (controller_runtime_reconcile_total{job="tailnet-operator-metrics"}) > 0'),
        timeout=60, what="controller_runtime_reconcile_total scraped")
    assert "tailnet" in {r["metric"]["controller"] for r in reconciles}
    expiry = await eventually(
        lambda: prometheus.query(f'tailnet_operator_working_key_expiry_timestamp_seconds{{tailnet="{tailnet}"}}'),
        timeout=60, what="the working key expiry scraped")
    expected = datetime.fromisoformat(str(expires_at).replace("Z", "+00:00")).timestamp()
    assert float(expiry[0]["value"][1]) == pytest.approx(expected, abs=1)
    assert expiry[0]["metric"]["job"] == "tailnet-operator-metrics"
    connected = await eventually(lambda: prometheus.query("tailnet_agent_control_connected == 1"),
                                 timeout=60, what="the agent's control connection scraped")
    assert connected[0]["metric"]["parent"] == "mon" and connected[0]["metric"]["mode"] == "egress"
    ready = await eventually(lambda: prometheus.query(
        f'tailnet_operator_resource_condition{{kind="Tailnet", name="{tailnet}", condition="Ready", '
        'status="True"} == 1'), timeout=60, what="the Tailnet's Ready state-set scraped")
    assert ready
    await eventually(lambda: prometheus.query("tailnet_operator_headscale_requests_total"), timeout=30,
                     what="Headscale API requests scraped")

    # every rule evaluates against the real series. The Tailnet's key lives 2h here: inside the
    # warning threshold, so that alert is pending (it fires after 10 minutes); every other one is
    # quiet on this healthy setup once an evaluation has seen the scraped series, but for reconcile
    # errors, which a transient conflict may count (it is retried) and which fire only after 15m
    def as_expected(rule: dict[str, Any]) -> bool:
        if rule["health"] != "ok":
            return False
        if rule["name"] == "TailnetKeyExpiringSoon":
            return rule["state"] == "pending" and [a["labels"]["tailnet"] for a in rule["alerts"]] == [tailnet]
        if rule["name"] == "TailnetOperatorReconcileErrors":
            return bool(rule["state"] in ("inactive", "pending"))
        return bool(rule["state"] == "inactive")

    last: list[list[dict[str, Any]]] = [[]]

    def settled() -> bool:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        last[0] = [r for g in groups for r in g["rules"]]
        return len(last[0]) == len(alerts()) and all(as_expected(r) for r in last[0])

    try:
        await eventually(settled, timeout=60, interval=1, what="every rule evaluated as expected")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {[r for r in last[0] if not as_expected(r)]}") from None

    # every metric a dashboard panel queries was seen in this scrape
    seen = set(prometheus.get("/api/v1/label/__name__/values")["data"])
    for entry in prometheus.get("/api/v1/targets/metadata")["data"]:
        family = entry["metric"]
        seen |= {family, f"{family}_total", f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    dashboard = json.loads(DASHBOARD.read_text())
    missing = {panel: names - seen for panel, names in dashboard_metrics(dashboard).items() if names - seen}
    assert not missing, missing

    # and the dashboard loads as a ConfigMap
    cm = one(render("dashboards.enabled=true"), "ConfigMap", "tailnet-operator-dashboard")
    cm["metadata"]["namespace"] = operator_namespace
    await admin.apply(CONFIG_MAP, cm)
    stored = await admin.get(CONFIG_MAP, cm["metadata"]["name"], operator_namespace)
    assert stored["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(stored["data"]["tailnet-operator.json"])["uid"] == "tailnet-operator"
    operator.check_running()
    agent.check_running()

