# The targets here are exactly what CI runs (.ci/run calls `make test`).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck unit integration bench-engine clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[engine,triton,dev]'
	@touch $(STAMP)

# The main job on the embedded default: real Triton on the CPU serving the reference engine.
run: $(STAMP)
	$(BIN)/scheduler-svc triton --model-repo model_repo/cpu

test: lint typecheck unit integration

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/pytest -q tests/integration

# Engine timing (a benchmark, never a test): writes figures for model_repo/README.md.
bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine_timing.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
