# One command to set up and run, one to test. Everything lives in ./.venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev

.PHONY: setup run test lint bench-cpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

# serve on loopback (CPU unless DEVICE=cuda), replay ../shared/data through the client, print /metrics;
# keeps serving until Ctrl-C (curl localhost:8000/metrics)
DEVICE ?= cpu
run: setup
	$(BIN)/mapper demo --device $(DEVICE) --data ../shared/data

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check mapper tests benchmarks
	$(BIN)/ruff format --check mapper tests benchmarks

bench-cpu: setup
	$(BIN)/python benchmarks/bench_topology.py --device cpu

clean:
	rm -rf $(VENV)
