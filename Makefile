# Everything a fresh machine needs. torch comes first, pinned, so the project's own install finds
# it satisfied: the build pip finds for the pin (here the CPU wheel in pip's find-links; where pip
# would take PyPI's CUDA build, TORCH_PIP_ARGS=--index-url=https://download.pytorch.org/whl/cpu).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# pyproject's optional extras; CI adds ray (EXTRAS=dev,ray) so the Ray launcher's test runs.
EXTRAS ?= dev
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup compiled seed test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(STAMP)  ## and the compiled core, if mypyc can build it here (else the simulator runs as plain Python)
	@$(BIN)/python -m engine.compiled --no-retry >/dev/null 2>&1 || echo "note: compiled core not built (python -m engine.compiled says why); the simulator runs as plain Python"

compiled: $(STAMP)  ## the simulator's hot path compiled with mypyc (engine/compiled): fails loudly if it cannot
	$(BIN)/python -m engine.compiled

seed: setup  ## the seed's experiment on the built-in Qwen2.5-0.5B-shaped model
	$(BIN)/python -m experiments.seed $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

lint: setup  ## the layer rules in pyproject.toml's [tool.importlinter]
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .hypothesis
