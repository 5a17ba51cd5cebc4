"""The kit's errors: one root, one base per layer. ``str()`` is always the whole message for a
person (it never holds a secret); ``exit_code`` is what a script returns for the error, 2 for
bad configuration or input, 1 for a failure of the world (a provider, a network).

    ColocateError              root; exit 1 unless a class says otherwise
    ├── ConfigError            plan layer (catalogue, settings, ledger, plan): names the key, the value and the fix; exit 2
    │   ├── UnknownRegion      a region name the catalogue does not hold
    │   ├── UnsupportedProvider  a GPU provider that cannot serve the region
    │   ├── MissingSetting     a required key (accountId, a secret) is not set
    │   ├── LedgerError        the generation ledger is inconsistent, or a transition is illegal
    │   └── NoCapacity         the pod's profile has no knee to plan capacity from
    ├── ProgramError           Pulumi program layer (infra/errors.py): a ``pulumi.RunError``, shown without a trace
    ├── ScriptError            runtime layer (scripts/ and what they run)
    │   ├── PodError           colocate/pods/errors.py: provider, readiness and pod TLS errors (its own tree)
    │   ├── ProbeError         colocate/probe/errors.py: the probe could not run; exit 2 (its own tree)
    │   ├── AdminError         colocate/admin.py: the operator endpoints; exit 2, or 1 for a refusal the caller can act on
    │   ├── UsageError         colocate/scaling/cost.py: a usage row the cost report cannot read; scripts/keys.py: a
    │   │                      command keys.py cannot do for the stack; scripts/pod.py: a flag argparse refuses; exit 2
    │   ├── CostError          scripts/cost.py: the report cannot be made; exit 2
    │   ├── KeeperError        colocate/scaling/keeper.py: a pass could not do what it decided
    │   │   └── StackLocked    the owner's update found the Pulumi stack locked
    │   ├── Failed             scripts/placement.py: Cloudflare refused the placement or reports another one
    │   │   └── BadInput       the input (stdin, the token's variable) is wrong; exit 2
    │   └── BenchError         bench/harness.py: a benchmark's setup failed; exit 2
    │       └── PeerUnavailable  bench/peers.py: a peer could not be installed or started (left out, named)
    └── SandboxError           sandbox layer (colocate/sandbox/, colocate/workerd.py): exit 2 (its own tree)
        └── WorkerdError       colocate/workerd.py: workerd is missing, did not start, or lacks a binding value

The Pulumi program turns every ConfigError into a ProgramError; scripts return ``exc.exit_code``.
tests/test_error_tree.py checks that every exception class of the kit sits under its layer's base.
"""

from __future__ import annotations


class ColocateError(Exception):
    """The root of the kit's errors."""

    exit_code = 1


class ConfigError(ColocateError, ValueError):
    """A configuration value is wrong. ``str()`` is the whole message for a person."""

    exit_code = 2

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


class NoCapacity(ConfigError):
    """Raised when the pod's profile has no knee to plan capacity from (``oracle``, or an unknown name)."""

    def __init__(self, value: object, problem: str, fix: str):
        super().__init__("colocate:pod.profile", value, problem, fix)


class ScriptError(ColocateError):
    """The runtime layer's base: a script (or what it runs) could not do what it was asked."""
