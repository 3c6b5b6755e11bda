# Every target sets up what it needs; a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo bench bench-quick clean

setup: $(STAMP)

# torch==2.13.0 first: a looser pin makes pip pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test,lint,diffusion,bench,remote]"
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy --strict src

demo: setup
	$(BIN)/hwr demo

# Every row side by side (about 19 minutes on 2 cores); `make bench-quick` takes about 3.5.
bench: setup
	$(BIN)/hwr bench

bench-quick: setup
	$(BIN)/hwr bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
