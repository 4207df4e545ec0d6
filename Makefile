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
FASHION_OUT ?= demo-out-fashion
FASHION_DEBIAN := /usr/share/datasets/fashion-mnist
DATA_ROOT ?=

.PHONY: demo demo-fashion demo-fashion-tau fashion-data test test-quick docs install disk-check bench check-core check-floors clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(MAKE) -s disk-check
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# torch's Linux x86_64 wheels are CUDA builds: the first [dev] install puts ~5.6 GB into .venv. Said
# before it starts, since pip's own "No space left on device" comes from the middle of the install.
INSTALL_GB ?= 7
disk-check:
	@if ! ls -d $(VENV)/lib/python*/site-packages/torch >/dev/null 2>&1; then \
		free=$$(df -Pk $(VENV) | awk 'NR == 2 {print int($$4 / 1048576)}'); \
		if [ -n "$$free" ] && [ "$$free" -lt $(INSTALL_GB) ]; then \
			echo "warning: installing torch into $(VENV) needs about $(INSTALL_GB) GB (a CUDA build on Linux x86_64); $$free GB are free there. If pip stops with 'No space left on device', free some space (make clean removes .venv and the demo outputs) and rerun." >&2; \
		fi; \
	fi

# every test (CI's run: .ci/run), then the 15 slowest; test-quick leaves out those marked slow
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q --durations=15

test-quick: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q --durations=15 -m "not slow"

# the documentation site (mkdocs.yml) into site/, warnings as errors
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

demo: $(STAMP)
	$(VENV)/bin/repsim demo --out $(DEMO_OUT)

# The Fashion-MNIST study profile (< 1 hour on 2 cores). Data: DATA_ROOT=DIR, else the Debian package
# dataset-fashion-mnist (installed here when missing, if apt-get is usable and we are root), else the
# demo's error names every way to get it.
demo-fashion: $(STAMP) fashion-data
	$(VENV)/bin/repsim demo --profile fashion --out $(FASHION_OUT) $(if $(DATA_ROOT),--data-root $(DATA_ROOT))

# The temperature sweep (Table 4, Fig. 5b): cosine softmax at 5 temperatures × 2 seeds (28 min measured on an idle 2-core machine).
demo-fashion-tau: $(STAMP) fashion-data
	$(VENV)/bin/repsim demo --profile fashion-tau --out $(FASHION_OUT)-tau $(if $(DATA_ROOT),--data-root $(DATA_ROOT))

fashion-data:
	@if [ -n "$(DATA_ROOT)" ] || ls $(FASHION_DEBIAN)/train-images-idx3-ubyte* >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Fashion-MNIST: apt-get install -y dataset-fashion-mnist"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist \
			|| echo "Fashion-MNIST: could not install dataset-fashion-mnist (pass DATA_ROOT=DIR)"; \
	else echo "Fashion-MNIST: not in $(FASHION_DEBIAN) and cannot install dataset-fashion-mnist here (not root or no apt-get); pass DATA_ROOT=DIR"; fi

# the analysis core alone (`pip install .`, no torch) in a fresh venv: a few minutes; the suite's
# tests/test_install_split.py checks the same cheaply
check-core:
	PYTHON=$(PYTHON) bash tests/check_core_install.sh

# the suite at the oldest dependency releases pyproject.toml allows (uv --resolution lowest-direct; no torch)
check-floors:
	PYTHON=$(PYTHON) bash tests/check_floors.sh

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-core .pytest_cache .hypothesis $(DEMO_OUT) $(FASHION_OUT) site
