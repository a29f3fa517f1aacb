# One command to set up and run, one to test. Everything lives in ./.venv.
# Two installs, each with its own stamp: the base (`make run`: the service, the client and the demo) and
# the dev/test extras on top (`make test`, `make lint`: pytest, ruff, open3d, ray, moto, playwright, ...).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
EXTRAS ?= dev

.PHONY: setup setup-base run test lint bench-cpu clean

$(BASE_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup-base: $(BASE_STAMP)
setup: $(STAMP)

# serve on loopback (CPU unless DEVICE=cuda), replay ../shared/data through the client, print /metrics;
# keeps serving until Ctrl-C (curl localhost:8000/metrics)
DEVICE ?= cpu
run: setup-base
	$(BIN)/mapper demo --device $(DEVICE) --data ../shared/data

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check mapper tests benchmarks
	$(BIN)/ruff format --check mapper tests benchmarks

bench-cpu: setup-base
	$(BIN)/python benchmarks/bench_topology.py --device cpu

clean:
	rm -rf $(VENV)
