"""deploy/prometheus: promtool checks the scrape config and the rules and runs their unit
tests; every PromQL expression of the rules and the dashboard parses and names only metrics and
labels that tokenfeed exports."""

from __future__ import annotations

import json

import pytest
import yaml
from deploy_support import (
    DASHBOARD,
    DEPLOY,
    ROOT,
    RULES,
    alerting_rules,
    dashboard_queries,
    name_problems,
    promql_names,
    promtool_parse,
    recording_rules,
    run,
    tool,
)
from tokenfeed.server.telemetry import metrics

PROMETHEUS = DEPLOY / "prometheus"


def _all_expressions() -> list[tuple[str, str]]:
    rules = [(f"rule {name}", expr) for name, expr in recording_rules().items()]
    rules += [(f"alert {name}", rule["expr"]) for name, rule in alerting_rules().items()]
    return rules + dashboard_queries(json.loads(DASHBOARD.read_text()))


def test_promtool_check_config():
    out = run([tool("bin/promtool"), "check", "config", PROMETHEUS / "prometheus.yml"])
    assert "1 rule files found" in out.stdout


def test_promtool_check_rules():
    run([tool("bin/promtool"), "check", "rules", RULES])


def test_promtool_unit_tests_pass():
    out = run([tool("bin/promtool"), "test", "rules", PROMETHEUS / "rules_test.yml"])
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    tests = yaml.safe_load((PROMETHEUS / "rules_test.yml").read_text())["tests"]
    fired, quiet = set(), set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    alerts = set(alerting_rules())
    assert alerts - fired == set(), "alerts never fired by rules_test.yml"
    assert alerts - quiet == set(), "alerts never shown quiet by rules_test.yml"


def test_every_alert_has_severity_summary_and_a_section_in_the_guide():
    guide = (ROOT / "docs" / "deployment.md").read_text()
    for name, rule in alerting_rules().items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert f"#### {name}" in guide, f"docs/deployment.md has no section for {name}"


def test_every_expression_parses(tmp_path):
    exprs = _all_expressions()
    assert len(exprs) > 40
    proc = promtool_parse([e for _, e in exprs], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_parse_check_rejects_a_broken_expression(tmp_path):
    proc = promtool_parse(["sum by (instance (rate(tokenfeed_requests_total[5m]))"], tmp_path)
    assert proc.returncode != 0


@pytest.mark.parametrize("where,expr", _all_expressions(), ids=lambda v: str(v)[:60])
def test_expression_names_only_exported_metrics_and_labels(where, expr):
    assert name_problems(expr) == [], f"{where}: {expr}"


def test_every_named_metric_is_in_exported_names():
    named = set()
    for _, expr in _all_expressions():
        named |= promql_names(expr).metrics
    # (Recording rules, level:metric:operation, may begin with a tokenfeed_ label name.)
    tokenfeed = {n for n in named if n.startswith(("tokenfeed_", "process_")) and ":" not in n}
    assert tokenfeed <= metrics.exported_names()


def test_no_exported_label_is_a_target_label():
    """Prometheus would store a scraped `job` or `instance` as `exported_job`/`exported_instance`
    (or, with honor_labels, overwrite its own): every scrape config would need a relabel rule."""
    from deploy_support import TARGET_LABELS, metric_families

    clashes = {n: ls for n, ls in metric_families().items() if set(ls) & TARGET_LABELS}
    assert clashes == {}
    assert "tokenfeed_job" in metric_families()["tokenfeed_served_tokens_total"]


@pytest.mark.parametrize(
    "expr,problem",
    [
        ("rate(tokenfeed_request_total[5m])", "unknown metric tokenfeed_request_total"),
        ("tokenfeed_requests", "unknown metric tokenfeed_requests"),  # a counter needs _total
        ('tokenfeed_serving{job="x", kind="tokens"}', "tokenfeed_serving has no label kind"),
        ('tokenfeed_job_ready{job="run3"} == 0', None),  # the scrape job: every series has it
        ("sum by (reason) (tokenfeed_job_ready)", "no metric of the expression has label reason"),
        ("sum by (tokenfeed_job) (rate(tokenfeed_served_tokens_total[5m]))", None),
        (
            "histogram_quantile(0.9, sum by (le, op) (rate("
            "tokenfeed_object_store_request_duration_seconds_bucket[5m])))",
            None,
        ),
        (
            'instance:tokenfeed_cache_hit_ratio:rate10m{kind="x"}',
            "instance:tokenfeed_cache_hit_ratio:rate10m has no label kind",
        ),
    ],
)
def test_the_name_check_catches_typos(expr, problem):
    problems = name_problems(expr)
    assert problems == ([problem] if problem else []), problems


def test_dashboard_and_rules_cover_the_metrics():
    """The dashboard shows every tokenfeed metric family (the issue's list, and the rest)."""
    from deploy_support import metric_families

    shown = set()
    for _, expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        shown |= promql_names(expr).metrics
    families = {n for n in metric_families() if n.startswith("tokenfeed_")}
    wanted = {n for n in families if not n.endswith(("_sum", "_count"))}
    assert wanted - shown == set()
