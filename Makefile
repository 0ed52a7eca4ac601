# Two set-up commands (README): `make demo` installs what the demo needs (torch and fxstab's own
# dependencies) and runs it; `make test` adds the test extra (Triton, transformers, Lightning,
# Chromium's client, ...: the large part of the environment) and tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 (CPU build) installs from this machine's disk; an unpinned torch pulls CUDA.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast install lint bench clean

# the runtime: torch, then fxstab and its dependencies (pyproject.toml's `dependencies`)
$(VENV)/.runtime: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e .
	touch $@

# the test extra on top of the runtime
$(VENV)/.installed: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.runtime
	$(VENV)/bin/fxstab demo

# The layer contract of pyproject.toml ([tool.importlinter]), on a copy of the tree laid out as
# the wheel installs it (triton_kernels/ as fxstab/kernels).
LAYOUT := build/layout
lint: $(VENV)/.installed
	rm -rf $(LAYOUT) && mkdir -p $(LAYOUT)
	cp -R fxstab $(LAYOUT)/fxstab && cp -R triton_kernels $(LAYOUT)/fxstab/kernels
	cd $(LAYOUT) && $(abspath $(VENV))/bin/lint-imports $(CURDIR)/pyproject.toml --no-cache

# Kernel tests run the Triton kernels on the CPU under the interpreter; skips print their
# reasons (-rs, pyproject.toml's addopts).
test: $(VENV)/.installed lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

# What a developer runs between edits: every test but those marked slow (tests/conftest.py
# marks them from measured durations), under 3 minutes on 2 cores; `make test` runs them all.
test-fast: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow"

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_rounding.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
