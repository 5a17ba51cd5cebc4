"""Stack output names: the program exports them, the scripts read them, tests check them."""

WORKER_URL = "workerUrl"
WORKER_NAME = "workerName"
POD_ID = "podId"
POD_LOCATION = "podLocation"
POD_COST_PER_HR = "podCostPerHr"
POD_URL = "podUrl"  # pod 0's address as the provider reports it (not what the Worker uses)
POD_IDS = "podIds"  # every pod, index order (podId/podLocation/podCostPerHr describe pod 0)
POD_LOCATIONS = "podLocations"
PODS_COST_PER_HR = "podsCostPerHr"  # the cell's pods together, $/hr as the providers report
POD_PATH = "podPath"  # how the Worker reaches the pods: zone-dns | provider-proxy | local-hostname
ACTIVE_GENERATION = "activeGeneration"
ACTIVE_HINT = "activeHint"
DRAINING_GENERATION = "drainingGeneration"
PLACEMENT = "placement"
PLACEMENT_MODE = "placementMode"  # pod | targeted | smart: what colocate:worker.placement resolved to
PLACEMENT_HOST = "placementHost"  # pod mode: the host:port Cloudflare probes (pod 0); else null
PROBE_VERDICT = "probeVerdict"
READ_TOKEN = "readToken"  # secret outputs: probe.py --stack reads this one,
ADMIN_TOKEN = "adminToken"  # keys.py and migrate.py this one,
EXCHANGE_TOKEN = "exchangeToken"  # and a fleet's front door this one
PROBE_TOKEN = "probeToken"  # an older release's single token: read where the new ones are missing
OPERATOR_TOKENS = {"READ_TOKEN": READ_TOKEN, "ADMIN_TOKEN": ADMIN_TOKEN, "EXCHANGE_TOKEN": EXCHANGE_TOKEN}  # by Worker binding
REGION = "region"  # the cell's region: a fleet stack reads it (with workerName, workerUrl, accountId)
ACCOUNT_ID = "accountId"  # the cell's Cloudflare account: a fleet binds only Workers of its own account
HOP_NOT_AFTER = "hopCertsNotAfter"  # the pod hop's earliest certificate's end (null: no mutual TLS): colocate/cell/certexpiry.py
POD_SCOPE = "podScope"  # plan.pod_scope of the stack's organization and project, in its pods' names: `pod.py sweep --scope`
WORKER_CONTENT_HASH = "workerContentHash"  # plan.WorkerPlan.content_hash of the modules uploaded (the Worker says it too)
POD_ADDRESSES = "podAddresses"  # every pod's {ip, port} as its create saw them, index order: the keeper's "remapped"
HOP_CERTS = "hopCerts"  # {cell, pod-<i>: not-after} of the hop's certificates (null: no mutual TLS): the keeper renews them
BUDGET_E2E_MS = "budgetE2eMs"  # the cell's colocate:budgets.e2e (null: none): a fleet sends its users no farther
CELLS = "cells"  # a fleet stack's members: [{name, stack, region, workerName, workerUrl}]

ALL = (WORKER_URL, WORKER_NAME, POD_ID, POD_LOCATION, POD_COST_PER_HR, POD_URL, POD_IDS, POD_LOCATIONS,
       PODS_COST_PER_HR, POD_PATH, ACTIVE_GENERATION,
       ACTIVE_HINT, DRAINING_GENERATION, PLACEMENT, PLACEMENT_MODE, PLACEMENT_HOST, PROBE_VERDICT, READ_TOKEN,
       ADMIN_TOKEN, EXCHANGE_TOKEN,
       REGION, ACCOUNT_ID, BUDGET_E2E_MS, HOP_NOT_AFTER, POD_SCOPE, WORKER_CONTENT_HASH, POD_ADDRESSES, HOP_CERTS)
FLEET_ALL = (WORKER_URL, WORKER_NAME, CELLS)
