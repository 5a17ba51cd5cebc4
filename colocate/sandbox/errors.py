"""Errors of the sandbox; the tree's place in the kit's is drawn in colocate/errors.py.

    SandboxError          anything the sandbox cannot do; scripts print it and exit 2
    ├── GeographyError    a bad site, stretch or --rtt override (names the value and the fix)
    ├── AlreadyRunning    ``up`` while a sandbox already runs in the same state directory
    ├── OtherStack        ``up``/``apply`` of one stack in a state directory another stack set up
    ├── NotRunning        ``apply`` with no sandbox running in the state directory
    ├── StartupFailed     a component (pod, fallback, workerd, network) did not come up; its log is named
    ├── BadRequest        proxies.py: the emulated edge refuses a request (an HTTP answer, not an exit)
    ├── UnknownStack      scripts/sandbox.py: no stack file and no running sandbox of that name
    └── WorkerdError      colocate/workerd.py: running workerd failed
        ├── BindingValueMissing  a secret or from_output binding has no value in ``values``
        ├── WorkerdNotInstalled  node_modules/.bin/workerd is missing (run ``make setup``)
        └── WorkerdStartFailed   workerd exited or never listened; the log tail is attached
"""

from __future__ import annotations

from ..errors import ColocateError


class SandboxError(ColocateError, RuntimeError):
    """Something the sandbox cannot do. ``str()`` is the whole message for a person."""

    exit_code = 2


class GeographyError(SandboxError, ValueError):
    """Raised for an unknown site, a bad stretch or a malformed ``--rtt`` override."""


class AlreadyRunning(SandboxError):
    """Raised by ``up`` when the state directory's lock is held by a running sandbox. ``same``:
    it was started with the same launch (stack, stacks directory, sites, geography), so the
    ``up`` asked for already holds."""

    def __init__(self, message: str, *, same: bool = False):
        super().__init__(message)
        self.same = same


class OtherStack(SandboxError):
    """Raised by ``up`` or ``apply`` when the state directory belongs to another stack."""


class NotRunning(SandboxError):
    """Raised by ``apply`` when no sandbox runs in the state directory."""


class StartupFailed(SandboxError):
    """Raised when a component does not come up in time; the message names its log."""
