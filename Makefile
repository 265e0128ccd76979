# The two commands a newcomer needs: `make serve` and `make test` (see README.md).
# `make serve ARGS="--port 9000 --workers 2"` passes options to `sluice serve`.
# `make test-fast` runs the unit tests that need no model, no Redis and no compiler (about a minute).
#
# Both install into the project's own virtual environment, .venv (created with the system
# python3's venv module on first use), and run everything from it: the system Python is only
# used to create .venv and never gets a package installed. `rm -rf .venv` undoes the install.
# SYSTEM_PYTHON chooses the interpreter that creates it; VENV its location.
SYSTEM_PYTHON ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
SLUICE := $(VENV)/bin/sluice
EXTRAS ?= engine,gateway,test,bench
STAMP := $(VENV)/.installed

.PHONY: venv install serve test test-fast lint

venv: $(PYTHON)

$(PYTHON):
	@# Debian ships venv's ensurepip in its own package.
	@$(SYSTEM_PYTHON) -c 'import ensurepip, venv' 2>/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq python3-venv)
	$(SYSTEM_PYTHON) -m venv $(VENV)

# Installed again whenever pyproject.toml changes.
$(STAMP): pyproject.toml | $(PYTHON)
	@# gcc and g++ build the engine's native decode attention at first use; inductor (--no-enforce-eager) needs g++.
	@(command -v gcc && command -v g++) >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)
	# The CPU build of torch first, explicitly: any looser spec pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	$(SLUICE) serve $(ARGS)

test: install
	PYTHON=$(abspath $(PYTHON)) bash .ci/setup-docker.sh
	$(SLUICE) model prepare
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

# The markers are declared in pyproject.toml; tests/conftest.py fails the collection when a test
# reaches the model or Redis without its marker, and under SLUICE_TEST_TIER=fast takes the compiler
# away, so a test that builds native code without the `slow` marker fails here.
test-fast: install
	SLUICE_TEST_TIER=fast $(PYTHON) -m pytest -q -p no:cacheprovider tests/unit -m "not model and not redis and not slow"

# ruff from .venv once `make install` has run, else whichever ruff is on PATH (installs nothing).
lint:
	$(if $(wildcard $(VENV)/bin/ruff),$(VENV)/bin/ruff,ruff) check .
