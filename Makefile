# Everything a fresh machine needs. torch comes first, pinned to the CPU build on this machine's
# disk, so the project's own install finds it satisfied and never downloads a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup seed test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

seed: setup  ## the seed's experiment on the built-in Qwen2.5-0.5B-shaped model
	$(BIN)/python -m experiments.seed $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .hypothesis
