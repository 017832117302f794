# One command to set up and run the demo, one to set up and run the tests.
# torch==2.13.0 is installed first: that CPU build lies on this machine's disk,
# while a bare `torch` requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP_FLAGS ?= -q

.PHONY: demo test setup bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install $(PIP_FLAGS) torch==2.13.0
	$(BIN)/pip install $(PIP_FLAGS) -e '.[dev,dashboard,optuna]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python examples/core_demo.py

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
