# `make demo` and `make test` work on a fresh machine with Python 3.11+:
# they create .venv, install what they need, and run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUM    := $(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# The package alone (numpy, msgspec, rich, ml_dtypes): enough for the demo.
BASE   := $(VENV)/.base-$(SUM)
# Everything the tests cover (torch, ucxx, Ray: about 1.5 GB).
STAMP  := $(VENV)/.installed-$(SUM)

.PHONY: setup demo test test-fast lint bench bench-emulated clean

$(BASE):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	rm -f $(VENV)/.base-*
	touch $@

$(STAMP): $(BASE)
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	@# CPU torch lets the tests cover torch tensors; they skip if it cannot be installed.
	$(BIN)/python -m pip install -q 'torch==2.13.0' || echo "torch not installed: torch tests will skip"
	@# UCX (ucxx) runs the UCX transport's tests; they skip if it cannot be installed.
	$(BIN)/python -m pip install -q -e '.[ucx]' || echo "ucxx not installed: UCX tests will skip"
	@# Ray runs the Ray integration tests and examples; they skip if it cannot be installed.
	$(BIN)/python -m pip install -q 'ray>=2.40' || echo "ray not installed: Ray tests will skip"
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

demo: $(BASE)
	$(BIN)/hoplite-gpu demo

RUNTIME_TESTS := tests/test_api.py tests/test_broadcast.py tests/test_reduce.py \
	tests/test_channel.py tests/test_store.py tests/test_auth.py tests/test_liveness.py
# The data path's own tests, run again in TLS and over UCX (the rest of
# RUNTIME_TESTS run in the passes before, and every transport runs the
# conformance suite).
CORE_TESTS := tests/test_api.py tests/test_broadcast.py tests/test_reduce.py

# The default set: everything but the slow emulation and benchmark runs
# (marked `slow`: end-to-end launches of the benchmarks on emulated hosts,
# 256 MiB transfers on every transport), which `make test-slow` runs.
test: setup
	$(BIN)/python -m pytest -q -m "not slow"
	@# Nodes of one machine pull through shared memory by default; the runtime's
	@# tests again with it off, so their bytes cross the transports: TCP, then
	@# UCX where ucxx is installed (UCX over TCP here; README "Tests and benchmarks").
	@echo "== again with HOPLITE_SHARED_MEMORY=0 (bytes over TCP)"
	HOPLITE_SHARED_MEMORY=0 $(BIN)/python -m pytest -q $(RUNTIME_TESTS) tests/test_chaos.py
	@echo "== the core tests in TLS (TEST_IN_TLS=1: a CA made for the run; bytes over TCP)"
	TEST_IN_TLS=1 HOPLITE_SHARED_MEMORY=0 $(BIN)/python -m pytest -q $(CORE_TESTS)
	@if $(BIN)/python -c "import ucxx" 2>/dev/null; then \
	    echo "== again with HOPLITE_TRANSPORT=ucx HOPLITE_SHARED_MEMORY=0"; \
	    HOPLITE_TRANSPORT=ucx HOPLITE_SHARED_MEMORY=0 $(BIN)/python -m pytest -q -m "not slow" $(CORE_TESTS) && \
	    echo "== shared memory beside UCX" && \
	    HOPLITE_TRANSPORT=ucx $(BIN)/python -m pytest -q tests/test_shm.py; \
	else echo "ucxx not installed: the UCX pass is skipped"; fi

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-all: test test-slow

lint: setup
	$(BIN)/ruff check hoplite_gpu kernels transports tests benchmarks

bench: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks broadcast
	$(BIN)/python -m benchmarks plot

bench-emulated: setup
	$(BIN)/python -m pip install -q -e '.[bench]' 'torch==2.13.0'
	$(BIN)/python -m benchmarks emulated
	$(BIN)/python -m benchmarks plot

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
