# The two commands that matter: `make run` and `make test`. Only Python 3.11+ is needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt | cksum | cut -d' ' -f1)
PORT ?= 8000
SANDBOX_PORT ?= 8100
# The gateway's address: loopback, since development's ops and merchant tokens are public. BIND=0.0.0.0 to serve others.
BIND ?= 127.0.0.1
# Where a browser on this machine reaches it (every address includes loopback).
BIND_URL_HOST = $(if $(filter 0.0.0.0 ::,$(BIND)),127.0.0.1,$(BIND))
# `make run` is for a developer's machine: development fills in dev tokens and secrets, and says so once.
PAYSYNC_ENV ?= development

.PHONY: run test test-fast test-serial lint format venv import-graph settings-reference chaos bench bench-charts bench-ingest bench-drain bench-charges bench-charge-parts bench-events bench-reconcile clean

$(STAMP): requirements.txt requirements-dev.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "paysync needs Python 3.11 or newer")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: venv
	@mkdir -p var
	@PAYSYNC_ENV=$(PAYSYNC_ENV) $(BIN)/python -m payments init-db
	@echo ""
	@echo "  gateway  http://$(BIND_URL_HOST):$(PORT)   (listening on $(BIND); POST /callbacks/sandbox, POST /payments, GET /readyz)"
	@echo "  console  http://$(BIND_URL_HOST):$(PORT)/ops/   (log in with $$(if [ -n "$$OPS_TOKEN" ]; then echo your OPS_TOKEN; else echo "the development OPS_TOKEN: dev-ops-token"; fi))"
	@echo "  sandbox  http://127.0.0.1:$(SANDBOX_PORT)   (the simulated payment platform; calls back to :$(PORT))"
	@echo "  database $${DATABASE_URL:-sqlite:///var/paysync.db}   broker $${AMQP_URL:-none (the compensator sweeps every second)}"
	@echo ""
	PATH="$(CURDIR)/$(BIN):$$PATH" PAYSYNC_ENV=$(PAYSYNC_ENV) WEB_BIND_ADDRESS=$(BIND) SANDBOX_PORT=$(SANDBOX_PORT) \
	  SANDBOX_API_URL="$${SANDBOX_API_URL:-http://127.0.0.1:$(SANDBOX_PORT)}" \
	  SANDBOX_CALLBACK_URL="$${SANDBOX_CALLBACK_URL:-http://127.0.0.1:$(PORT)/callbacks/sandbox}" \
	  $(BIN)/honcho start -p $(PORT)

# Compiled bytecode kept under the venv even where the environment says PYTHONDONTWRITEBYTECODE: without it every
# pytest worker re-compiles and re-rewrites every test module (10 s of CPU each) and every process a test starts
# compiles paysync anew.
PYCACHE := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache

# The suite in parallel: TEST_WORKERS processes (xdist), each with its own MariaDB database, RabbitMQ vhost and
# ports; the whole-stack runs start first (tests/conftest.py). Then the coverage table and its floors.
TEST_WORKERS ?= 6
COVERAGE_ARGS ?= --cov --cov-report= --no-cov-on-fail
test: venv
	@rm -f .coverage .coverage.*
	$(PYCACHE) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=25 $(COVERAGE_ARGS) $(PYTEST_ARGS)
	$(BIN)/python -m tests.coverage_floor

# The tests that need no service and start no process: state machine, signatures, parsers, matching, settings,
# the scrubber, property tests at fewer examples. For the edit-test loop; `make test` before a commit.
test-fast: venv
	$(PYCACHE) HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -m fast -n 2 $(PYTEST_ARGS)

# One process, in collection order: to read a failure without xdist in the way.
test-serial: venv
	$(PYCACHE) $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Which of our packages imports which; fails on an edge the design does not allow (tests/import_graph.py).
import-graph: venv
	$(BIN)/python -m tests.import_graph

# docs/reference/settings.md from the field docs in payments/infra/settings.py (tests/test_settings_reference.py checks it).
settings-reference: venv
	$(BIN)/python -m payments settings-reference

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The full-stack fault run on a private MariaDB and RabbitMQ (needs mariadb-server and rabbitmq-server
# installed, not running). E.g. CHAOS_ARGS="--payments 1000 --json-out bench/results/chaos.json".
chaos: venv
	$(BIN)/python bench/chaos.py $(CHAOS_ARGS)

# Every benchmark with the same settings, its JSON in bench/results/, then the PNG charts BENCHMARKS.md shows
# (bench/run_all.py). Needs MariaDB, RabbitMQ, wrk, and mariadb-server + rabbitmq-server installed for the chaos
# run. BENCH_QUICK=1: all of them small, under 5 minutes.
bench: venv
	@command -v wrk >/dev/null || { echo "make bench needs wrk: sudo apt-get install -y wrk"; exit 2; }
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/python bench/run_all.py $(BENCH_ARGS)

# Redraw the charts from bench/results/*.json without measuring again.
bench-charts: venv
	$(BIN)/python bench/charts.py

# Needs MariaDB, RabbitMQ and wrk (sudo apt-get install -y wrk). E.g. BENCH_ARGS="--duration 5 --repeats 1".
bench-ingest: venv
	@command -v wrk >/dev/null || { echo "bench-ingest needs wrk: sudo apt-get install -y wrk"; exit 2; }
	$(BIN)/python bench/ingest.py $(BENCH_ARGS)

# Needs MariaDB and RabbitMQ. A quick run: BENCH_ARGS="--rows 2000".
bench-drain: venv
	$(BIN)/python bench/drain.py $(BENCH_ARGS)

# Needs MariaDB and wrk. E.g. BENCH_ARGS="--repeats 3 --before-tree /tmp/before".
bench-charge-parts: venv
	@command -v wrk >/dev/null || { echo "bench-charge-parts needs wrk: sudo apt-get install -y wrk"; exit 2; }
	$(BIN)/python bench/charge_parts.py $(BENCH_ARGS)

bench-events: venv
	$(BIN)/python bench/events.py $(BENCH_ARGS)

bench-charges: venv
	$(BIN)/python bench/charges.py $(BENCH_ARGS)

# Needs MariaDB. A quick run: BENCH_ARGS="--sizes 10000,100000".
bench-reconcile: venv
	$(BIN)/python bench/reconcile.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
