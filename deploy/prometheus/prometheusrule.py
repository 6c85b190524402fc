"""Writes rules.yml as a Prometheus Operator PrometheusRule, for clusters that use the operator.

    python deploy/prometheus/prometheusrule.py   # -> deploy/k8s/fleet/prometheus-operator/

rules.yml stays the one source (promtool tests it); a test checks that the checked-in
PrometheusRule is what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules.yml"
OUT = HERE.parent / "k8s" / "fleet" / "prometheus-operator" / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/rules.yml by deploy/prometheus/prometheusrule.py: edit
# rules.yml and run the script. For clusters with the Prometheus Operator (needs its CRDs).
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(rules_text: str) -> str:
    groups = yaml.safe_load(rules_text)["groups"]
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "tokenfeed",
            "labels": {
                "app.kubernetes.io/name": "tokenfeed",
                "app.kubernetes.io/component": "server",
            },
        },
        "spec": {"groups": groups},
    }
    body = yaml.dump(resource, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return HEADER + body


def main() -> int:
    OUT.write_text(render(RULES.read_text()))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
