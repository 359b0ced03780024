"""What operators install beside fedtier (deploy/): the Grafana dashboard, the Prometheus alerting
rules with their unit tests, and the scrape config. Every query must name series a fedtier node
exports, with labels it exports; promtool (Debian's prometheus package, installed by install.sh)
checks the rules, runs their tests, checks the config and parses every dashboard query."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from conftest import require
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

from fedtier.runtime.metrics import BYTES, DOCS, MESSAGES, Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LABELS = {"node", "role", "rollout", "cell", "reason", "kind", "tier", "direction", "identity", "phase",  # fedtier's
          "instance", "job", "le"}  # Prometheus's (target labels) and the histograms' buckets
NAME = re.compile(r"\b((?:fedtier|process|python)_[a-z_]+|up)\b")


def promtool() -> str:
    found = shutil.which("promtool")
    require(found is not None, "promtool (Debian's prometheus package; install.sh)")
    assert found is not None
    return found


def exported() -> set[str]:
    """Every sample name a scrape of fedtier nodes can return: each series in ``DOCS`` as its kind
    exposes it (the same declaration the nodes make), and the process's own series."""
    m = Metrics(node="n", role="cloud")
    for name in DOCS:
        if name in (MESSAGES, BYTES):
            continue  # the traffic collector's: always there
        if name.endswith("_total"):
            m.inc(name, reason="x")
        elif name.endswith("_seconds") and not name.endswith("_timestamp_seconds"):
            m.observe(name, 1.0)
        else:
            m.set(name, 1.0)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    from prometheus_client.exposition import generate_latest

    text = m.render() + generate_latest(registry).decode()
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    return names | {MESSAGES, BYTES, "up"}


def grafana_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable of the dashboard."""
    doc = json.loads((DEPLOY / "grafana" / "fedtier.json").read_text())
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in doc["templating"]["list"]:
        query = variable["query"]["query"]
        yield f"variable {variable['name']}", re.sub(r"^label_values\((\w+), *\w+\)$", r"\1", query)


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def used_labels(expr: str) -> set[str]:
    """Label names in selectors, ``by``/``without``/``on``/``ignoring`` clauses and templates."""
    found: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        found |= {label.strip() for label in group.split(",") if label.strip()}
    for selector in re.findall(r"\{([^}]*)\}", expr):
        found |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    return found


def test_every_grafana_query_names_series_fedtier_exports_with_its_labels() -> None:
    names = exported()
    queries = list(grafana_queries())
    assert len(queries) >= 20
    for where, expr in queries:
        named = set(NAME.findall(expr))
        assert named, (where, expr)
        assert named <= names, (where, sorted(named - names))
        assert used_labels(expr) <= LABELS, (where, sorted(used_labels(expr) - LABELS))
        assert "legendFormat" not in expr
    doc = json.loads((DEPLOY / "grafana" / "fedtier.json").read_text())
    legends = {t["legendFormat"] for p in doc["panels"] for t in p.get("targets", [])}
    assert {label for legend in legends for label in re.findall(r"\{\{(\w+)\}\}", legend)} <= LABELS


def test_the_dashboard_shows_the_series_an_operator_watches() -> None:
    shown = {n for _, expr in grafana_queries() for n in NAME.findall(expr)}
    for name in ("fedtier_accuracy", "fedtier_loss", "fedtier_round_seconds_bucket", "fedtier_devices_online",
                 "fedtier_rejected_total", "fedtier_bytes_total", "fedtier_epsilon_spent_max",
                 "fedtier_identity_conflicts_total", "fedtier_round_deadline_timestamp_seconds",
                 "fedtier_training_failed_total", "fedtier_secagg_waited_total", "fedtier_federated_accuracy_min"):
        assert name in shown, name


def test_every_alert_names_series_fedtier_exports_with_its_labels() -> None:
    names = exported()
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"FedtierRolloutStalled", "FedtierCellBelowQuorum", "FedtierRejectsSpiking",
                                           "FedtierIdentityConflict", "FedtierEpsilonNearBudget"}
    for rule in rules:
        named = set(NAME.findall(rule["expr"]))
        assert named and named <= names, (rule["alert"], sorted(named - names))
        assert used_labels(rule["expr"]) <= LABELS, rule["alert"]
        templated = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))
        assert templated <= LABELS, (rule["alert"], templated - LABELS)


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    tool = promtool()
    rules = subprocess.run([tool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")], capture_output=True,
                           text=True, timeout=60)
    config = subprocess.run([tool, "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "scrape.yml")],
                            capture_output=True, text=True, timeout=60)

    assert rules.returncode == 0 and f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout, \
        rules.stdout + rules.stderr
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    tool = promtool()
    done = subprocess.run([tool, "test", "rules", "alerts_test.yml"], cwd=DEPLOY / "prometheus", capture_output=True,
                          text=True, timeout=120)

    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    cases = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in alert_rules()}  # every alert has a test


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, its Grafana variables filled in, as a recording rule: ``promtool check rules`` parses it."""
    tool = promtool()
    fill = {"$__rate_interval": "5m", "$job": ".*", "$rollout": ".*"}
    rules = []
    for i, (_, expr) in enumerate(grafana_queries()):
        for variable, value in fill.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"fedtier:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))

    done = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", ["grafana/fedtier.json", "prometheus/alerts.yml", "prometheus/alerts_test.yml",
                                  "prometheus/scrape.yml"])
def test_the_operations_runbook_points_at_each_shipped_file(path: str) -> None:
    assert f"deploy/{path}" in (ROOT / "docs" / "operations.md").read_text()
