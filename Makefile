# Every target sets up what it needs in ./.venv first (idempotent), so each is one command on a
# fresh machine with Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-e2e
FAST_STAMP := $(VENV)/.installed-dev

.PHONY: setup demo test test-fast lint bench bench-quick

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev,e2e,bench]'
	# PyPI's torchvision/torchaudio/torchcodec do not load beside the CPU torch and break
	# transformers imports; vLLM serves text models without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP) $(FAST_STAMP)

# Without vLLM (~3.5 GB): enough for test-fast. A full install ($(STAMP)) also satisfies it.
$(FAST_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(FAST_STAMP)

setup: $(STAMP)

## The main job, end to end: tiny real vLLM (with a disconnect-hiding middleware), the sidecar in
## front, a client that disconnects; prints tokens generated after the disconnect, with and
## without the sidecar.
demo: $(STAMP)
	$(BIN)/python -m demo

## All tests: unit, integration (fake engine) and e2e (real vLLM engine).
test: $(STAMP)
	$(BIN)/python -m pytest tests

## Without the real engine, and without installing vLLM.
test-fast: $(FAST_STAMP)
	$(BIN)/python -m pytest tests -m "not e2e"

## Direct vs cancel-sidecar vs nginx on a fast fake engine (and the real-vLLM waste figure):
## regenerates docs/benchmarks.md and docs/benchmarks.png. Needs nginx (Debian: nginx-light).
bench: $(STAMP)
	$(BIN)/python -m bench

## The same at tiny sizes (~30 s) into a temp dir: proves the command works; numbers mean nothing.
bench-quick: $(STAMP)
	$(BIN)/python -m bench --quick

lint: $(STAMP)
	$(BIN)/ruff check sidecar engine tests demo bench
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile
