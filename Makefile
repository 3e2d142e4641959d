# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use: the CPU build of torch first (from local wheels, never a CUDA build),
# then this package with its pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_WHEELS ?= /opt/wheels
STAMP := $(VENV)/.installed

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --no-index --find-links $(TORCH_WHEELS) torch==$(TORCH_VERSION)
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $@

.PHONY: setup test demo
setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/treeflash-hf demo
