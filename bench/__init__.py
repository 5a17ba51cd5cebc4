"""Router benchmark: the floor (passthrough.js), the bench pod and clients, and the harness (harness.py)."""
