# Two commands on a fresh machine with only python3: `make demo` and `make test`.
# Each creates .venv when missing and installs the package with [dev]; the install is
# skipped when a stamp keyed on pyproject.toml's hash says it is current.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
PYTEST_WORKERS ?= auto
DEMO_OUT ?= demo-out

.PHONY: demo test install bench check-core clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q

demo: $(STAMP)
	$(VENV)/bin/repsim demo --out $(DEMO_OUT)

# the analysis core alone (`pip install .`, no torch) in a fresh venv: a few minutes; the suite's
# tests/test_install_split.py checks the same cheaply
check-core:
	PYTHON=$(PYTHON) bash tests/check_core_install.sh

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-core .pytest_cache .hypothesis $(DEMO_OUT)
