# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs pinned dependencies first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 takes the local CPU build; a looser range may pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint typecheck pytest demo bench fuzz faults torture clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

lint: venv
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

typecheck: venv
	$(VENV)/bin/mypy src/stalwart

pytest: venv
	$(PY) -m pytest -q --durations=20

test: lint typecheck pytest

demo: venv
	$(PY) examples/demo.py

bench: venv
	$(PY) benchmarks/run.py

# Hostile run directories, fuzzed long: FUZZ_EXAMPLES cases per class (the normal
# test run does a few). Prints cases per class and damage, and their outcomes.
FUZZ_EXAMPLES ?= 1000
fuzz: venv
	STALWART_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s --timeout=0 \
		-p no:cacheprovider tests/hostile/test_fuzz.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache

# Every file-system call of a save, an async save, a durable upload and a restore,
# failed with each of ENOSPC, EIO, EDQUOT and EROFS (the test suite runs a subset).
faults: venv
	FAULTS_ALL=1 $(PY) -m pytest -q -s --timeout=3600 tests/faults/test_syscall_faults.py tests/faults/test_crash_states.py

# 1000 SIGKILLs at random instants of sync, async, uploading and 2-rank saves,
# each resume checked against the state of its step; prints a table per phase hit.
torture: venv
	mkdir -p runs
	$(PY) tests/faults/torture.py --trials 1000 --json runs/torture.json
