# syntax=docker/dockerfile:1
# tokenfeed server image. Build from the repository root:
#   docker build -f deploy/docker/server.Dockerfile -t tokenfeed/server:0.1.0 .
# Run:
#   docker run -v $PWD/config.yaml:/etc/tokenfeed/config.yaml:ro -p 50051:50051 -p 9100:9100 \
#     tokenfeed/server:0.1.0
# Credentials for s3:// sources come from boto3's standard chain (AWS_ACCESS_KEY_ID /
# AWS_SECRET_ACCESS_KEY, a mounted shared credentials file, or the pod's role): never baked in.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: a self-contained venv
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler for the server's extensions (tokenfeed.server.pack._gather: serving's range
# copies with the GIL released; pack._rowmessages: a stream's messages made with their rows
# copied into them; tokenfeed.server.sampling._feistel: the sample order's Feistel network); it
# stays in this stage, the runtime image gets the built venv.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY client/ client/
COPY server/ server/
# The same command as a developer's install: exact versions from constraints.txt. Every
# dependency ships manylinux wheels for amd64 and arm64; the check fails the build if the
# extensions were not built (the server would run their numpy twins instead, slower).
RUN python -m venv /opt/tokenfeed \
 && /opt/tokenfeed/bin/pip install -c constraints.txt ./client . \
 && /opt/tokenfeed/bin/tokenfeed --help >/dev/null \
 && /opt/tokenfeed/bin/python -c "from tokenfeed.server.pack import gather; assert gather.NATIVE" \
 && /opt/tokenfeed/bin/python -c "from tokenfeed.server.pack import rowmessages as m; assert m.NATIVE" \
 && /opt/tokenfeed/bin/python -c "from tokenfeed.server.sampling import _feistel"

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tokenfeed server" \
      org.opencontainers.image.description="Deterministic token batches over gRPC for LLM pre-training"
RUN groupadd --system --gid 10001 tokenfeed \
 && useradd --system --uid 10001 --gid tokenfeed --home-dir /var/cache/tokenfeed \
      --no-create-home --shell /usr/sbin/nologin tokenfeed \
 && mkdir -p /var/cache/tokenfeed /etc/tokenfeed \
 && chown tokenfeed:tokenfeed /var/cache/tokenfeed
COPY --from=build /opt/tokenfeed /opt/tokenfeed
ENV PATH=/opt/tokenfeed/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=true \
    TOKENFEED_HEALTH_TARGET=127.0.0.1:50051

USER 10001:10001
WORKDIR /var/cache/tokenfeed
# The disk cache (raw blocks and the token store): a volume, so it survives a new container
# and never lands in the image's writable layer. Point server.cache_dir here.
VOLUME ["/var/cache/tokenfeed"]
# 50051: gRPC (server.listen); 9100: Prometheus /metrics and the status page
# (server.metrics_listen).
EXPOSE 50051 9100

# The standard gRPC health service, service "tokenfeed.v1.TokenFeed": SERVING (exit 0) once
# every job can serve its first step; NOT_SERVING (exit 1) before that and while the server drains
# after SIGTERM; no answer (exit 1) when it is down. A corpus whose first windows take longer than
# the start period to tokenize shows "unhealthy" until they are built (docker run --health-start-period).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; channel = grpc.insecure_channel(os.environ.get('TOKENFEED_HEALTH_TARGET', '127.0.0.1:50051')); reply = g.HealthStub(channel).Check(h.HealthCheckRequest(service='tokenfeed.v1.TokenFeed'), timeout=4); sys.exit(0 if reply.status == h.HealthCheckResponse.SERVING else 1)"]

# SIGTERM drains: health turns NOT_SERVING, in-flight calls get server.grace_seconds, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenfeed"]
CMD ["serve", "--config", "/etc/tokenfeed/config.yaml"]
