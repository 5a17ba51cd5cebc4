"""The Pulumi program's error (its place in the kit's tree is drawn in colocate/errors.py).

    ProgramError     the program refuses to declare anything: a ConfigError of the plan, or a
                     check only the program can make (the zone, a secret stored in plain text)

It is a ``pulumi.RunError``, which Pulumi prints as the message alone, without a trace.
"""

from __future__ import annotations

import pulumi

from colocate.errors import ColocateError


class ProgramError(ColocateError, pulumi.RunError):
    """Raised before any resource is declared; ``str()`` names the key, the value and the fix."""

    exit_code = 2
