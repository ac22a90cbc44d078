# The two set-up commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The main job on embedded defaults: preprocess a generated media set (report), then start every
# role and train the embedded model on the generated demo task in async mode (summary and plot).
run: $(STAMP)
	$(BIN)/weir demo --out .weir/demo
	$(BIN)/weir train --demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# Every `gpu`-marked check, on a machine with a CUDA GPU (one verdict line per check; see tests/gpu/run.sh).
gpu-check:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) tests/gpu/run.sh

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/bench_preprocess.py

clean:
	rm -rf .weir .pytest_cache .mypy_cache .ruff_cache
