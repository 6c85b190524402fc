# syntax=docker/dockerfile:1
# tokenfeed-client image: the trainer side only (grpcio, protobuf, numpy; no server, tokenizer
# or storage libraries). A base for trainer images, or a smoke-test client:
#   docker build -f deploy/docker/client.Dockerfile -t tokenfeed/client:0.1.0 .
#   docker run --rm tokenfeed/client:0.1.0 -c "from tokenfeed.client import Client; \
#     print(Client('tokenfeed:50051', job='demo').describe())"
# A trainer image usually installs the client into its own environment instead:
#   pip install -c constraints.txt ./client

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
COPY client/ client/
RUN python -m venv /opt/tokenfeed-client \
 && /opt/tokenfeed-client/bin/pip install -c constraints.txt ./client \
 && /opt/tokenfeed-client/bin/python -c "import tokenfeed.client"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tokenfeed client" \
      org.opencontainers.image.description="tokenfeed-client: token batches as numpy arrays"
RUN groupadd --system --gid 10001 trainer \
 && useradd --system --uid 10001 --gid trainer --create-home --shell /usr/sbin/nologin trainer
COPY --from=build /opt/tokenfeed-client /opt/tokenfeed-client
ENV PATH=/opt/tokenfeed-client/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/trainer
ENTRYPOINT ["python"]
CMD ["-c", "import importlib.metadata as m; print('tokenfeed-client', m.version('tokenfeed-client'))"]
