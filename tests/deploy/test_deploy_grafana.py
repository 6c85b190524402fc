"""deploy/grafana: the dashboard is its generator's output, laid out without overlaps, and
wired to the provisioned data source; the provisioning files point where compose mounts them.

(No Grafana binary is available offline, so the dashboard's schema is checked structurally;
its queries are checked by promtool and against metrics.py in test_deploy_prometheus.py, and
run against a real Prometheus in test_deploy_live.py.)
"""

from __future__ import annotations

import importlib.util
import json

import yaml
from deploy_support import DASHBOARD, DEPLOY, compose_config

GRAFANA = DEPLOY / "grafana"


def _generator():
    spec = importlib.util.spec_from_file_location("dashboard", GRAFANA / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_dashboard_is_the_generator_output():
    generator = _generator()
    assert generator.OUT == DASHBOARD
    assert DASHBOARD.read_text() == generator.render(), "run: python deploy/grafana/dashboard.py"


def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "tokenfeed" and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "bargauge"}, p["type"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and p["fieldConfig"]["defaults"]["unit"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # every $variable a query uses is defined
    used = {w for p in d["panels"] for t in p.get("targets", []) for w in _variables(t["expr"])}
    assert used - set(variables) - {"__rate_interval"} == set()


def _variables(expr: str) -> set[str]:
    import re

    return set(re.findall(r"\$\{?(\w+)", expr))


def test_datasource_provisioning_matches_the_dashboard_and_compose():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    d = json.loads(DASHBOARD.read_text())
    variable = {v["name"]: v for v in d["templating"]["list"]}["datasource"]
    assert source["type"] == variable["query"] == "prometheus"
    assert variable["current"]["value"] == source["uid"]
    services = compose_config()["services"]
    ports = {p["target"] for p in services["prometheus"]["ports"]}
    assert source["url"] == f"http://prometheus:{ports.pop()}"
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "tokenfeed"]
    assert source["jsonData"]["timeInterval"] == job["scrape_interval"]


def test_dashboard_provider_reads_where_compose_mounts_the_dashboards():
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "tokenfeed.yml").read_text()
    )
    (p,) = provider["providers"]
    grafana = compose_config()["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"] if v["type"] == "bind"}
    assert mounts[p["options"]["path"]] == str(GRAFANA / "dashboards")
    assert mounts["/etc/grafana/provisioning"] == str(GRAFANA / "provisioning")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{p['options']['path']}/{DASHBOARD.name}"
