"""A cell's planning, pure: settings in, everything a cell is made of out; no Pulumi, no processes.

    catalogue, geo      the regions and what each derives; colo coordinates and the round-trip floor
    settings, ledger    the ``colocate:*`` keys and their validation; the generations and their transitions
    endpoints           a cell of endpoints the team already runs (``pod.provider: existing``)
    plan, migration     the ``CellPlan`` both realisations consume; what a move of the ledger does
    rollout, capacity   how the pods change when the plan does; what one pod serves, how long it boots
    preflight, certexpiry, cloudflare_limits   checks before a pod is rented; the hop's certificate dates; upload limits
    outputs, payloads, urns   the names the program, the Worker and the scripts share
"""
