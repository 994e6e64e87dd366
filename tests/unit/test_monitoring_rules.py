"""The drift, confidence and SLO rules (deploy/prometheus/model-monitoring.rules.yml and the
PrometheusRule of deploy/kubernetes): valid for promtool, their behaviour unit-tested by
`promtool test rules` (tests/prometheus/model-monitoring.test.yml), the same groups in both
files, the series they read named as the workers and the frontend agent export them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import yaml

from handlers.drift.drift_metrics import drift_dimensions
from tests.deployment_files import DEPLOY, REPO, closed_schema, rendered, resource

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"   # Debian's prometheus package
RULES = DEPLOY / "prometheus" / "model-monitoring.rules.yml"
RULE_TESTS = REPO / "tests" / "prometheus" / "model-monitoring.test.yml"
PROMETHEUSRULE_SCHEMA = REPO / "tests" / "schemas" / \
    "prometheus-operator-v0.93.0-prometheusrule-v1.schema.json"
AGENT = REPO / "torchserve_vision" / "frontend" / "ContinuousBatching.java"


def promtool(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *arguments], capture_output=True, text=True, timeout=120, check=False)


def test_the_rules_are_valid_and_pass_their_unit_tests():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_unit_tests_fail_when_an_alert_threshold_is_wrong(tmp_path):
    """The rule tests can fail: with the drift alerts' threshold above the largest divergence
    there is, the firing alerts they expect are missing."""
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    (tmp_path / "tests" / "prometheus").mkdir(parents=True)
    text = RULES.read_text()
    assert text.count("> 0.1\n") == 2
    (tmp_path / "deploy" / "prometheus" / RULES.name).write_text(text.replace("> 0.1\n", "> 1.5\n"))
    shutil.copy(RULE_TESTS, tmp_path / "tests" / "prometheus" / RULE_TESTS.name)
    tested = promtool("test", "rules", str(tmp_path / "tests" / "prometheus" / RULE_TESTS.name))
    assert tested.returncode != 0 and "ModelInputDrift" in tested.stdout + tested.stderr


def test_the_prometheusrule_carries_the_same_groups_and_matches_the_operators_schema():
    rule = resource(rendered("cpu"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "torchserve-vision"
    validator = jsonschema.Draft7Validator(closed_schema(json.loads(PROMETHEUSRULE_SCHEMA.read_text())))
    assert [error.message for error in validator.iter_errors(rule)] == []
    misspelt = {**rule, "spec": {"group": rule["spec"]["groups"]}}
    assert list(validator.iter_errors(misspelt))
    assert resource(rendered("gpu"), "PrometheusRule")["spec"] == rule["spec"]


def test_the_rules_read_the_series_the_workers_and_the_frontend_agent_export():
    text = RULES.read_text()
    worker_labels = [dimension.name for dimension in drift_dimensions("m", "1", "f", "b")]
    for name in ("ModelName", "ModelVersion", "Feature", "Bucket"):
        assert name in worker_labels and f"{name}" in text
    assert {"HandlerDriftObserved", "HandlerDriftReference"} <= set(re.findall(r"Handler\w+", text))
    agent = AGENT.read_text()
    assert 'LATENCY_METRIC = "ts_request_latency_seconds"' in agent
    assert '.labelNames("model_name", "model_version", "hostname")' in agent
    bounds = re.search(r"LATENCY_BUCKETS_S = \{([^}]*)\}", agent)
    assert bounds is not None and "0.25" in [bound.strip() for bound in bounds[1].split(",")]
    assert set(re.findall(r'le="([^"]+)"', text)) == {"0.25"}


def test_every_rule_file_path_the_tests_name_exists():
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert [(RULE_TESTS.parent / path).resolve() for path in tests["rule_files"]] == [RULES.resolve()]
    assert Path(PROMTOOL).exists(), "promtool comes with Debian's prometheus package (scripts/setup.sh)"
