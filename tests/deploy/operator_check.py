"""Checks Prometheus Operator resources against the operator's own API types.

Run by the .tools/venv interpreter (scripts/install_tools.sh), which has the prometheus-operator
models generated from the operator's CRDs (cloudcoil-models-prometheus-operator): types, enums,
patterns and required fields come from there. The models ignore unknown fields, so a field the
API does not know (a typo) is found by comparing the input with what the model kept.

    python operator_check.py FILE...   -> prints a JSON list of problems (empty: all valid)
"""

from __future__ import annotations

import json
import sys

import yaml
from cloudcoil.models.prometheus_operator import v1
from pydantic import ValidationError

KINDS = {
    "ServiceMonitor": v1.ServiceMonitor,
    "PrometheusRule": v1.PrometheusRule,
    "PodMonitor": v1.PodMonitor,
}


def unknown_fields(given, kept, path: str) -> list[str]:
    if isinstance(given, dict) and isinstance(kept, dict):
        out = []
        for key, value in given.items():
            if key not in kept:
                out.append(f"{path}.{key}: unknown field")
            else:
                out.extend(unknown_fields(value, kept[key], f"{path}.{key}"))
        return out
    if isinstance(given, list) and isinstance(kept, list):
        return [
            p
            for i, (g, k) in enumerate(zip(given, kept, strict=False))
            for p in unknown_fields(g, k, f"{path}[{i}]")
        ]
    return []


def check(doc: dict, where: str) -> list[str]:
    model = KINDS.get(doc.get("kind"))
    if model is None or doc.get("apiVersion") != "monitoring.coreos.com/v1":
        return [f"{where}: not a monitoring.coreos.com/v1 kind this checker knows"]
    try:
        parsed = model.model_validate(doc)
    except ValidationError as e:
        return [f"{where}: {err['loc']}: {err['msg']}" for err in e.errors()]
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"{where}: {p}" for p in unknown_fields(doc, kept, doc["kind"])]


def main(paths: list[str]) -> int:
    problems = []
    for path in paths:
        with open(path) as f:
            for i, doc in enumerate(d for d in yaml.safe_load_all(f) if d):
                problems.extend(check(doc, f"{path}#{i}"))
    print(json.dumps(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
