"""How many pods a cell runs, what they cost, and keeping them alive.

    policy.py      ``decide``: the pod count from the cell's counters (pure)
    keeper.py      one pass of reconciling what runs with what is declared (pure; providers injected)
    day.py         a day of demand priced three ways (pure; ``sandbox.py demo-autoscale``)
    cost.py        what a cell costs against the fallback API (pure; ``scripts/cost.py``)
    signals.py     the Worker's scale endpoints: the counters, the lock, the count every ``up`` applies
    controller.py  the controller: reads, decides, records, runs the owner's update (``scripts/scale.py``)
"""
