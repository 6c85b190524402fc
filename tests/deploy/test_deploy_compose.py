"""docker-compose.yml: `docker compose config` accepts it, and the services are wired as the
stack needs: start order, health checks, mounts of the deploy files, ports, the scrape target.

(No Docker engine here: the stack is not started. test_deploy_live.py runs the same seed
script, server config, health checks and Prometheus config on loopback instead.)
"""

from __future__ import annotations

import yaml
from deploy_support import (
    CLIENT_DOCKERFILE,
    CLIENT_IMAGE,
    DEPLOY,
    ROOT,
    SERVER_DOCKERFILE,
    SERVER_IMAGE,
    compose_config,
    parse_dockerfile,
)
from tokenfeed.server.settings import config as configmod

SERVICES = {"minio", "seed", "tokenfeed", "prometheus", "grafana"}


def _service(name: str, *profiles: str) -> dict:
    return compose_config(*profiles)["services"][name]


def _binds(service: dict) -> dict[str, str]:
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "bind"}


def _depends(service: dict) -> dict[str, str]:
    return {name: d["condition"] for name, d in service.get("depends_on", {}).items()}


def test_compose_config_accepts_the_file():
    assert set(compose_config()["services"]) == SERVICES
    assert set(compose_config("trainer")["services"]) == SERVICES | {"trainer"}


def test_start_order_and_health_checks():
    assert _depends(_service("seed")) == {"minio": "service_healthy"}
    assert _depends(_service("tokenfeed")) == {
        "minio": "service_healthy",
        "seed": "service_completed_successfully",
    }
    assert _depends(_service("prometheus")) == {"tokenfeed": "service_healthy"}
    assert _depends(_service("grafana")) == {"prometheus": "service_healthy"}
    assert _depends(_service("trainer", "trainer")) == {"tokenfeed": "service_healthy"}
    # a service others wait for as healthy has a health check
    for name in ("minio", "tokenfeed", "prometheus"):
        assert _service(name)["healthcheck"]["test"][0] == "CMD", name
    assert _service("seed").get("restart", "no") == "no"


def test_images_are_pinned_and_built_from_the_dockerfiles():
    for name, service in compose_config("trainer")["services"].items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: {image}"
    for name in ("seed", "tokenfeed"):
        service = _service(name)
        assert service["image"] == SERVER_IMAGE
        assert service["build"]["context"] == str(ROOT)
        assert ROOT / service["build"]["dockerfile"] == SERVER_DOCKERFILE
    trainer = _service("trainer", "trainer")
    assert trainer["image"] == CLIENT_IMAGE
    assert ROOT / trainer["build"]["dockerfile"] == CLIENT_DOCKERFILE


def test_bind_mounts_exist_in_the_repository():
    for name, service in compose_config("trainer")["services"].items():
        for target, source in _binds(service).items():
            assert source.startswith(str(ROOT)), f"{name}: {source}"
            path = ROOT / source
            assert path.exists(), f"{name}: {target} <- {source} does not exist"


def test_tokenfeed_service_runs_the_deploy_config():
    tf = _service("tokenfeed")
    dockerfile = parse_dockerfile(SERVER_DOCKERFILE)
    (cmd,) = dockerfile.final("CMD")
    assert tf["command"] == cmd.json_args()
    config_path = tf["command"][tf["command"].index("--config") + 1]
    source = _binds(tf)[config_path]
    assert source == str(DEPLOY / "compose" / "tokenfeed.yaml")
    cfg = configmod.load(source)

    # the cache is the image's VOLUME, on a named volume
    volumes = {v["target"]: v for v in tf["volumes"]}
    (volume,) = dockerfile.final("VOLUME")
    assert cfg.server.cache_dir in yaml.safe_load(volume.args)
    assert volumes[cfg.server.cache_dir]["type"] == "volume"

    # ports: gRPC and metrics, as in the config and the image's EXPOSE
    listen = int(cfg.server.listen.rsplit(":", 1)[1])
    metrics = int(cfg.server.metrics_listen.rsplit(":", 1)[1])
    assert {p["target"] for p in tf["ports"]} == {listen, metrics}
    (expose,) = dockerfile.final("EXPOSE")
    assert {int(p) for p in expose.args.split()} == {listen, metrics}

    # S3 endpoint and credentials: MinIO's, through boto3's standard environment variables
    assert cfg.object_store.endpoint_url == "http://minio:9000"
    assert cfg.object_store.addressing_style == "path"
    env, minio = tf["environment"], _service("minio")["environment"]
    assert env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    # a drain fits in compose's stop timeout
    assert _seconds(tf["stop_grace_period"]) > cfg.server.grace_seconds


def test_seed_fills_the_bucket_the_server_reads():
    seed = _service("seed")
    cfg = configmod.load(DEPLOY / "compose" / "tokenfeed.yaml")
    bucket = seed["command"][seed["command"].index("--bucket") + 1]
    endpoint = seed["command"][seed["command"].index("--endpoint-url") + 1]
    assert endpoint == cfg.object_store.endpoint_url
    for job in cfg.jobs:
        assert job.tokenizer.path.startswith(f"s3://{bucket}/")
        for dataset in job.datasets:
            for source in dataset.sources:
                assert source.pattern.startswith(f"s3://{bucket}/"), source
    script = _binds(seed)["/seed/seed.py"]
    assert script == str(DEPLOY / "compose" / "seed.py")
    assert seed["entrypoint"] == ["python", "/seed/seed.py"]
    assert (
        seed["environment"]["AWS_ACCESS_KEY_ID"]
        == _service("minio")["environment"]["MINIO_ROOT_USER"]
    )


def test_prometheus_gets_its_config_and_rules_and_scrapes_the_server():
    prom = _service("prometheus")
    binds = _binds(prom)
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file"))
    assert binds[config_file] == str(DEPLOY / "prometheus" / "prometheus.yml")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config_dir = config_file.rsplit("/", 1)[0]
    for rule_file in scrape["rule_files"]:
        assert binds[f"{config_dir}/{rule_file}"] == str(DEPLOY / "prometheus" / rule_file)
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "tokenfeed"]
    (targets,) = job["static_configs"]
    cfg = configmod.load(DEPLOY / "compose" / "tokenfeed.yaml")
    port = cfg.server.metrics_listen.rsplit(":", 1)[1]
    assert targets["targets"] == [f"tokenfeed:{port}"]


def _seconds(value) -> float:
    if isinstance(value, (int, float)):
        return value / 1e9 if value > 1e6 else value  # compose may print nanoseconds
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    for suffix in sorted(units, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * units[suffix]
    return float(value)
