# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-fast clean

# demo: the package alone (no test tools, no CUDA compile toolchain)
$(DEMO_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,tunix]'
	$(BIN)/pip install -q --no-deps google-tunix==0.1.7
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/jaxpaged fetch-default
	$(BIN)/jaxpaged generate --prompt "The three primary colors are" --max-tokens 48
	$(BIN)/jaxpaged generate --chat --prompt "Write a haiku about the sea." \
		--prompt "What is the capital of France?" --max-tokens 64

# two pytest-xdist workers, whole modules each (module-scoped engines and servers stay shared): most of a
# test's time is XLA compiling, which runs on one core. The longest modules go first (tests/conftest.py
# SLOWEST_FIRST; xdist's own reorder, by test count, would leave a long one-test module for last)
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

test: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST)

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
