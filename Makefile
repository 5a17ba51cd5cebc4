# One target per habit. `make test` sets up everything it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_PY := $(VENV)/.installed
STAMP_NPM := node_modules/.installed

.PHONY: setup test test-py test-js demo bench lint clean

setup: $(STAMP_PY) $(STAMP_NPM)

$(STAMP_PY): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(STAMP_NPM): package.json package-lock.json
	npm ci --no-audit --no-fund
	node_modules/.bin/workerd --version
	touch $@

test: setup lint test-js test-py

lint: setup
	$(VENV)/bin/ruff check .

test-py: setup
	$(PY) -m pytest

test-js: setup
	node --test worker/test/

demo: setup
	$(PY) scripts/sandbox.py demo

# wrk is the load generator (compiled, so it is not the bottleneck): installed from
# Debian's packages only when absent.
bench: setup
	@command -v wrk >/dev/null || { echo "bench: installing wrk (apt-get install -y wrk)"; apt-get install -y wrk; }
	$(PY) scripts/bench_router.py

clean:
	rm -rf $(VENV) node_modules .colocate
