# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxpaged fetch-default
	$(BIN)/jaxpaged generate --prompt "The three primary colors are" --max-tokens 48
	$(BIN)/jaxpaged generate --chat --prompt "Write a haiku about the sea." \
		--prompt "What is the capital of France?" --max-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
