# sharp — developer entry points. `make install` builds .venv; everything else runs from it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# These machines carry a local CPU wheel of exactly this torch; an unpinned torch pulls GBs of CUDA packages.
TORCH_PIN ?= torch==2.13.0

.PHONY: install test lint demo bench zoo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev,kernels]'

test: $(BIN)/python
	$(BIN)/python -m pytest -n 2 -q

lint: $(BIN)/python
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: $(BIN)/python
	$(BIN)/python -m sharp.demo

bench: $(BIN)/python
	$(BIN)/sharp-bench normalizers

# Retrain the committed demo models (models/zoo/, ~15 min on 2 cores): deterministic, from the stdlib sources
zoo: $(BIN)/python
	$(BIN)/python -m sharp.models.zoo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
