# specenv: the two commands of the README are `make demo` (main job) and `make test` (all tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specenv-installed
OUT ?= bench-out

.PHONY: venv demo test lint format clean

# torch is pinned and installed first: `torch==2.13.0` is the local CPU wheel, an unpinned torch
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[rl,live,dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/specenv validate paper-default
	$(BIN)/specenv fit paper-default
	$(BIN)/specenv oracle paper-default --sweep --delta --plot $(OUT)
	$(BIN)/specenv bench paper-default --out $(OUT)

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check specenv oracle policies scripts tests

format: venv
	$(BIN)/ruff format specenv oracle policies scripts tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(OUT)
