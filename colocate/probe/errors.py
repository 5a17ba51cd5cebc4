"""Errors of the probe. Every one of them ends the probe with exit code 2; the tree's place in
the kit's is drawn in colocate/errors.py.

    ProbeError            the probe could not run (a ScriptError); ``str()`` is the whole message for a person
    ├── UsageError        a flag or its value is wrong (names the flag, the value and the fix)
    ├── OutputsError      a stack's outputs cannot be read (no pulumi CLI, no stack, bad JSON)
    ├── Unreachable       the target refused the connection or timed out on the warm-up
    ├── Unauthorized      the probe endpoint answered 401: missing or wrong probe token
    ├── TargetError       the target answered, but not as the contract says (e.g. no model to ask for)
    │   └── LiveDataError live.py: the live view's rows are not what this probe reads
    └── HistogramError    histogram.py: a histogram or its buckets are not in the Worker's format

A failed *check* (a budget, a placement) is not an error: it is a result, exit 1.
Messages never carry the token.
"""

from __future__ import annotations

from ..errors import ScriptError


class ProbeError(ScriptError):
    """The probe could not run."""

    exit_code = 2


class UsageError(ProbeError):
    """Raised for a bad flag value, e.g. ``--budget foo=10``."""

    def __init__(self, flag: str, value: object, problem: str, fix: str):
        self.flag, self.value, self.problem, self.fix = flag, value, problem, fix
        # No value given at all (e.g. no token anywhere) reads "--token: no probe token", not "--token None".
        shown = f"{flag}: " if value is None else f"{flag} {value!r}: "
        super().__init__(f"{shown}{problem}. Fix: {fix}")


class OutputsError(ProbeError):
    """Raised when ``pulumi stack output`` is missing, fails, or prints something unexpected."""


class Unreachable(ProbeError):
    """Raised when the warm-up request cannot connect or times out."""


class Unauthorized(ProbeError):
    """Raised when the probe endpoint answers 401."""


class TargetError(ProbeError):
    """Raised when the target answers in a way the probe cannot work with."""
