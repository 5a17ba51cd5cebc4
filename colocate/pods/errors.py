"""Errors of the pod layer (providers, readiness, scripts/pod.py); the tree's place in the kit's
is drawn in colocate/errors.py.

    PodError                  anything that stops a pod operation (a ScriptError)
    ├── PodConfigError        bad spec, missing key or token, a provider that cannot serve the region (exit 2)
    │   └── PodTlsError       podtls.py: the pod hop's certificates are missing or do not load
    ├── Refused               standin/:   the stand-in answers a request vLLM would refuse (an HTTP answer, not an exit)
    ├── ClientGone            standin/:   the client left while its answer was made (its sequences are aborted)
    └── ProviderError         the provider said no, or never answered (exit 1)
        ├── RetryableError    429, 5xx or a timeout that outlived the bounded retries
        ├── CapacityError     no capacity in any of the region's locations; ``.attempts`` is the table
        ├── FatalError        401, 400, 402, 403, 422: retrying cannot help; says what was sent (redacted)
        ├── OverPriceError    the pod would cost (or, once created, costs) more than maxPricePerHr
        ├── NotFoundError     the pod does not exist (delete treats it as success)
        └── NotReadyError     the pod never became healthy (timeout, or a state it cannot leave)

``exit_code`` is what ``scripts/pod.py`` returns for the error.
"""

from __future__ import annotations

from ..errors import ScriptError


class PodError(ScriptError):
    """Base class. ``str()`` is the whole message for a person; it never holds a secret."""

    exit_code = 1


class PodConfigError(PodError):
    """Raised before any provider call for a bad spec, a missing env variable or an unservable region."""

    exit_code = 2


class ProviderError(PodError):
    """Raised when a provider call fails."""


class RetryableError(ProviderError):
    """Raised when 429/5xx/timeouts persist after the bounded retries."""


class CapacityError(ProviderError):
    """Raised when no location of the region has capacity. ``attempts``: [(location, what, why)]."""

    def __init__(self, message: str, attempts: list[tuple[str, str, str]]):
        self.attempts = attempts
        super().__init__(f"{message}\n{format_attempts(attempts)}")


class FatalError(ProviderError):
    """Raised for a request the provider refuses (401, 400, 402, 403, 422): stop, do not retry."""


class OverPriceError(ProviderError):
    """Raised when the provider's price for the pod is above the spec's ``max_price_per_hr``; nothing is left rented."""


class NotFoundError(ProviderError):
    """Raised when the pod (or instance) does not exist."""


class NotReadyError(ProviderError):
    """Raised when a pod does not pass its health check in time, or reaches a state it never leaves."""


def format_attempts(attempts: list[tuple[str, str, str]]) -> str:
    """A plain-text table of what create tried, for stderr and the error message."""
    rows = [("location", "tried", "result")] + [tuple(map(str, a)) for a in attempts]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class ClientGone(PodError):
    """The stand-in's client left (or the server stops) while its answer was being made."""
