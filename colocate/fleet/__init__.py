"""A fleet: several cells behind one front door.

    plan.py     the fleet stack's settings, validation and ranking (pure; infra/fleet.py declares it)
    workerd.py  the front door in workerd, from a ``FleetPlan`` (the sandbox's fleet and the benches)
"""
