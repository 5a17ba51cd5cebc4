"""Stack output names: the program exports them, the scripts read them, tests check them."""

WORKER_URL = "workerUrl"
WORKER_NAME = "workerName"
POD_ID = "podId"
POD_LOCATION = "podLocation"
POD_COST_PER_HR = "podCostPerHr"
POD_URL = "podUrl"
ACTIVE_GENERATION = "activeGeneration"
ACTIVE_HINT = "activeHint"
DRAINING_GENERATION = "drainingGeneration"
PLACEMENT = "placement"
PROBE_VERDICT = "probeVerdict"
PROBE_TOKEN = "probeToken"  # secret output: probe.py --stack reads it

ALL = (WORKER_URL, WORKER_NAME, POD_ID, POD_LOCATION, POD_COST_PER_HR, POD_URL, ACTIVE_GENERATION,
       ACTIVE_HINT, DRAINING_GENERATION, PLACEMENT, PROBE_VERDICT, PROBE_TOKEN)
