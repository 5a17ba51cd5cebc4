"""Pulumi components: they declare what a ``colocate.plan.CellPlan`` says and decide nothing."""
