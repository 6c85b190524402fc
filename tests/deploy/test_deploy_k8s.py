"""deploy/k8s: every manifest validated offline, and the manifests agree with each other.

Core kinds go through kubernetes-validate in strict mode (unknown fields are errors) for the
oldest and newest Kubernetes versions we support. Prometheus Operator kinds (ServiceMonitor,
PrometheusRule) are not in Kubernetes' schemas: they are checked against the operator's API
types (operator_check.py, run in .tools/venv).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    CLIENT_IMAGE,
    DEPLOY,
    K8S,
    ROOT,
    RULES,
    SERVER_DOCKERFILE,
    SERVER_IMAGE,
    manifest,
    manifests,
    parse_dockerfile,
    run,
    tool,
)
from tokenfeed.server.settings import config as configmod

# 1.29: native sidecars (initContainers with restartPolicy: Always) on by default; gRPC probes
# are GA since 1.27. The newest: whatever kubernetes-validate knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
OPERATOR_CHECK = Path(__file__).with_name("operator_check.py")


def _core_documents():
    return [(p, d) for p, d in manifests() if d["kind"] not in OPERATOR_KINDS]


def _id(item) -> str:
    path, doc = item
    return f"{path.relative_to(K8S)}:{doc['kind']}"


def test_the_expected_manifests_exist():
    kinds = {(p.relative_to(K8S).parts[0], d["kind"]) for p, d in manifests()}
    assert kinds == {
        ("sidecar", "ConfigMap"),
        ("sidecar", "Job"),
        ("fleet", "ConfigMap"),
        ("fleet", "Service"),
        ("fleet", "StatefulSet"),
        ("fleet", "PodDisruptionBudget"),
        ("fleet", "ServiceMonitor"),
        ("fleet", "PrometheusRule"),
        ("fleet", "HorizontalPodAutoscaler"),
    }


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", _core_documents(), ids=_id)
def test_manifest_is_valid_in_strict_mode(item, version):
    path, doc = item
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{path}: {'.'.join(map(str, e.path))}: {e.message}")


def test_strict_validation_catches_a_misspelt_field():
    doc = copy.deepcopy(manifest("StatefulSet", "fleet"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_operator_resources_match_the_operator_api(tmp_path):
    files = sorted({str(p) for p, d in manifests() if d["kind"] in OPERATOR_KINDS})
    assert len(files) == 2
    # Two broken copies in the same run, to show the check finds a misspelt field and a bad
    # value (the operator's models load slowly: one interpreter for all files).
    misspelt = copy.deepcopy(manifest("ServiceMonitor", "prometheus-operator"))
    misspelt["spec"]["endpoints"][0]["intervall"] = "15s"
    bad_value = copy.deepcopy(manifest("ServiceMonitor", "prometheus-operator"))
    bad_value["spec"]["endpoints"][0]["scheme"] = "grpc"
    broken = []
    for name, doc in (("misspelt", misspelt), ("bad_value", bad_value)):
        broken.append(tmp_path / f"{name}.yaml")
        broken[-1].write_text(yaml.safe_dump(doc))
    out = run([tool("venv/bin/python"), OPERATOR_CHECK, *files, *broken], timeout=60).stdout
    problems = json.loads(out)
    assert [p for p in problems if not p.startswith(str(tmp_path))] == []
    assert any(
        p.startswith(f"{broken[0]}#0") and "intervall: unknown field" in p for p in problems
    ), problems
    assert any(p.startswith(f"{broken[1]}#0") and "scheme" in p for p in problems), problems


def test_prometheusrule_is_generated_from_rules_yml():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prometheusrule", DEPLOY / "prometheus" / "prometheusrule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checked_in = module.OUT.read_text()
    assert checked_in == module.render(RULES.read_text()), (
        "run: python deploy/prometheus/prometheusrule.py"
    )
    rule = manifest("PrometheusRule", "prometheus-operator")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


@pytest.mark.parametrize("directory", ["sidecar", "fleet"])
def test_configmap_holds_a_valid_server_config(directory, tmp_path):
    data = manifest("ConfigMap", directory)["data"]
    path = tmp_path / "config.yaml"
    path.write_text(data["config.yaml"])
    cfg = configmod.load(path)
    assert cfg.server.listen == "0.0.0.0:50051"
    assert cfg.server.metrics_listen == "0.0.0.0:9100"
    assert cfg.server.cache_dir == "/var/cache/tokenfeed"
    assert cfg.server.log_format == "json"
    assert cfg.jobs


def _pod(directory: str) -> dict:
    kind = {"sidecar": "Job", "fleet": "StatefulSet"}[directory]
    return manifest(kind, directory)["spec"]["template"]


def _tokenfeed_container(directory: str) -> dict:
    pod = _pod(directory)["spec"]
    (c,) = [
        c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "tokenfeed"
    ]
    return c


@pytest.mark.parametrize("directory", ["sidecar", "fleet"])
def test_tokenfeed_container_matches_config_and_image(directory):
    pod = _pod(directory)["spec"]
    c = _tokenfeed_container(directory)
    cfg = configmod.from_dict(
        yaml.safe_load(manifest("ConfigMap", directory)["data"]["config.yaml"])
    )
    dockerfile = parse_dockerfile(SERVER_DOCKERFILE)

    assert c["image"] == SERVER_IMAGE
    (cmd,) = dockerfile.final("CMD")
    assert c["args"] == cmd.json_args()  # the image's own default command, spelt out
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "grpc": int(cfg.server.listen.rsplit(":", 1)[1]),
        "metrics": int(cfg.server.metrics_listen.rsplit(":", 1)[1]),
    }

    # Native gRPC probes on the gRPC port; readiness asks for the TokenFeed service, which
    # turns NOT_SERVING as soon as a drain starts.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"], probe
    assert c["readinessProbe"]["grpc"]["service"] == "tokenfeed.v1.TokenFeed"
    assert c["startupProbe"]["grpc"]["service"] == "tokenfeed.v1.TokenFeed"

    # Health is SERVING only once every index is built: the startup probe must allow a long
    # build (hours for a large corpus) before the kubelet restarts the container.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 6 * 3600
    # A drain must fit in the pod's grace period, and liveness must not kill a draining server.
    grace = pod.get("terminationGracePeriodSeconds", 30)
    assert grace > cfg.server.grace_seconds
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > cfg.server.grace_seconds

    # The config is mounted where the command reads it; the cache volume where cache_dir is.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/tokenfeed"] == "config"
    assert "/etc/tokenfeed/config.yaml" in c["args"]
    assert mounts[cfg.server.cache_dir] == "cache"
    (volume,) = dockerfile.final("VOLUME")
    assert json.loads(volume.args) == [cfg.server.cache_dir]
    config_volume = {v["name"]: v for v in pod["volumes"]}["config"]
    assert (
        config_volume["configMap"]["name"] == manifest("ConfigMap", directory)["metadata"]["name"]
    )

    # Runs as the image's non-root user, read-only root with a writable /tmp.
    (user,) = dockerfile.final("USER")
    assert pod["securityContext"]["runAsUser"] == int(user.args.split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in mounts

    # requests and limits for CPU and memory
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind


def test_sidecar_cache_is_an_emptydir_above_the_budget():
    pod = _pod("sidecar")["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    cfg = configmod.from_dict(
        yaml.safe_load(manifest("ConfigMap", "sidecar")["data"]["config.yaml"])
    )
    assert _quantity(volumes["cache"]["emptyDir"]["sizeLimit"]) > cfg.server.cache_bytes


def test_sidecar_is_native_and_the_trainer_talks_to_localhost():
    job = manifest("Job", "sidecar")
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "tokenfeed" and init["restartPolicy"] == "Always"
    (trainer,) = pod["containers"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["TOKENFEED_TARGET"] == "localhost:50051"
    assert trainer["image"] == CLIENT_IMAGE
    cfg = configmod.from_dict(
        yaml.safe_load(manifest("ConfigMap", "sidecar")["data"]["config.yaml"])
    )
    job_spec = cfg.job(env["TOKENFEED_JOB"])
    world = int(env["WORLD_SIZE"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == world
    assert job["spec"]["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX is the rank
    assert job_spec.global_batch_size % world == 0


def test_fleet_selectors_service_pdb_and_volume_claims_agree():
    sts = manifest("StatefulSet", "fleet")
    svc = manifest("Service", "fleet")
    pdb = manifest("PodDisruptionBudget", "fleet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1

    assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS record per server
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    container_ports = {p["name"] for p in _tokenfeed_container("fleet")["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports

    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "cache"
    cfg = configmod.from_dict(yaml.safe_load(manifest("ConfigMap", "fleet")["data"]["config.yaml"]))
    assert _quantity(claim["spec"]["resources"]["requests"]["storage"]) > cfg.server.cache_bytes
    assert sts["spec"]["replicas"] >= 2


def test_servicemonitor_scrapes_the_fleet_service_like_prometheus_yml():
    svc = manifest("Service", "fleet")
    sm = manifest("ServiceMonitor", "prometheus-operator")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # job="tokenfeed", as in the compose scrape config the rules were written for.
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "tokenfeed"
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "tokenfeed"]
    # Series are stored as tokenfeed exports them (its labels never collide with the target
    # labels `job` and `instance`): neither scrape relabels them.
    relabel = [
        {_camel(k): v for k, v in r.items()} for r in job.get("metric_relabel_configs", [])
    ]  # operator spelling
    assert endpoint.get("metricRelabelings", []) == relabel == []
    assert endpoint["path"] == job["metrics_path"]


def test_images_are_pinned():
    for path, doc in manifests():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for c in pod.get("initContainers", []) + pod["containers"]:
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest", f"{path}: {c['image']}"


def test_manifests_are_documented():
    guide = (ROOT / "docs" / "deployment.md").read_text()
    for path in sorted({p for p, _ in manifests()}):
        assert str(path.relative_to(ROOT)) in guide, path


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w.title() for w in rest)


def _quantity(value: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(value[: -len(suffix)]) * factor
    return int(value)


def _adapter_rule() -> dict:
    config = yaml.safe_load(manifest("ConfigMap", "autoscaling")["data"]["config.yaml"])
    (rule,) = config["externalRules"]
    return rule


def test_autoscaler_scales_the_fleet_on_the_adapters_wait_ratio():
    hpa, fleet = (
        manifest("HorizontalPodAutoscaler", "autoscaling"),
        manifest("StatefulSet", "fleet"),
    )
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", fleet["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == _adapter_rule()["name"]["as"]
    # Below the alert's threshold, so the alert means "scaling did not help".
    (alert,) = [r for r in _alert_rules() if r["alert"] == "TokenfeedTrainersWaiting"]
    threshold = float(alert["expr"].rsplit(">", 1)[1])
    assert _milli(metric["external"]["target"]["value"]) < threshold
    pdb = manifest("PodDisruptionBudget", "fleet")
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]
    assert hpa["spec"]["minReplicas"] <= fleet["spec"]["replicas"] < hpa["spec"]["maxReplicas"]
    # Scale down more slowly than up: low waits are what a big enough fleet looks like.
    behavior = hpa["spec"]["behavior"]
    assert (
        behavior["scaleDown"]["stabilizationWindowSeconds"]
        > (behavior["scaleUp"]["stabilizationWindowSeconds"])
    )


def test_adapter_query_parses_and_names_exported_metrics(tmp_path):
    from deploy_support import name_problems, promtool_parse

    rule = _adapter_rule()
    selector = manifest("HorizontalPodAutoscaler", "autoscaling")["spec"]["metrics"][0]
    labels = selector["external"]["metric"]["selector"]["matchLabels"]
    matchers = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    expr = rule["metricsQuery"].replace("<<.LabelMatchers>>", matchers)
    assert "<<" not in expr
    proc = promtool_parse([expr, rule["seriesQuery"]], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert name_problems(expr) == [] and name_problems(rule["seriesQuery"]) == []


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def _milli(value: str) -> float:
    return int(value[:-1]) / 1000 if value.endswith("m") else float(value)
