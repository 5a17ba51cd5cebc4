// The generation object's SQLite schema: every piece of routed state a cell keeps.
//
// One object per generation holds it all, so the generation-rename migration moves all
// of it at once (generation.js `exportAll` / `importFrom`):
//
//   meta         k/v: schema version, the operator override, the keys revision, which
//                generations were imported (each once)
//   pod_health   per-pod breaker rows, keyed by the pod's URL; a healthy closed pod has
//                no row (absent = closed, failures 0), so the healthy path writes nothing
//   client_keys  client API keys: only the SHA-256 of each key is stored, never the key
//   usage_daily  per key and UTC day: requests, tokens, which backend served them
//   rate_window  per key and minute: requests and tokens, the input of the limits;
//                rows older than the previous minute are deleted on every sync
//   seg_minute   live segment histograms (histogram.js) per minute, colo, pod and segment:
//                for the routed segments `colo` is where the Worker ran and `pod` the pod
//                index or "fallback"; for `sync` `colo` is the state object's and `pod` the
//                Worker's colo. Minutes older than 7 days roll up into
//   seg_hour     the same per hour; hours older than 35 days are dropped
//
// The isolate caches a view of meta, pod_health, the active keys and the current
// counters (state.js); nothing here is read on the hot path while that view is fresh.

export const SCHEMA_VERSION = "2";

export const SCHEMA = [
  `CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)`,
  `CREATE TABLE IF NOT EXISTS pod_health (
     pod TEXT PRIMARY KEY, state TEXT NOT NULL, failures INTEGER NOT NULL,
     opened_at INTEGER, trial_at INTEGER, updated_at INTEGER NOT NULL, failure_keys TEXT)`,
  `CREATE TABLE IF NOT EXISTS client_keys (
     id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, name TEXT NOT NULL,
     rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0, monthly_tokens INTEGER NOT NULL DEFAULT 0,
     created_at INTEGER NOT NULL, expires_at INTEGER, revoked_at INTEGER)`,
  `CREATE TABLE IF NOT EXISTS usage_daily (
     day TEXT NOT NULL, key_id TEXT NOT NULL,
     requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
     completion_tokens INTEGER NOT NULL DEFAULT 0, pod_requests INTEGER NOT NULL DEFAULT 0,
     fallback_requests INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, key_id))`,
  `CREATE TABLE IF NOT EXISTS rate_window (
     key_id TEXT NOT NULL, minute INTEGER NOT NULL,
     requests INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (key_id, minute))`,
  // The primary keys lead with the time, so the window reads and the roll-up deletes are index ranges.
  `CREATE TABLE IF NOT EXISTS seg_minute (
     minute INTEGER NOT NULL, colo TEXT NOT NULL, pod TEXT NOT NULL, segment TEXT NOT NULL, hist TEXT NOT NULL,
     PRIMARY KEY (minute, colo, pod, segment))`,
  `CREATE TABLE IF NOT EXISTS seg_hour (
     hour INTEGER NOT NULL, colo TEXT NOT NULL, pod TEXT NOT NULL, segment TEXT NOT NULL, hist TEXT NOT NULL,
     PRIMARY KEY (hour, colo, pod, segment))`,
];

export const KEY_COLUMNS = "id, hash, prefix, name, rpm, tpm, monthly_tokens, created_at, expires_at, revoked_at";
export const USAGE_COLUMNS = "day, key_id, requests, prompt_tokens, completion_tokens, pod_requests, fallback_requests";

export const UPSERT_USAGE = `INSERT INTO usage_daily (${USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)
  ON CONFLICT (day, key_id) DO UPDATE SET
    requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    pod_requests = pod_requests + excluded.pod_requests, fallback_requests = fallback_requests + excluded.fallback_requests`;

export const UPSERT_WINDOW = `INSERT INTO rate_window (key_id, minute, requests, tokens) VALUES (?, ?, ?, ?)
  ON CONFLICT (key_id, minute) DO UPDATE SET requests = requests + excluded.requests, tokens = tokens + excluded.tokens`;

export const UPSERT_POD = `INSERT INTO pod_health (pod, state, failures, opened_at, trial_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)
  ON CONFLICT (pod) DO UPDATE SET state = excluded.state, failures = excluded.failures,
    opened_at = excluded.opened_at, trial_at = excluded.trial_at, updated_at = excluded.updated_at`;
