# The two set-up commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The main job on embedded defaults: preprocess a generated media set (report), then start every
# role, send a rollout request (image, video, audio; n=4) and an OpenAI chat completion, and stop.
run: $(STAMP)
	$(BIN)/weir demo --out .weir/demo
	$(BIN)/weir up --demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/bench_preprocess.py

clean:
	rm -rf .weir .pytest_cache .mypy_cache .ruff_cache
