# `make train` / `make test` work on a fresh machine: they create .venv when missing and
# install the package with its dev extras (torch pinned: the wheels on local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
ARGS ?=
PYTEST_ARGS ?=
# pytest processes (pytest-xdist; an idle one takes tests queued for the other: worksteal): the multi-process
# tests leave a core idle while they start interpreters and wait out timeouts, so two workers on 2 cores
# finish the suite sooner than one; TEST_WORKERS=0 runs it in pytest's own process, one test at a time
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist worksteal

.PHONY: install train test test-fast lint bench docs docs-serve docs-vendor clean

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

## lint (ruff, mypy), then the whole test suite: unit and multi-process (slow) tests; the unit tests
## build the documentation site strictly (tests/unit/test_docs_site.py)
test: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

## unit tests only
test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

## every benchmark in --quick mode (the full runs are on the results pages, docs/measured/); _*.py are their helper modules
bench: install
	for b in benchmarks/[!_]*.py; do $(PY) $$b --quick || exit 1; done

## the documentation site into site/ (strict: a broken link, image or API reference fails)
docs: install docs-vendor
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

## serve the site on http://127.0.0.1:8000, rebuilt on every save
docs-serve: install docs-vendor
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8000

## mermaid.min.js (pinned) from npm for offline diagrams; without npm the theme loads it from a CDN
MERMAID_VERSION := 11.17.2
MERMAID_JS := docs/javascripts/vendor/mermaid.min.js
docs-vendor:
	@test -f $(MERMAID_JS) || { command -v npm >/dev/null \
	  && tmp=$$(mktemp -d) && (cd $$tmp && npm pack -q mermaid@$(MERMAID_VERSION) >/dev/null && tar xzf mermaid-*.tgz) \
	  && mkdir -p $(dir $(MERMAID_JS)) && cp $$tmp/package/dist/mermaid.min.js $(MERMAID_JS) && rm -rf $$tmp; } \
	  || echo "docs-vendor: no npm: the site's diagrams load mermaid from a CDN"

clean:
	rm -rf $(VENV) outputs multirun lightning_logs .pytest_cache .mypy_cache .ruff_cache site
