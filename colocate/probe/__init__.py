"""The post-deploy probe: measure every segment of a deployed cell and check where each part ran.

Modules, in the order data flows through them:

    outputs    reads a stack's outputs (``pulumi stack output``) and config
    keys       the client key of the routed samples: given, or minted with the probe token and revoked
    sample     sends the requests (one ``requests.Session``, monotonic clock) and records raw samples
    timing     parses ``Server-Timing`` headers
    stats      percentiles
    placement  which colo accepted, ran, held state; checks against the region; verdict text
    budgets    ``--budget NAME=MS[@pNN]`` and the stack's ``colocate:budgets``
    report     the result object, the human table and the JSON
    plot       a PNG of the per-segment distributions (matplotlib, Agg)

``scripts/probe.py`` is the command-line edge over these.
"""
