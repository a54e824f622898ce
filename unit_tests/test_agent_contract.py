"""The contract between the operator and the agent (tailnet_agent.contract), from both sides.

What the operator writes the agent reads back unchanged (the targets and exposes files, the
environment), and the operator's lenient reader of ``/status`` names exactly the contract's keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_type_hints

import pytest
from pydantic import BaseModel

from tailnet_agent import config
from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract import status as wire
from tailnet_agent.contract.endpoints import HEALTH_PORT
from tailnet_agent.contract.exposes import Backend, Expose, VirtualHost, exposes_document, parse_exposes
from tailnet_agent.contract.targets import PortMapping, Target, parse_targets, targets_document
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers import egress_status as reader
from tailnet_operator.resources import agent as pod
from tailnet_operator.resources import egress as egress_build


def _aliases(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(("model", "shape"), [
    (reader.AgentNode, wire.NodeEntry),
    (reader.AgentTarget, wire.TargetEntry),
    (reader.AgentExpose, wire.ExposeEntry),
    (reader.AgentHost, wire.HostEntry),
    (reader.AgentFile, wire.FileEntry),
])
def test_the_operator_reads_every_key_of_the_status_contract_and_no_other(model: type[BaseModel],
                                                                         shape: type[Any]) -> None:
    assert _aliases(model) == set(get_type_hints(shape))


def test_the_operator_reads_both_documents() -> None:
    assert _aliases(reader.AgentStatusDocument) == set(get_type_hints(wire.EgressStatus)) | set(
        get_type_hints(wire.IngressStatus))


def test_a_targets_file_reads_back_as_written() -> None:
    targets = (Target(name="db", address="100.64.0.7", ports=(PortMapping(port=5432, listen=10000),)),
               Target(name="web", address="web.example", ports=(PortMapping(port=443, listen=10001),
                                                                PortMapping(port=80, listen=10002))))
    assert parse_targets(targets_document(targets)) == targets


def test_an_exposes_file_reads_back_as_written() -> None:
    exposes = (
        Expose(name="db", port=5432, backend=Backend(host="db.shop.svc", port=5432)),
        Expose(name="web", port=443, mode="http",
               backend=Backend(host="web.shop.svc", port=8443, scheme="https", protocol="h2",
                               ca_file="/etc/ca.crt", server_name="web.internal"),
               hosts=(VirtualHost(name="shop.example.com", alias="shop", aliases=("shop.corp.example",),
                                  cert_file="/tls/a.crt", key_file="/tls/a.key"),
                      VirtualHost(name="admin.example.com", cert_file="/tls/b.crt", key_file="/tls/b.key"))),
    )
    assert parse_exposes(exposes_document(exposes)) == exposes


def test_the_agent_loads_the_environment_the_operator_sets(tmp_path: Path) -> None:
    """The egress Deployment's env, with its mounted directories moved under ``tmp_path``."""
    egress = TailnetEgress.model_validate({
        "metadata": {"name": "db", "namespace": "apps"},
        "spec": {"tailnetRef": {"name": "tn"}, "tag": "tag:db", "consumerNamespaces": ["apps"],
                 "targets": [{"name": "pg", "address": "100.64.0.7", "ports": [{"port": 5432}]}]}})
    agent = pod.AgentSpec(image="img", control_url="https://hs.test", auth_secret="key", ca_bundle="pem")
    owner = {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
             "metadata": {"name": "db", "namespace": "apps", "uid": "u"}}
    ports = egress_build.listen_ports(egress, {})
    data = egress_build.config_map(owner, egress, ports, "pem")["data"]
    container = egress_build.deployment(owner, egress, agent)["spec"]["template"]["spec"]["containers"][0]
    mounts = {pod.CONFIG_DIR: tmp_path / "config", pod.AUTH_DIR: tmp_path / "auth"}
    for directory in mounts.values():
        directory.mkdir()
    for name, text in data.items():
        (mounts[pod.CONFIG_DIR] / name).write_text(text)
    (mounts[pod.AUTH_DIR] / "authKey").write_text("secret\n")
    env: dict[str, str] = {}
    for item in container["env"]:
        value = item["value"]
        for mount, local in mounts.items():
            value = value.replace(mount, str(local))
        env[item["name"]] = value
    assert env[env_names.AGENT_MODE] == env_names.EGRESS
    cfg = config.load(env, mode=env[env_names.AGENT_MODE])
    assert cfg.targets == (Target(name="pg", address="100.64.0.7",
                                  ports=(PortMapping(port=5432, listen=ports[("pg", 5432)]),)),)
    assert (cfg.control_url, cfg.auth_key, cfg.hostname) == ("https://hs.test", "secret", "db-apps")
    assert cfg.ca_bundle == mounts[pod.CONFIG_DIR] / pod.CA_FILE
    assert cfg.health_port == HEALTH_PORT
