"""Errors of the plan layer (catalogue, settings, ledger, plan).

    ConfigError            bad configuration; names the key, the value and the fix
    ├── UnknownRegion      a region name the catalogue does not hold
    ├── UnsupportedProvider  a GPU provider that cannot serve the region
    ├── MissingSetting     a required key (accountId, a secret) is not set
    └── LedgerError        the generation ledger is inconsistent, or a transition is illegal

The Pulumi program turns every ConfigError into ``pulumi.RunError``; scripts exit 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong. ``str()`` is the whole message for a person."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key = key
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key}: {problem} (got {value!r}). Fix: {fix}")


class UnknownRegion(ConfigError):
    """Raised when a region name is not in the catalogue."""


class UnsupportedProvider(ConfigError):
    """Raised when a GPU provider has no location inside the region."""


class MissingSetting(ConfigError):
    """Raised when a required key or secret is absent."""


class LedgerError(ConfigError):
    """Raised for an inconsistent generation ledger or an illegal migration step."""
