# kvrelay: `make setup`, `make test`, `make demo`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvrelay-setup
SETUP_INPUTS := pyproject.toml Makefile scripts/setup-venv.sh

.PHONY: setup system-packages test test-fast test-vllm-033 lint typecheck check-vllm demo up \
	bench-pull harnesses clean

## The router's component tests whose engines are fake vLLM ones (the others use a mock;
## test_router_fake_versions.py names its versions itself, test_router_security_reports.py
## pins 0.32): `make test` runs them once more with the fakes speaking vLLM 0.33's protocol
## (tests/component/fake_vllm_version.py).
ROUTER_FAKE_TESTS := $(filter-out $(addprefix tests/component/test_router_,fake_versions.py \
	security_reports.py decisions.py failures.py fuzz.py mock_turns.py), \
	$(wildcard tests/component/test_router_*.py))
VLLM_033 := KVRELAY_FAKE_VLLM_VERSION=0.33 $(PY) -m pytest -q $(ROUTER_FAKE_TESTS)

## The venv (rebuilt when its inputs change) and the Debian packages the tests need (checked
## every time: the venv's stamp says nothing about packages removed since).
setup: system-packages $(STAMP)

system-packages:
	@bash scripts/setup-system.sh

$(STAMP): $(SETUP_INPUTS)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh
	@touch $(STAMP)

## The whole suite: unit, component and e2e (real vLLM P/D cluster, started once), then the
## router's component tests against fake vLLM 0.33 engines.
test: setup
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -q tests
	$(VLLM_033)

## Everything except the real-cluster tests.
test-fast: setup
	$(PY) -m pytest -q tests -m "not e2e"
	$(VLLM_033)

## Only the router's component tests against fake vLLM 0.33 engines.
test-vllm-033: setup
	$(VLLM_033)

lint: setup
	$(PY) -m ruff check src tests

typecheck: setup
	$(PY) -m mypy

## kvrelay's connector contract against one vLLM release, read from its PyPI wheel (downloaded
## once into ~/.cache/kvrelay/vllm-wheels, or $$KVRELAY_VLLM_WHEELS; docs/vllm-versions.md).
## `make test` checks every wheel already there.
check-vllm: setup
	@test -n "$(VERSION)" || { echo "usage: make check-vllm VERSION=0.33.0" >&2; exit 2; }
	$(PY) -m kvrelay.vllm_plugin.contract --version $(VERSION)

demo: setup
	$(VENV)/bin/kvrelay demo $(DEMO_ARGS)

up: setup
	$(VENV)/bin/kvrelay up --prefill 1 --decode 1

## Turn-2 TTFT, pull vs recompute, on the real cluster (see docs/cpu-notes.md).
bench-pull: setup
	$(PY) scripts/bench_pull.py

## Codex CLI and Claude Code (from npm) in 3-turn sessions against `kvrelay up` (real vLLM,
## minutes; not part of `make test`): per-turn decisions and pulled tokens (docs/router.md,
## "The harnesses, measured").
harnesses: setup
	flock /tmp/kvrelay-vllm.lock $(PY) scripts/run_agent_harnesses.py $(HARNESS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
