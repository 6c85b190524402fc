# tokenfeed developer entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv with every dependency pinned in constraints.txt, then do their job.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The server's C extensions (setup.py), rebuilt in place when their sources change.
NATIVE := $(VENV)/.native

.PHONY: env tools demo test test-unit check lint types protos config-docs bench bench-quick clean

env: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml client/pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ./client -e '.[dev,trainers]'
	# MDSWriter for the tests, without the dependencies it declares (tests/formats.py says why).
	$(PY) -m pip install --quiet --no-deps -c constraints.txt mosaicml-streaming
	touch $(STAMP)

$(NATIVE): $(STAMP) setup.py server/tokenfeed/server/pack/_gather.c \
		server/tokenfeed/server/pack/_rowmessages.c server/tokenfeed/server/pack/_buffers.h \
		server/tokenfeed/server/sampling/_feistel.c
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@$(PY) -c "from tokenfeed.server.pack import gather as g; g.NATIVE or print('warning: \
	no C compiler, so no tokenfeed.server.pack._gather: serving copies with numpy (slower)')"
	touch $(NATIVE)

demo: env
	$(PY) -m tokenfeed.server.commands.demo

# External tools for the deploy tests (promtool, docker compose, chromium) into .tools/.
tools:
	bash scripts/install_tools.sh

# Lint, the format check and the types first: CI runs this target, so it enforces them.
test: env tools lint types
	$(PY) -m pytest -q

# The unit tests alone: pure functions and in-process objects, no servers, tools or root.
test-unit: env
	$(PY) -m pytest -q tests/unit

lint: env
	$(VENV)/bin/ruff check server client/tokenfeed/client tests bench scripts
	$(VENV)/bin/ruff format --check server client/tokenfeed/client tests bench scripts

# mypy over the server and client packages; what it checks, and how strictly, is in
# pyproject.toml ([tool.mypy]).
types: env
	$(VENV)/bin/mypy

check: test

protos: env
	$(PY) scripts/gen_protos.py

# The reference tables of docs/configuration.md, from the options' declarations
# (server/tokenfeed/server/settings/options.py); tests/unit/test_options.py checks them.
config-docs: env
	$(PY) -m tokenfeed.server.settings.configdocs docs/configuration.md

bench: env
	$(PY) -m bench.run

bench-quick: env
	$(PY) -m bench.run --quick

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache build *.egg-info */*.egg-info
