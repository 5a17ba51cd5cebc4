"""The suite's own scheduling hint (tests/conftest.py LONGEST_FIRST) names files that exist."""

from pathlib import Path

from tests.conftest import LONGEST_FIRST

HERE = Path(__file__).resolve().parent


def test_every_file_named_longest_first_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [n for n in LONGEST_FIRST if not (HERE / n).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that are gone: {missing}; remove them"
