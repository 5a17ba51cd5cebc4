# One target per habit. `make test` sets up everything it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_PY := $(VENV)/.installed
STAMP_NPM := node_modules/.installed

# Python caches compiled bytecode under .venv/pycache (git-ignored, gone with `make clean`)
# even where the environment says not to (PYTHONDONTWRITEBYTECODE): the tests, the demo and
# the scripts they start would otherwise compile the kit again in every process.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache

.PHONY: setup wrk valgrind prometheus test test-fast test-vllm test-py test-js demo demo-fleet demo-autoscale demo-spot bench bench-ladder bench-instructions bench-stall bench-balance bench-failover bench-scale bench-fairness bench-front bench-fleet-failover bench-fleet-exchange bench-fleet-limits bench-pod bench-peers bench-prefix bench-answers bench-migration bench-busy lint clean

setup: $(STAMP_PY) $(STAMP_NPM)

# Quiet when all goes well: one line each; an installer's own errors still show. uv (pinned, from
# PyPI, into the venv) installs the pins: 3 s where pip took 9-19 s on a fresh clone, every second of
# it before the first pytest test. It compiles nothing: make's Python reads bytecode from
# .venv/pycache only (PYTHONPYCACHEPREFIX, above). The venv keeps its pip, for what users add.
# --system-certs: uv trusts the system's certificate store, as pip and npm do, not only its own
# roots (without it, a proxy whose CA is only in the system's store fails: "UnknownIssuer").
$(STAMP_PY): requirements.txt
	@echo "setup: .venv from requirements.txt"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.10
	@$(VENV)/bin/uv pip install --quiet --system-certs --python $(PY) -r requirements.txt
	@touch $@

$(STAMP_NPM): package.json package-lock.json
	@echo "setup: node_modules from package-lock.json (workerd, the Workers types, tsc)"
	@npm ci --no-audit --no-fund --loglevel=error
	@node_modules/.bin/workerd --version >/dev/null
	@touch $@

# wrk is the benchmarks' load generator (compiled, so it is not the bottleneck), from
# Debian's packages, installed only when absent; the benchmark's own tests use it too.
# Without apt-get (not Debian, or not root) those tests are skipped and say why.
wrk:
	@command -v wrk >/dev/null || { echo "installing wrk (apt-get install -y wrk)"; \
	  { apt-get update -qq && apt-get install -y -qq wrk; } >/dev/null 2>&1 || \
	  echo "wrk could not be installed: the benchmark tests will be skipped"; }

# valgrind counts the instructions of a request (bench/instructions.py); same rule as wrk.
valgrind:
	@command -v valgrind >/dev/null || { echo "installing valgrind (apt-get install -y valgrind)"; \
	  { apt-get update -qq && apt-get install -y -qq valgrind; } >/dev/null 2>&1 || \
	  echo "valgrind could not be installed: the instruction-count tests will be skipped"; }

# prometheus scrapes a sandbox cell in tests/test_metrics_prometheus.py (a real server, not
# a parser of ours); same rule as wrk. The package's service is not started.
prometheus:
	@command -v prometheus >/dev/null || { echo "installing prometheus (apt-get install -y prometheus)"; \
	  { apt-get update -qq && apt-get install -y -qq prometheus; } >/dev/null 2>&1 || \
	  echo "prometheus could not be installed: the Prometheus test will be skipped"; }

# Every suite runs through tests/suites.py: its whole output goes to .colocate/test-logs/, the
# terminal gets one line per suite (and the ten slowest tests, and the skips) and every failure;
# a failing run keeps its failures in .colocate/test-failures/<UTC time>.txt, named on the last
# line. The options (workers, order) are in tests/suites.py; docs/testing.md says why. It needs only
# the system's Python: it sets up what each step needs (.venv, node_modules, wrk, valgrind, prometheus,
# by the rules above) beside the steps that need none of it, so node's tests run during the venv's install.
test:
	@$(PYTHON) -m tests.suites lint js py

# ruff (ruff.toml), the Worker's JSDoc types against workers-types (worker/tsconfig.json),
# and mypy over the kit's Python (mypy.ini).
lint:
	@$(PYTHON) -m tests.suites lint

test-py:
	@$(PYTHON) -m tests.suites py

# The cell against a real vLLM: its CPU build in a venv of its own and a tiny random-weight model
# of the default model's shape, both cached per machine (~/.cache/colocate), then tests/vllm_cpu/
# and tests/engine_contract/ against one vLLM started through the kit's own start path
# (docs/testing.md, "The real engine").
test-vllm: setup
	@$(PY) -m tests.vllm_cpu.tinymodel >/dev/null
	@COLOCATE_ENGINE=vllm $(PY) -m tests.suites vllm

# The inner loop: pure, Pulumi-mock and fake-server tests (no sandbox cell; a few short workerd starts).
test-fast:
	@$(PYTHON) -m tests.suites fast

# The test files only: worker/test/support/ holds what they share (the generation object's
# in-memory storage).
test-js:
	@$(PYTHON) -m tests.suites js

demo: setup
	$(PY) scripts/sandbox.py demo

# Three cells behind one front door; one loses its pods and gets them back (docs/fleet.md).
demo-fleet: setup
	$(PY) scripts/sandbox.py demo-fleet

# A compressed day of three cells whose pods follow demand, priced three ways (docs/pods.md).
demo-autoscale: setup
	$(PY) scripts/sandbox.py demo-autoscale

demo-spot: setup
	$(PY) scripts/sandbox.py demo-spot

bench: setup wrk
	$(PY) -m bench.router

# colocate, Portkey's gateway and LiteLLM's proxy on one pod; the peers install into bench/.peers (docs/benchmarks.md).
bench-peers: setup wrk
	$(PY) -m bench.peers

bench-ladder: setup wrk
	$(PY) -m bench.ladder

bench-instructions: setup valgrind
	$(PY) -m bench.instructions --repeat 3

bench-stall: setup
	$(PY) -m bench.stall

bench-balance: setup
	$(PY) -m bench.balance

bench-failover: setup
	$(PY) -m bench.failover

bench-scale: setup
	$(PY) -m bench.scale

bench-fairness: setup
	$(PY) -m bench.fairness

bench-front: setup wrk
	$(PY) -m bench.front

bench-fleet-failover: setup
	$(PY) -m bench.fleet_failover

bench-fleet-exchange: setup
	$(PY) -m bench.fleet_exchange

# A key's limit across three cells, by lease: admitted / limit per case, and the state wait (docs/fleet.md).
bench-fleet-limits: setup
	$(PY) -m bench.fleet_limits

# Both published RTX 4090 sweeps replayed on their fitted profiles in virtual time, each point's ratio (docs/pods.md).
bench-pod: setup
	$(PY) -m bench.pod --compare $(ARGS)

# Every balancing policy on multi-turn chats, 2 stand-in pods at 80 % of their knee for 180 s (docs/benchmarks.md).
bench-prefix: setup
	$(PY) -m bench.prefix

# Non-streamed answers of 50 to 1,500 tokens through the sandbox cell at concurrency 1 and at the knee,
# against the profile's model: all served by the pod, no breaker opened (docs/benchmarks.md).
bench-answers: setup
	$(PY) -m bench.answers $(ARGS)

# A migration of 200,000 keys and 500,000 seg_minute rows in workerd, with requests during it and
# workerd killed mid-import (docs/migration.md); tests/test_migration_import.py runs a tenth of it.
bench-migration: setup
	$(PY) -m bench.migration $(ARGS)

# Keys filling the pod's prefill queue with long prompts against a quiet key, in the sandbox cell on the
# default profile: who served the quiet key, and whether a breaker opened (docs/benchmarks.md).
bench-busy: setup
	$(PY) -m bench.busy $(ARGS)

clean:
	rm -rf $(VENV) node_modules .colocate
