# fl-secure: the two set-up-and-run commands are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test proto proto-check lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fl-secure train --config examples/demo.toml --audit --report

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python benchmarks/transport.py
	$(BIN)/python benchmarks/learning.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
