# `make train` / `make test` work on a fresh machine: they create .venv when missing and
# install the package with its dev extras (torch pinned: the wheels on local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install train test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e ".[dev]" $(TORCH_PINS)
	touch $(STAMP)

install: $(STAMP)

## python train.py with the default config (digits recipe); ARGS="trainer=ddp_sim" to override
train: install
	$(PY) train.py $(ARGS)

## lint (ruff, mypy), then the whole test suite: unit and multi-process (slow) tests
test: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_ARGS)

## unit tests only
test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

## every benchmark in --quick mode (the full runs are in README); _*.py are their helper modules
bench: install
	for b in benchmarks/[!_]*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun lightning_logs .pytest_cache .mypy_cache .ruff_cache
