# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use: the CPU build of torch first (from local wheels, never a CUDA build),
# then this package with its pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_WHEELS ?= /opt/wheels
STAMP := $(VENV)/.installed
TORCH_WHEEL = $(firstword $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)+cpu-*.whl))

$(STAMP): setup.cfg pyproject.toml
	@test -n "$(TORCH_WHEEL)" || { echo "No CPU wheel of torch $(TORCH_VERSION) in $(TORCH_WHEELS): set TORCH_WHEELS=DIR (refusing to let pip pull a CUDA build)."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install "$(TORCH_WHEEL)"
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $@

.PHONY: setup test demo
setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/treeflash-hf demo
