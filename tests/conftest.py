"""Shared pytest setup. Area fixtures live in tests/support/<area>.py and the test modules."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_sessionfinish(session, exitstatus):
    """Quiet asyncio after the run: the Pulumi mock tests that expect a refusal raised inside
    an apply leave futures holding that RunError, which Pulumi's runtime keeps referenced until
    the interpreter exits; asyncio would then print each as "Future exception was never
    retrieved" after the summary. During the run its logger is untouched."""
    import logging

    logging.getLogger("asyncio").disabled = True
