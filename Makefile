# The two commands a newcomer needs: `make serve` and `make test` (see README.md).
# `make serve ARGS="--port 9000 --workers 2"` passes options to `sluice serve`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install serve test lint

install:
	# The CPU build of torch first, explicitly: any looser spec pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[engine,gateway,test]'

serve: install
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	$(PYTHON) -m sluice_cli.cli serve $(ARGS)

test: install
	bash .ci/setup-docker.sh
	$(PYTHON) -m sluice_cli.cli model prepare
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

lint:
	ruff check .
