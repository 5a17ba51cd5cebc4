"""A fresh clone stands alone: nothing in the project reads or names a folder beside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Built from parts so that this file does not match its own needle.
NEEDLE = ".." + "/" + "shared"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache"}


def project_files() -> list[Path]:
    """Tracked and new (not ignored) files; a plain walk when there is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def mentions(root: Path, files: list[Path]) -> list[str]:
    """The files (relative to ``root``) whose text contains the needle."""
    offenders = []
    for path in files:
        if not path.is_file():  # deleted in the work tree but still in the index
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if NEEDLE in text:
            offenders.append(str(path.relative_to(root)))
    return offenders


def test_no_file_reads_or_names_the_folder_beside_the_checkout():
    files = project_files()
    assert any(f.name == "conftest.py" for f in files), "the file list is empty: the check would prove nothing"
    assert mentions(ROOT, files) == [], f"these files refer to {NEEDLE}: carry what they need in the project instead"


def test_the_check_finds_a_mention(tmp_path):
    (tmp_path / "reads.py").write_text(f"SPECS = Path('{NEEDLE}/specs')\n")
    (tmp_path / "clean.py").write_text("SPECS = Path('tests/fixtures/specs')\n")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe" + NEEDLE.encode())
    assert mentions(tmp_path, sorted(tmp_path.iterdir())) == ["reads.py"]


def test_the_vendor_specs_are_carried_with_their_provenance():
    specs = ROOT / "tests" / "fixtures" / "specs"
    readme = (specs / "README.md").read_text()
    for name in ("runpod-v2-openapi.json", "vastai-openapi.yaml"):
        assert (specs / name).stat().st_size > 10_000, name
        assert f"`{name}`" in readme, f"{name} has no provenance line"
