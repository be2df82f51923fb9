# Two commands do all the set-up: `make run` (the broker, foreground) and `make test`. Both may run
# at the same time from a fresh clone: the virtual environment is made under a lock, once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := .venv.lock
EXTRAS ?= test,bench
# The transfer library of `ipcpool pull`, installed without its declared torch (it imports
# without it): its tests run in CI. `make NIXL= venv` leaves it out (those tests then skip).
NIXL ?= nixl-cu13==1.5.1

.PHONY: venv run test test-gpu bench clean

# Under flock: whoever comes second waits, then finds the stamp newer than pyproject.toml and
# installs nothing. A venv left without pip (an earlier run stopped half-way) is made again. The
# C part (NATIVE) is built by the install: a change to it installs again, as one to pyproject.toml.
NATIVE := $(wildcard ipcpool/shm/_native.c)
$(STAMP): pyproject.toml $(NATIVE)
	@flock $(LOCK) sh -c '\
	  if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt $(or $(NATIVE),pyproject.toml) ]; then exit 0; fi; \
	  set -e; \
	  if ! $(PY) -m pip --version >/dev/null 2>&1; then echo "creating $(VENV)"; $(PYTHON) -m venv --clear $(VENV); fi; \
	  echo "installing ipcpool and its dependencies into $(VENV) (quiet; a minute or two the first time)"; \
	  $(PY) -m pip install --quiet --upgrade pip; \
	  $(PY) -m pip install --quiet -e ".[$(EXTRAS)]"; \
	  if [ -n "$(NIXL)" ]; then $(PY) -m pip install --quiet --no-deps "$(NIXL)"; fi; \
	  touch $(STAMP)'

venv: $(STAMP)    ## only the set-up: .venv/bin/ipcpool is then the CLI
	@echo "ready: run .venv/bin/ipcpool (or: source .venv/bin/activate; ipcpool --help)"

run: $(STAMP)
	$(VENV)/bin/ipcpool broker $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# Results go to bench/out/ (ignored by git): bench/results keeps the runs the README cites.
BENCH_OUT ?= bench/out
bench: $(STAMP)
	$(PY) bench/host_roundtrip.py --out-dir $(BENCH_OUT)

clean:
	rm -rf $(VENV) $(LOCK) build *.egg-info
