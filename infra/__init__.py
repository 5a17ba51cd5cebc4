"""Pulumi components: they declare what a ``colocate.cell.plan.CellPlan`` says and decide nothing."""
