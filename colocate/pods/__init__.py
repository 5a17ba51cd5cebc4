"""GPU pods for a cell: RunPod (REST v2), Vast.ai, and a local stand-in.

Modules: ``errors`` (the PodError tree), ``http`` (a requests session with urllib3
retries), ``spec`` (the create request, from ``PodPlan.spec()``), ``runpod``,
``vastai``, ``local`` (the providers), ``readiness`` (health polling),
``standin/`` (the local OpenAI-compatible stand-in: server, refusals, runner, answers).
``scripts/pod.py`` is the CLI.
"""
