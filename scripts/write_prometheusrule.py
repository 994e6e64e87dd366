"""Write deploy/kubernetes/prometheusrule.yaml from deploy/prometheus/model-monitoring.rules.yml
(the same groups, for the Prometheus Operator). Run after changing the rule file;
tests/unit/test_monitoring_rules.py fails while the two differ.

    .venv/bin/python scripts/write_prometheusrule.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "model-monitoring.rules.yml"
TARGET = REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"
HEADER = """\
# Prometheus Operator: the drift, confidence and SLO rules of
# deploy/prometheus/model-monitoring.rules.yml (the same groups, written by
# scripts/write_prometheusrule.py; a test keeps them equal), for the Prometheus that scrapes the
# PodMonitor beside it (its ruleSelector must select this resource). docs/monitoring.md says what
# each rule and alert means.
"""


class BlockDumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as in the rule file."""


def text(dumper: yaml.SafeDumper, value: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


BlockDumper.add_representer(str, text)


def main() -> None:
    resource = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": "torchserve-vision"}, "spec": yaml.safe_load(RULES.read_text())}
    TARGET.write_text(HEADER + yaml.dump(resource, Dumper=BlockDumper, sort_keys=False, width=200))


if __name__ == "__main__":
    main()
