"""What the kit's scripts share on their command line: the argument parser whose errors have the
kit's shape (what was wrong, then ``Fix:``, a near flag named), and the printed form of a command
that runs one of the scripts from any directory.

Pure: imports nothing of the kit, so a script can load it before anything else."""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent


def script(name: str) -> str:
    """How to run ``scripts/<name>`` as printed in a suggestion: the project's virtualenv Python
    and the script by absolute path, so the line works pasted in any directory."""
    return f"{shlex.quote(str(ROOT / '.venv' / 'bin' / 'python'))} {shlex.quote(str(ROOT / 'scripts' / name))}"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option of ``parser`` and of its subcommands."""
    found: list[str] = []
    for action in parser._actions:  # argparse keeps no public list
        found += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _options(sub)
    return sorted(set(found))


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors read like the kit's other errors and exit 2:
    an unknown flag is named with the closest one it knows (``--stak`` → ``--stack``)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # Kept for error(): a flag that is required may be missing because it was mistyped.
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        mistyped = [a for a in getattr(self, "_given", []) if a.startswith("--") and a.split("=", 1)[0] not in _options(self)]
        if message.startswith("the following arguments are required") and mistyped:
            message = prefix + " ".join(mistyped)  # `--too apac-jp` is why `--to` is missing: name the typo
        if message.startswith(prefix):
            words = message[len(prefix):].split()
            flags = [w for w in words if w.startswith("-")]
            first = (flags or words)[0]
            name = first.split("=", 1)[0]
            close = difflib.get_close_matches(name, _options(self), n=1, cutoff=0.6) if name.startswith("--") else []
            fix = f"did you mean `{close[0]}`?" if close else "leave it out"
            message = (f"{first}: unknown {'flag' if name.startswith('-') else 'argument'}. Fix: {fix} "
                       f"(`{self.prog} --help` lists the flags)")
        elif (choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)):
            known = re.findall(r"'([^']*)'", choice.group(2))
            close = difflib.get_close_matches(choice.group(1), known, n=1)
            fix = f"did you mean `{close[0]}`?" if close else f"one of {', '.join(known)}"
            message = f"{choice.group(1)!r}: unknown command. Fix: {fix}"
        else:
            message = f"{message}. Fix: see `{self.prog} --help`"
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def subcommands(parser: argparse.ArgumentParser, **kwargs) -> argparse._SubParsersAction:
    """``parser.add_subparsers`` whose subcommands are :class:`Parser` s too."""
    return parser.add_subparsers(parser_class=Parser, **kwargs)
