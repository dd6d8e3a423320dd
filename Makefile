# Two commands do everything on a fresh machine:
#   make run    -- create .venv, install, run the main job on the embedded default
#   make test   -- create .venv, install, run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,engine
# Test processes (pytest-xdist): each takes whole files, so a module's or session's fixtures
# (up's fitted profile, a shared run) are made once per process. 0: one process, no workers.
PYTEST_WORKERS ?= 2

.PHONY: setup run test clean

$(BIN)/vertumnus: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	@touch $(BIN)/vertumnus

setup: $(BIN)/vertumnus

run: setup
	$(BIN)/vertumnus up

test: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
