# Every target sets up what it needs in ./.venv first (idempotent), so each is one command on a
# fresh machine with Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-e2e
FAST_STAMP := $(VENV)/.installed-dev
# tests/test_llamacpp*.py's servers: llama-cpp-python and xllamacpp (llama.cpp's own server; the
# `llamacpp` extra in pyproject.toml) in a venv of their own, so .venv stays as it is.
LLAMA_VENV := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.installed-llamacpp
# PyPI has no Linux wheel of llama-cpp-python: pip builds llama.cpp from the sdist (~4 min on 2
# idle cores; 406 CPU s measured). Only what the Python package loads: no multimodal library
# (LLAVA_BUILD), no OpenMP, a portable AVX2 build rather than -march=native. llama.cpp's tests,
# examples, tools and its own server are off anyway when it is built as a subproject; said here
# so that stays true.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF -DGGML_NATIVE=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

.PHONY: setup demo test test-fast test-llamacpp lint bench bench-quick

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

# --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS, so a wheel built with other flags could
# be reused; a failed build stops make with pip's build log. xllamacpp comes as PyPI's wheel
# only (--only-binary: no second source build of llama.cpp, ~5 s).
$(LLAMA_STAMP): pyproject.toml
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q -U pip
	$(LLAMA_VENV)/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['llamacpp']))" > $(LLAMA_VENV)/requirements.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMA_VENV)/bin/pip install -q --no-cache-dir --no-binary llama-cpp-python \
		--only-binary xllamacpp -r $(LLAMA_VENV)/requirements.txt
	$(LLAMA_VENV)/bin/python -c "import llama_cpp.server, xllamacpp, gguf, numpy"
	touch $(LLAMA_STAMP)

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

## The openai kind in front of two real llama.cpp servers (llama-cpp-python's, built into
## .venv-llama the first time, and llama.cpp's own through xllamacpp's wheel): fails, never
## skips, if that interpreter cannot serve.
test-llamacpp: $(FAST_STAMP) $(LLAMA_STAMP)
	CANCEL_SIDECAR_LLAMA_PYTHON=$(abspath $(LLAMA_VENV))/bin/python $(BIN)/python -m pytest tests/test_llamacpp.py tests/test_llamacpp_native.py

## Direct vs cancel-sidecar vs nginx on a fast fake engine (and the real-vLLM waste figure):
## regenerates docs/benchmarks.md and docs/benchmarks.png. Needs nginx (Debian: nginx-light).
bench: $(STAMP)
	$(BIN)/python -m bench

## The same at tiny sizes (~30 s) into a temp dir: proves the command works; numbers mean nothing.
bench-quick: $(STAMP)
	$(BIN)/python -m bench --quick

lint: $(STAMP)
	$(BIN)/ruff check sidecar engine tests demo bench tools
	$(BIN)/mypy
	$(BIN)/python -m tools.check_tasks sidecar engine
	$(BIN)/hadolint Dockerfile
