"""colocate: one cell = Worker placement + Durable Object generation + GPU pod, from one region.

Packages by concern: ``cell`` (the cell's pure planning), ``fleet``, ``scaling``, ``pods``, ``probe``,
``sandbox``; beside them a few shared modules (errors, cli, stackfile, projectfile, workerd, admin).
The pure layer imports no Pulumi: the Pulumi components live in ``infra/`` and only declare what a
``CellPlan`` says (docs/how-it-works.md, "Where the code is").
"""

PROJECT = "colocate"
