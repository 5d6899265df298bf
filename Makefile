# The two commands of the README:
#   make demo   runs notebooks/quickstart.ipynb headlessly (%%elastic --nproc 4 on CPU) and prints its outputs
#   make test   runs the whole test suite
# Both create .venv on first use. TORCH is what pip installs when the venv has no torch: the pinned
# CPU build by default (never let pip resolve an unpinned torch: that is a multi-GB CUDA download).

PYTHON   ?= python3
VENV     ?= .venv
TORCH    ?= torch==2.13.0
CHROMIUM ?= /usr/bin/chromium
BIN      := $(VENV)/bin
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python scripts/run_notebook.py notebooks/quickstart.ipynb

test: $(VENV)/.installed $(CHROMIUM)
	$(BIN)/ruff check elastic_nb tests scripts benchmarks
	ELASTIC_NB_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest

# The browser tests drive Debian's Chromium (Playwright's own download does not work here).
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/run_all.py --readme
