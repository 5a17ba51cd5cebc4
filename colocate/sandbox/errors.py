"""Errors of the sandbox.

    SandboxError          anything the sandbox cannot do; scripts print it and exit 2
    ├── GeographyError    a bad site, stretch or --rtt override (names the value and the fix)
    ├── AlreadyRunning    ``up`` while a sandbox already runs in the same state directory
    ├── OtherStack        ``up``/``apply`` of one stack in a state directory another stack set up
    ├── NotRunning        ``apply`` with no sandbox running in the state directory
    └── StartupFailed     a component (pod, fallback, workerd, network) did not come up; its log is named
"""

from __future__ import annotations


class SandboxError(RuntimeError):
    """Something the sandbox cannot do. ``str()`` is the whole message for a person."""


class GeographyError(SandboxError, ValueError):
    """Raised for an unknown site, a bad stretch or a malformed ``--rtt`` override."""


class AlreadyRunning(SandboxError):
    """Raised by ``up`` when the state directory's lock is held by a running sandbox."""


class OtherStack(SandboxError):
    """Raised by ``up`` or ``apply`` when the state directory belongs to another stack."""


class NotRunning(SandboxError):
    """Raised by ``apply`` when no sandbox runs in the state directory."""


class StartupFailed(SandboxError):
    """Raised when a component does not come up in time; the message names its log."""
