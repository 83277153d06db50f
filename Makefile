# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv on first use: torch first (the CPU wheel, so no range
# below pulls a CUDA build), then this package with its extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,bench,dev,docs,ray]"
	touch $@

.PHONY: demo demo-actors test lint docs bench bench-quick
demo: $(VENV)/.installed
	$(BIN)/python examples/mcts_selfplay.py

demo-actors: $(VENV)/.installed
	$(BIN)/python examples/actors_demo.py

lint: $(VENV)/.installed
	$(BIN)/ruff check torchrl_batchserve tests examples benchmarks
	$(BIN)/mypy torchrl_batchserve

# The docs site, API reference included: --strict, so a broken page or reference fails.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The suite runs in a private network namespace whose only address is 127.0.0.1
# (tools/loopback-only), so that the Ray tests' cluster listens on loopback only.
test: lint docs
	tools/loopback-only $(BIN)/python -m pytest

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/run.py

bench-quick: $(VENV)/.installed
	$(BIN)/python benchmarks/run.py --quick
