# Two commands do all the set-up: `make run` (the broker, foreground) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ipcpool broker $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/host_roundtrip.py

clean:
	rm -rf $(VENV) build *.egg-info
