# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use: torch first, then this package with its pinned dependencies. torch is the CPU
# wheel in $(TORCH_WHEELS) when one lies there (these CPU machines: never a CUDA build); elsewhere it is
# torch==$(TORCH_VERSION) from the package index (on a GPU machine, its CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_WHEELS ?= /opt/wheels
STAMP := $(VENV)/.installed
TORCH_WHEEL = $(firstword $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)+cpu-*.whl))

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install "$(or $(TORCH_WHEEL),torch==$(TORCH_VERSION))"
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $@

.PHONY: setup test demo
setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/treeflash-hf demo
