"""colocate: one cell = Worker placement + Durable Object generation + GPU pod, from one region.

This package holds the pure layers (catalogue, settings, ledger, plan) and the
runtime libraries the scripts use. Nothing here imports Pulumi: the Pulumi
components live in ``infra/`` and only declare what a ``CellPlan`` says.
"""

PROJECT = "colocate"
