# The two commands of the README:
#   make demo   runs notebooks/quickstart.ipynb headlessly (%%elastic --nproc 4 on CPU) and prints its outputs
#   make test   runs the whole test suite
# and the inner loop, after each change:
#   make test-fast  the unit tests and the core end-to-end tests (what `make floors` runs too)
#   make floors runs a smoke subset on the oldest versions pyproject.toml claims (CI runs it too)
#   make docs   builds the docs site (docs/_build/html), its notebooks run (CI runs it too)
# The first two create .venv on first use. TORCH is what pip installs when the venv has no torch: pinned
# (the project's machines serve its CPU build; never let pip resolve an unpinned torch: from PyPI
# that is a multi-GB CUDA download, as this pin is there too).

PYTHON   ?= python3
VENV     ?= .venv
TORCH    ?= torch==2.13.0
CHROMIUM ?= /usr/bin/chromium
BIN      := $(VENV)/bin
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-fast docs bench floors node netns-tools gpu-wheels gpu-check

$(VENV)/.installed: pyproject.toml labextension/package.json labextension/yarn.lock | node
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python scripts/run_notebook.py notebooks/quickstart.ipynb

# The JupyterLab extension the browser tests load is built from this tree: pip builds it once (and
# `pip install -e .` only when the venv is made); after a change under labextension/ it is built
# again here, or the browser tests would pass against a stale build (tests/lab.py refuses one).
# Defined before `test:`, whose prerequisites make expands as it reads them: below it,
# $(LABEXT_BUILD) was empty there and the extension was never rebuilt.
LABEXT_SRC   := $(shell find labextension/src labextension/style labextension/schema -type f) \
                labextension/package.json labextension/tsconfig.json
LABEXT_BUILD := elastic_nb/labextension/package.json
$(LABEXT_BUILD): $(LABEXT_SRC) | $(VENV)/.installed
	cd labextension && export PATH="$(CURDIR)/$(BIN):$$PATH" && jlpm install && jlpm build
	touch $@

# The suite runs on JOBS workers (pytest-xdist), a module's tests on one worker with its kernel:
# most tests wait (for a kernel, a rank, a timeout) far more than they compute, so more workers
# than cores. Then the tests marked `alone` (they hold a wall-clock bound that a loaded machine
# would break, or measure load themselves) one at a time. $(call suite,PYTHON,SELECTION,ARGS)
# runs both parts whatever the other did, and fails if either failed (a part with no test in the
# selection is no failure, but the whole selection must have some).
JOBS  ?= 4
suite  = $(1) -m pytest -n $(JOBS) -m "($(2)) and not alone" $(3); parallel=$$?; \
	$(1) -m pytest -m "($(2)) and alone" $(3); alone=$$?; \
	[ $$parallel = 0 ] && [ $$alone = 0 ] || { [ $$parallel = 0 ] && [ $$alone = 5 ]; } || \
	{ [ $$parallel = 5 ] && [ $$alone = 0 ]; }
PYTHON_TESTS := ELASTIC_NB_CHROMIUM=$(CHROMIUM) $(BIN)/python
EVERY_TEST   := unit or e2e or browser# every test is of one kind (tests/conftest.py)

test: $(VENV)/.installed $(LABEXT_BUILD) $(CHROMIUM) | netns-tools
	$(BIN)/ruff check elastic_nb tests scripts benchmarks docs
	$(BIN)/mypy
	$(call suite,$(PYTHON_TESTS),$(EVERY_TEST))

# The inner loop, after each change (within 2 minutes here): the unit tests and the core end-to-end
# tests, the selection `make floors` runs on the floors, but for the `alone` ones (their bounds are
# make test's to check: here they would wait for the workers to end).
test-fast: $(VENV)/.installed | netns-tools
	$(BIN)/ruff check elastic_nb tests scripts benchmarks docs
	$(PYTHON_TESTS) -m pytest -n $(JOBS) -m "($(FLOORS_TESTS)) and not alone"

# The docs site into docs/_build/html, offline: every notebook of the tutorials runs (on CPU), and
# any warning (a broken link, a cell that raises untagged, a docstring autodoc cannot read) fails it.
docs: $(VENV)/.installed
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

# pip builds the JupyterLab extension (labextension/, with jupyter-builder's jlpm) and needs node for
# it: Debian's nodejs when there is none. (A wheel carries the built extension: installing one
# needs no node.)
node:
	@command -v node >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs; }

# tests/test_loopback.py gives this machine a second address (a veth into a network namespace,
# root only, as CI runs) and a kernel a hostname of its own: iproute2's ip and util-linux's unshare.
netns-tools:
	@command -v ip >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux; }

# The browser tests drive Debian's Chromium (Playwright's own download does not work here).
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/run_all.py --readme

# The declared floors: every dependency of pyproject.toml at its lowest version (scripts/floors.py
# reads them), torch included (2.11: PyPI has only its CUDA build, about 4.6 GB installed, which
# runs on a CPU), and the suite's unit tests and core e2e tests on them (pytest markers: see
# pyproject.toml).
FLOORS       ?= .venv-floors
FLOORS_TESTS := unit or core

# On torch 2.11, gloo can crash (SIGSEGV) when one rank's barrier meets another's all_reduce,
# before the desync watch has looked (seen once in three runs here); 2.13 waits, as the test expects.
FLOORS_SKIP  := tests/test_forensics.py::test_a_rank_that_skipped_into_a_barrier_is_named_within_seconds \
                tests/test_server_extension.py::test_the_config_file_enables_the_extension

floors: $(FLOORS)/.installed
	$(call suite,$(FLOORS)/bin/python,$(FLOORS_TESTS),-p no:cacheprovider $(FLOORS_SKIP:%=--deselect %))

# playwright: the browser test modules import it when collected (-m leaves them out).
$(FLOORS)/.installed: pyproject.toml scripts/floors.py | node
	$(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install -q --upgrade pip
	$(FLOORS)/bin/python scripts/floors.py > $(FLOORS)/constraints.txt
	$(FLOORS)/bin/python -m pip install -q -c $(FLOORS)/constraints.txt -e . \
		pytest pytest-timeout pytest-xdist jupyter_client nbclient nbformat ipykernel "pytest-jupyter[server]" \
		playwright
	touch $@

# The GPU check, one command on a lent GPU machine (no package registry there): gpu-wheels
# downloads into .whl/ the wheels it lacks (CPython 3.12; the device tool carries .whl/), and
# scripts/gpu_check.sh installs them there with --no-index and runs every step of the GPU issue
# into one folder. Here, without CUDA, gpu-check rehearses it: the CPU stand-ins, and which steps
# need CUDA (tests/test_gpu_check.py keeps it runnable).
gpu-wheels: $(VENV)/.installed
	PYTHON=$(BIN)/python bash scripts/gpu_wheels.sh

gpu-check: $(VENV)/.installed
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh gpu-check-out
