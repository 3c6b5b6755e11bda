# Every target sets up what it needs; a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint docs demo bench bench-quick fuzz soak clean

setup: $(STAMP)

# torch==2.13.0 first: a looser pin makes pip pull a multi-GB CUDA build.
# The tools (tools/: hwr bench, hwr demo, soak, synthetic models) are a package of their own, installed after the runtime.
$(STAMP): pyproject.toml tools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test,lint,diffusion,bench,remote,serve,docs]"
	$(BIN)/python -m pip install --quiet -e tools
	# The vLLM-Omni reference the compat tests and `hwr bench --vllm-omni` compare against: without its dependencies,
	# which would pull vLLM and a CUDA torch (it needs only torch, safetensors and regex, installed above).
	$(BIN)/python -m pip install --quiet --no-deps "vllm-omni==0.30.0"
	touch $(STAMP)

# Two workers, one test file at a time each: many tests wait on child processes, so 2 cores stay busy.
# --no-loadscope-reorder keeps tests/conftest.py's order, which starts the longest files first.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: setup
	$(BIN)/ruff check src tools tests examples
	$(BIN)/mypy --strict src tools/src

# The documentation site (mkdocs.yml) into site/; --strict makes a broken link or a missing reference an error.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

demo: setup
	$(BIN)/hwr demo

# Every row side by side (about 19 minutes on 2 cores before the TP rows); `make bench-quick` takes about 4.5.
bench: setup
	$(BIN)/hwr bench

bench-quick: setup
	$(BIN)/hwr bench --quick

# The fuzz tests of hostile input (tests/test_fuzz_*.py) with many examples each; `make test`
# runs the same tests with a few dozen. FUZZ_EXAMPLES=N picks the count.
FUZZ_EXAMPLES ?= 2000

fuzz: setup
	HWR_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -m fuzz --timeout=0 --hypothesis-show-statistics tests

# Workers resolving a rotating set of models under random SIGKILLs, corruption, cleanup, gc and eviction,
# with an invariant check after every step (tools/src/hwr_tools/soak.py). SOAK_SECONDS sets the
# duration, SOAK_WORKERS the worker count, SOAK_SEED replays a run (the seed is printed).
SOAK_SECONDS ?= 1800
SOAK_WORKERS ?= 3

soak: setup
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_WORKERS=$(SOAK_WORKERS) $(BIN)/python -m hwr_tools.soak

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
