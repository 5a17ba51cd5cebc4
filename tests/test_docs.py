"""The project's text refers only to what a user of the project has: no file outside the
repository (a notes file, a sibling directory), no issue number of the project's tracker, and
every relative Markdown link resolves to a file in the repository. Pure: reads the tracked files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".md", ".py", ".js", ".mjs", ".yaml", ".yml", ".toml", ".ini", ".sh", ".txt", ".json"}

# Files that live outside the repository: notes next to it, or the machine's directories.
BESIDE = r"\.\./" + "sha" + "red"  # spelled apart so this check is not itself a reference
OUTSIDE = re.compile(r"FACTS\.md|DESIGN\.md|STYLE\.md|" + BESIDE + r"|/work/")
# "issue 14", "issues 26 and 28", "(#12)": the project's own tracker. A public repository's
# thread ("pulumi/pulumi #9979", "cloudflare-docs PR #9802") names its repository, which a reader can open.
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/.-])#\d{1,6}\b")
# Before a "#N" on its line: a repository ("owner/name", "pulumi-cloudflare") or "PR".
REPOSITORY = re.compile(r"[\w.-]+/[\w.-]+|\w+-[\w-]+|\bPR\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHORED = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")  # [x](file.md#anchor) and [x](#anchor)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if Path(n).suffix in TEXT_SUFFIXES and not n.startswith("tests/fixtures/")]


def offence(pattern: re.Pattern[str], line: str, previous: str = "") -> re.Match[str] | None:
    match = pattern.search(line)
    if (match and pattern is ISSUE and match.group(0).startswith("#")
            and REPOSITORY.search(previous[-40:] + " " + line[: match.start()])):
        return None
    return match


def offences(pattern: re.Pattern[str], paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        if path == Path(__file__).resolve():
            continue  # this file names the patterns it forbids
        previous = ""
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = offence(pattern, line, previous)
            previous = line
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_no_reference_to_a_file_outside_the_project():
    found = offences(OUTSIDE, tracked_text_files())
    assert not found, "references to files outside the project:\n" + "\n".join(found)


def test_no_issue_number():
    found = offences(ISSUE, tracked_text_files())
    assert not found, "references to the project's issue numbers:\n" + "\n".join(found)


def test_relative_links_resolve_inside_the_project():
    broken = []
    for path in [p for p in tracked_text_files() if p.suffix == ".md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                resolved = (path.parent / target).resolve()
                if not resolved.is_relative_to(ROOT) or not resolved.exists():
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to files that are not in the project:\n" + "\n".join(broken)


def slugs(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated heading's anchor suffixed -1, -2..."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} +(.*?) *#*$", line)):
            continue
        text = re.sub(r"`|\*\*|\[([^]]*)\]\([^)]*\)", lambda g: g.group(1) or "", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_to_a_section_names_a_heading_of_its_file():
    broken = []
    for path in [p for p in tracked_text_files() if p.suffix == ".md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target, anchor in ANCHORED.findall(line):
                if re.match(r"[a-z]+:", target or ""):
                    continue
                file = (path.parent / target).resolve() if target else path
                if file.exists() and anchor not in slugs(file):
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}#{anchor}")
    assert not broken, "links to a section their file does not have:\n" + "\n".join(broken)


# docs/ says what is true now, briefly: each figure once, in benchmarks.md (docs/testing.md).
DOCS_MAX_LINES, DOC_MAX_LINES, BENCHMARKS_MAX_LINES = 3000, 500, 360


def test_the_docs_stay_short_enough_to_read_in_an_evening():
    lines = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "docs").glob("*.md")}
    assert sum(lines.values()) <= DOCS_MAX_LINES, f"docs/ is {sum(lines.values())} lines (at most {DOCS_MAX_LINES})"
    long = {n: c for n, c in lines.items() if c > DOC_MAX_LINES}
    assert not long, f"over {DOC_MAX_LINES} lines: {long}"
    assert lines["benchmarks.md"] <= BENCHMARKS_MAX_LINES, f"benchmarks.md is {lines['benchmarks.md']} lines"


@pytest.mark.parametrize(
    "line, pattern, hit",
    [
        ("see FACTS.md for the source", OUTSIDE, True),
        ("copied from ../" + "shared/specs", OUTSIDE, True),
        ("as issue 14 asked", ISSUE, True),
        ("Issues 26 and 28", ISSUE, True),
        ("fixed in (#12)", ISSUE, True),
        ("pulumi/pulumi #9979", ISSUE, False),
        ("cloudflare-docs PR #9802", ISSUE, False),
        ("terraform-provider-cloudflare #6785", ISSUE, False),
        ("colour #fff and docs/probe.md#cost", ISSUE, False),
    ],
)
def test_the_patterns_catch_what_they_should(line, pattern, hit):
    assert bool(offence(pattern, line)) is hit


# What a newcomer needs before the real-cloud path, each named in the README ("What you need
# first, in order"), and the README kept short enough to read first: mechanisms live in docs/.
PREREQUISITES = ("PULUMI_CONFIG_PASSPHRASE", "wrangler@", "zone", "workers.dev subdomain",
                 "colocate:fallbackCap.cellUsdPerDay", "RUNPOD_API_KEY", "VASTAI_API_KEY")
README_MAX_BYTES = 25_000


def test_the_readme_is_short_and_names_every_real_cloud_prerequisite():
    text = (ROOT / "README.md").read_text()
    size = len(text.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; move mechanisms to docs/ (limit {README_MAX_BYTES:,})"
    missing = [p for p in PREREQUISITES if p not in text]
    assert not missing, f"README.md does not name {missing}"
