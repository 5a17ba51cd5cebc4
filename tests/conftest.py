"""Shared pytest setup. Area fixtures live in tests/support/<area>.py and the test modules."""

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# `make test-vllm` (COLOCATE_ENGINE=vllm) runs tests/vllm_cpu/ and tests/engine_contract/ against
# vLLM's CPU build (docs/testing.md, "The real engine"); everywhere else tests/vllm_cpu/ is skipped,
# and tests/engine_contract/ runs against the stand-in.
collect_ignore = [] if os.environ.get("COLOCATE_ENGINE") == "vllm" else ["vllm_cpu"]


@pytest.fixture(scope="session")
def vllm_cell(tmp_path_factory):
    """One vLLM for the whole run (it starts in minutes), with a sandbox cell in front of it."""
    from tests.vllm_cpu.server import vllm_cell as started

    with started(tmp_path_factory.mktemp("vllm")) as cell:
        yield cell


@pytest.fixture
def openai_client():
    """Makes openai.OpenAI clients (no retries, 30 s timeout unless given) and closes them after
    the test: an open client's pooled socket is otherwise found by a later test's garbage
    collection, and fails that test as an unclosed-socket ResourceWarning."""
    import openai  # here, not at collection: every pytest worker collects every file

    made = []

    def make(base_url: str, api_key: str, **options) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=base_url, api_key=api_key, **{"max_retries": 0, "timeout": 30, **options}))
        return made[-1]

    yield make
    for client in made:
        client.close()


def pytest_sessionfinish(session, exitstatus):
    """Quiet asyncio after the run: the Pulumi mock tests that expect a refusal raised inside
    an apply leave futures holding that RunError, which Pulumi's runtime keeps referenced until
    the interpreter exits; asyncio would then print each as "Future exception was never
    retrieved" after the summary. During the run its logger is untouched."""
    import logging

    logging.getLogger("asyncio").disabled = True


# The longest test files, about longest first (their wall time on a worker in a `make test` run, 2026-12-07:
# a per-test timeline; `--durations=0` gives it too). `make test` runs files whole on eight workers
# (--dist loadfile, below) in collection order: starting these first keeps one of them from starting last
# and running alone at the end (test_openai_client.py, once not named here, ran alone for a run's last
# 25 s); the first few mostly wait on time (a fresh minute, a sync, a compressed day), so they share the
# cores with the rest. test_infra_cell.py starts the Pulumi mock group (41 s in all). Files not named
# keep their order, after these.
LONGEST_FIRST = (
    "test_fleet_limits.py", "test_fleet_exchange.py", "test_worker_bench.py", "test_live_drift.py",
    "test_sandbox_spot.py", "test_scale_sandbox.py", "test_sandbox_fleet.py", "test_sandbox_demo.py",
    "test_openai_client.py", "test_infra_cell.py", "test_sandbox_pods.py", "test_sandbox_fleet_demo.py",
    "test_sandbox_cell.py", "test_bench_busy.py", "test_security.py", "test_sandbox_autoscale.py",
    "test_worker_instructions.py", "test_sandbox_signals.py", "test_worker_keys.py", "test_hangups.py",
    "test_bench_prefix.py", "test_security_metering.py", "test_keeper_sandbox.py", "test_worker_pace.py",
    "test_sandbox_engine.py", "test_newcomer_path.py", "test_migration_import.py", "test_engine.py",
    "test_migration_e2e.py", "test_pod_providers.py", "test_worker_pods.py",
)


# `make test` runs with --dist loadfile, and this scheduler: each file runs whole on one worker (its
# module fixtures start once), except the files that import the Pulumi program (infra/, its mocks, or a
# test file that does), which run together: every worker that runs one pays the ~3.4 CPU-s import of
# pulumi_cloudflare once (5 on a slower host). Not
# --dist loadgroup with a mark per file: xdist 3.8 names a test's group in its node id, which pytest
# 9.2 no longer lets a plugin change, so every test became a group of its own and a file's fleet or
# cell started on several workers at once (pytest-dev/pytest-xdist#1386).
PULUMI_GROUP = "pulumi-mocks"
_IMPORTS_PROGRAM = re.compile(r"^\s*(?:from|import) (?:infra\b|tests\.support\.pulumi_mocks\b|tests\.test_infra_)", re.M)


def _group(nodeid: str, seen: dict[str, str]) -> str:
    path = nodeid.split("::", 1)[0]
    if path not in seen:
        seen[path] = PULUMI_GROUP if _IMPORTS_PROGRAM.search((ROOT / path).read_text()) else path
    return seen[path]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `make test-vllm` runs without xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seen: dict[str, str] = {}

    class FilesWithPulumiTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid, seen)

    return FilesWithPulumiTogether(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Every test module is imported now: freeze what lives (modules, classes, fixtures' code)
    so that the collector's full passes during the run scan only what the tests make."""
    import gc

    gc.collect()
    gc.freeze()
