# The two set-up commands of the README. Both create .venv on first use: `make run` installs the `run` extra
# (what the demo needs), `make test` the `dev` extra (that, the reference libraries, linters, docs, every extra)
# and, for its last step, .venv-sglang (the released SGLang beside Weir).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# the released SGLang's environment (see sglang-check below)
SGLANG_VENV := .venv-sglang

.PHONY: run test lint bench clean gpu-check gpu-check-rehearsal sglang-check extras-check docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

# dev includes run, so after `make test` this installs nothing new.
$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[run]'
	touch $(RUN_STAMP)

# The main job on embedded defaults: preprocess a generated media set (report), then start every
# role and train the demo's tiny Qwen3-VL (made in .weir/model when none is there) on the generated
# demo task in async mode (summary and plot).
run: $(RUN_STAMP)
	$(BIN)/weir demo --out .weir/demo
	$(BIN)/weir train --demo

test: $(STAMP) $(SGLANG_VENV)/.installed extras-check docs
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25  # CI prints the 25 slowest tests
	$(SGLANG_PYTEST)  # the modules that need the released SGLang, the real engine generating on the CPU

# The documentation site (mkdocs.yml: docs/, the README as its home page) into .weir/site; --strict makes a
# broken link to a page or an anchor, or a page missing from the nav, fail the build (the variable only
# silences mkdocs-material's end-of-life banner).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .weir/site

# Every extra must stay installable: pip resolves each from package metadata alone (no wheels, no GPU).
extras-check: $(STAMP)
	$(BIN)/python tests/check_extras.py

# Weir against the released SGLang (sglang 0.5.23 from PyPI) in an environment of its own: its request and
# argument classes against what Weir sends, and the real engine generating on the CPU under the test
# scaffolding of tests/engines/sglang_cpu.py (a stub libcuda.so.1, built with gcc). `make test` runs it too.
# The first run builds .venv-sglang (about 11 GB, 3 minutes here); later runs reuse it.
SGLANG_TESTS := tests/engines/test_sglang_backend.py tests/engines/test_sglang_installed.py tests/engines/test_sglang_real.py \
	tests/engines/test_sglang_real_server.py tests/engines/test_sglang_real_moe.py tests/engines/test_sglang_real_train.py \
	tests/engines/test_sglang_real_omni.py tests/engines/test_sglang_real_families.py
SGLANG_PYTEST = $(SGLANG_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider -m 'not gpu and not slow' $(SGLANG_TESTS)
$(SGLANG_VENV)/.installed: pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet -e '.[sglang]' 'pytest>=8.0'
	touch $@

sglang-check: $(SGLANG_VENV)/.installed
	$(SGLANG_PYTEST)

# Every `gpu`-marked check, on a machine with a CUDA GPU (one verdict line per check; see tests/gpu/run.sh).
gpu-check:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) tests/gpu/run.sh

# the same script on a machine without a GPU (make test runs it: tests/gpu/test_rehearsal.py)
gpu-check-rehearsal: $(STAMP)
	PYTHON=$(BIN)/python tests/gpu/run.sh --rehearse

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/bench_preprocess.py

clean:
	rm -rf .weir .pytest_cache .mypy_cache .ruff_cache
