// @ts-check
// The generation object's SQLite schema: every piece of routed state a cell keeps.
//
// One object per generation holds it all, so the generation-rename migration moves all
// of it (migration.js):
//
//   meta          k/v: schema version, the operator override, the keys revision, which
//                 generations were imported (each once)
//   pod_health    per-pod breaker rows, keyed by the pod's URL; a healthy closed pod has
//                 no row (absent = closed, failures 0), so the healthy path writes nothing;
//                 `failure_keys`: the failure streak's sources (keys, health checks)
//   client_keys   client API keys: only the SHA-256 of each key is stored, never the key;
//                 `rev` is the keys revision at which the row last changed (created,
//                 revoked, imported), so a sync sends only rows changed since the caller's
//   usage_daily   per key and UTC day: requests, tokens (and how many were estimated),
//                 which backend served them
//   key_month     per key and UTC month: tokens, kept as batches arrive (the budget's input)
//   rate_window   per key and minute: requests and tokens, the input of rpm/tpm; rows
//                 older than the previous minute are deleted on every sync (by index)
//   key_inflight  per key and isolate: requests in flight as of that isolate's last sync
//                 (the input of max_parallel); rows of silent isolates expire (by index)
//   key_reserved  per key and isolate: tokens its requests in flight reserved at admission
//                 (the input of tpm and monthly_tokens while they run); expire as key_inflight
//   key_prompt    per key and isolate: prompt tokens of its requests in flight that no pod
//                 has begun answering (the input of max_parallel_tokens); expire as key_inflight
//   seg_minute    live segment histograms (histogram.js) per minute, colo, pod and segment:
//                 for the routed segments `colo` is where the Worker ran and `pod` the pod
//                 index or "fallback"; for `sync` `colo` is the state object's and `pod` the
//                 Worker's colo. Minutes older than 7 days roll up into
//   seg_hour      the same per hour; hours older than 35 days are dropped
//   seg_total     the same since the generation began, never dropped: the Prometheus
//                 histograms' cumulative counts (GET /_colocate/metrics)
//   key_changed   per key: the sequence number of the last batch that changed its own
//                 counters (rate_window, key_month); a fleet's exchange reads the keys
//                 changed since its cursor by index (docs/fleet.md, "Limits across cells")
//   peer_counters per key: the other cells of a fleet together, as the exchange last
//                 pushed them (minute buckets and month): the operator's view, never usage
//   key_lease     per key: this cell's lease in a fleet (its share of rpm, tpm, the month's
//                 tokens and the day's fallback cap), as the exchange last pushed it; with meta `fleet_cells`
//   backend_total per backend (pod-<i>, fallback, none): requests and tokens since the
//                 generation began; the scaling controller's demand signal (rates are
//                 differences between its reads)
//   fallback_spend per UTC day: what the fallback's answers cost the whole cell (the sum of
//                 usage_daily.fallback_microusd, kept as one row so the cell's daily cap
//                 reads one row; rebuilt from usage_daily when a generation is imported)
//   fallback_held per key and isolate: what its fallback requests in flight may still cost
//                 (reserved when the fallback is called, spendcap.js); expire as key_inflight
//   refusal_total per key and reason (refusals.js REASONS): the key's 429s since the
//                 generation began (GET /_colocate/metrics); each day's are usage_daily.refused
//   pod_inflight  per isolate and pod index: requests in flight there as of that isolate's
//                 last sync (a scale-down waits for its draining pods to read 0)
//   import_pulled per generation being imported (migration.js) and key: the keys whose rows
//                 were fetched ahead of the import because a call needed them; the paged
//                 import skips their rows (each row is added once). Emptied when it is done.
//
// Every sync reads and writes by primary key or index: no scan grows with the number of
// keys (docs/worker.md "State").

import { EXCHANGE, LEASE, REFUSAL, USAGE, WINDOW } from "./payloads.js";

export const SCHEMA_VERSION = "8";

export const SCHEMA = [
  `CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)`,
  `CREATE TABLE IF NOT EXISTS pod_health (
     pod TEXT PRIMARY KEY, state TEXT NOT NULL, failures INTEGER NOT NULL,
     opened_at INTEGER, trial_at INTEGER, updated_at INTEGER NOT NULL, failure_keys TEXT)`,
  `CREATE TABLE IF NOT EXISTS client_keys (
     id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, name TEXT NOT NULL,
     rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0, monthly_tokens INTEGER NOT NULL DEFAULT 0,
     created_at INTEGER NOT NULL, expires_at INTEGER, revoked_at INTEGER,
     max_parallel INTEGER NOT NULL DEFAULT 0, rev INTEGER NOT NULL DEFAULT 0,
     fallback_microusd_day INTEGER NOT NULL DEFAULT 0, max_parallel_tokens INTEGER)`,
  `CREATE TABLE IF NOT EXISTS usage_daily (
     day TEXT NOT NULL, key_id TEXT NOT NULL,
     requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
     completion_tokens INTEGER NOT NULL DEFAULT 0, pod_requests INTEGER NOT NULL DEFAULT 0,
     fallback_requests INTEGER NOT NULL DEFAULT 0, estimated_tokens INTEGER NOT NULL DEFAULT 0,
     fallback_microusd INTEGER NOT NULL DEFAULT 0, refused INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, key_id))`,
  `CREATE TABLE IF NOT EXISTS fallback_held (
     key_id TEXT NOT NULL, isolate TEXT NOT NULL, microusd INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (key_id, isolate))`,
  `CREATE TABLE IF NOT EXISTS refusal_total (key_id TEXT NOT NULL, reason TEXT NOT NULL, n INTEGER NOT NULL,
     PRIMARY KEY (key_id, reason))`,
  `CREATE TABLE IF NOT EXISTS fallback_spend (day TEXT PRIMARY KEY, microusd INTEGER NOT NULL DEFAULT 0)`,
  `CREATE TABLE IF NOT EXISTS key_month (
     key_id TEXT NOT NULL, month TEXT NOT NULL, tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (key_id, month))`,
  `CREATE TABLE IF NOT EXISTS rate_window (
     key_id TEXT NOT NULL, minute INTEGER NOT NULL,
     requests INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (key_id, minute))`,
  `CREATE TABLE IF NOT EXISTS key_inflight (
     key_id TEXT NOT NULL, isolate TEXT NOT NULL, n INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (key_id, isolate))`,
  `CREATE TABLE IF NOT EXISTS key_reserved (
     key_id TEXT NOT NULL, isolate TEXT NOT NULL, tokens INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (key_id, isolate))`,
  `CREATE TABLE IF NOT EXISTS key_prompt (
     key_id TEXT NOT NULL, isolate TEXT NOT NULL, tokens INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (key_id, isolate))`,
  // The primary keys lead with the time, so the window reads and the roll-up deletes are index ranges.
  `CREATE TABLE IF NOT EXISTS seg_minute (
     minute INTEGER NOT NULL, colo TEXT NOT NULL, pod TEXT NOT NULL, segment TEXT NOT NULL, hist TEXT NOT NULL,
     PRIMARY KEY (minute, colo, pod, segment))`,
  `CREATE TABLE IF NOT EXISTS key_changed (key_id TEXT PRIMARY KEY, seq INTEGER NOT NULL)`,
  `CREATE TABLE IF NOT EXISTS peer_counters (
     key_id TEXT PRIMARY KEY, minute INTEGER NOT NULL, req INTEGER NOT NULL, tok INTEGER NOT NULL,
     prev_req INTEGER NOT NULL, prev_tok INTEGER NOT NULL, month TEXT NOT NULL, month_tokens INTEGER NOT NULL,
     at INTEGER NOT NULL, day TEXT NOT NULL DEFAULT '', fallback_microusd INTEGER NOT NULL DEFAULT 0)`,
  `CREATE TABLE IF NOT EXISTS key_lease (
     key_id TEXT PRIMARY KEY, req INTEGER, tok INTEGER, month TEXT NOT NULL, month_tokens INTEGER, at INTEGER NOT NULL,
     day TEXT NOT NULL DEFAULT '', fallback_microusd INTEGER)`,
  `CREATE TABLE IF NOT EXISTS backend_total (
     backend TEXT PRIMARY KEY, requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL)`,
  `CREATE TABLE IF NOT EXISTS pod_inflight (
     isolate TEXT NOT NULL, pod INTEGER NOT NULL, n INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (isolate, pod))`,
  `CREATE TABLE IF NOT EXISTS seg_hour (
     hour INTEGER NOT NULL, colo TEXT NOT NULL, pod TEXT NOT NULL, segment TEXT NOT NULL, hist TEXT NOT NULL,
     PRIMARY KEY (hour, colo, pod, segment))`,
  `CREATE TABLE IF NOT EXISTS seg_total (
     colo TEXT NOT NULL, pod TEXT NOT NULL, segment TEXT NOT NULL, hist TEXT NOT NULL, PRIMARY KEY (colo, pod, segment))`,
  `CREATE TABLE IF NOT EXISTS import_pulled (src TEXT NOT NULL, key_id TEXT NOT NULL, PRIMARY KEY (src, key_id))`,
];

// Columns added since a table was first created: [table, column, declaration]. An object
// created by an older schema gets them by ALTER TABLE on load (generation.js `load`).
export const ADDED_COLUMNS = [
  ["pod_health", "failure_keys", "TEXT"],
  ["client_keys", "max_parallel", "INTEGER NOT NULL DEFAULT 0"],
  ["client_keys", "fallback_microusd_day", "INTEGER NOT NULL DEFAULT 0"],
  ["client_keys", "rev", "INTEGER NOT NULL DEFAULT 0"],
  // NULL for a key made before it: the cell's default (DEFAULT_MAX_PARALLEL_TOKENS) holds for it.
  ["client_keys", "max_parallel_tokens", "INTEGER"],
  ["usage_daily", "estimated_tokens", "INTEGER NOT NULL DEFAULT 0"],
  ["usage_daily", "fallback_microusd", "INTEGER NOT NULL DEFAULT 0"],
  // Schema 8: a key's refusals, and the day's fallback spend in the fleet's rows and leases.
  ["usage_daily", "refused", "INTEGER NOT NULL DEFAULT 0"],
  ["peer_counters", "day", "TEXT NOT NULL DEFAULT ''"],
  ["peer_counters", "fallback_microusd", "INTEGER NOT NULL DEFAULT 0"],
  ["key_lease", "day", "TEXT NOT NULL DEFAULT ''"],
  ["key_lease", "fallback_microusd", "INTEGER"],
];

// Created after ADDED_COLUMNS (an index on a column an old table lacks would fail).
export const INDEXES = [
  `CREATE INDEX IF NOT EXISTS client_keys_rev ON client_keys (rev)`,
  `CREATE INDEX IF NOT EXISTS rate_window_minute ON rate_window (minute)`,
  `CREATE INDEX IF NOT EXISTS key_inflight_at ON key_inflight (at)`,
  `CREATE INDEX IF NOT EXISTS key_reserved_at ON key_reserved (at)`,
  `CREATE INDEX IF NOT EXISTS key_prompt_at ON key_prompt (at)`,
  `CREATE INDEX IF NOT EXISTS key_changed_seq ON key_changed (seq)`,
  // A migration fetches a key's rows ahead of its import (migration.js): its usage by index.
  `CREATE INDEX IF NOT EXISTS usage_daily_key ON usage_daily (key_id)`,
  `CREATE INDEX IF NOT EXISTS fallback_held_at ON fallback_held (at)`,
];

export const KEY_COLUMNS = "id, hash, prefix, name, rpm, tpm, monthly_tokens, max_parallel, created_at, expires_at, revoked_at, "
  + "fallback_microusd_day, max_parallel_tokens";
// What an isolate holds of a key (no prefix, no timestamps it does not use).
export const KEY_VIEW_COLUMNS = "id, hash, name, rpm, tpm, monthly_tokens, max_parallel, expires_at, rev, revoked_at, fallback_microusd_day, "
  + "max_parallel_tokens";
// A sync's usage rows carry usage_daily's columns, in payloads.js USAGE's order.
export const USAGE_COLUMNS = USAGE.columns;

// Every usage column but the row's key (day, key_id) adds up.
const ADD_USAGE = USAGE.names.slice(USAGE.requests).map((n) => `${n} = ${n} + excluded.${n}`).join(", ");
export const UPSERT_USAGE = `INSERT INTO usage_daily (${USAGE_COLUMNS}) VALUES (${USAGE.names.map(() => "?").join(", ")})
  ON CONFLICT (day, key_id) DO UPDATE SET ${ADD_USAGE}`;

export const UPSERT_MONTH = `INSERT INTO key_month (key_id, month, tokens) VALUES (?, ?, ?)
  ON CONFLICT (key_id, month) DO UPDATE SET tokens = tokens + excluded.tokens`;

export const UPSERT_WINDOW = `INSERT INTO rate_window (key_id, minute, requests, tokens) VALUES (?, ?, ?, ?)
  ON CONFLICT (key_id, minute) DO UPDATE SET requests = requests + excluded.requests, tokens = tokens + excluded.tokens`;

// A whole batch part in one statement: `?` is the part's rows as a JSON array of arrays
// (one statement per table per sync instead of one per row), each column read by its
// name in payloads.js. `WHERE true` lets SQLite parse ON CONFLICT after a SELECT.
const col = (i) => `(value ->> ${i})`;
/** @param {{names: readonly string[]}} shape */
const all = (shape) => shape.names.map((_, i) => col(i)).join(", ");
export const BULK_USAGE = `INSERT INTO usage_daily (${USAGE_COLUMNS})
  SELECT ${all(USAGE)} FROM json_each(?) WHERE true
  ON CONFLICT (day, key_id) DO UPDATE SET ${ADD_USAGE}`;
const monthTokens = `${col(USAGE.prompt_tokens)} + ${col(USAGE.completion_tokens)}`;
export const BULK_MONTH = `INSERT INTO key_month (key_id, month, tokens)
  SELECT ${col(USAGE.key_id)}, substr(${col(USAGE.day)}, 1, 7), ${monthTokens} FROM json_each(?) WHERE ${monthTokens} > 0
  ON CONFLICT (key_id, month) DO UPDATE SET tokens = tokens + excluded.tokens`;
export const BULK_WINDOW = `INSERT INTO rate_window (${WINDOW.columns})
  SELECT ${all(WINDOW)} FROM json_each(?) WHERE ${col(WINDOW.minute)} >= ?
  ON CONFLICT (key_id, minute) DO UPDATE SET requests = requests + excluded.requests, tokens = tokens + excluded.tokens`;

// The exchange's rows (payloads.js EXCHANGE), one per key; peer_counters' columns carry its names.
export const UPSERT_PEERS = `INSERT INTO peer_counters (${EXCHANGE.columns}, at)
  SELECT ${all(EXCHANGE)}, ? FROM json_each(?) WHERE true
  ON CONFLICT (key_id) DO UPDATE SET ${[...EXCHANGE.names.filter((n) => n !== "key_id"), "at"].map((n) => `${n} = excluded.${n}`)
    .join(", ")}`;
// A fleet's leases (payloads.js LEASE), one per key; key_lease's columns carry its names (null: no such limit).
export const UPSERT_LEASES = `INSERT INTO key_lease (${LEASE.columns}, at)
  SELECT ${all(LEASE)}, ? FROM json_each(?) WHERE true
  ON CONFLICT (key_id) DO UPDATE SET ${[...LEASE.names.filter((n) => n !== "key_id"), "at"].map((n) => `${n} = excluded.${n}`)
    .join(", ")}`;
// A key's refusals by reason (payloads.js REFUSAL), added up.
export const BULK_REFUSALS = `INSERT INTO refusal_total (${REFUSAL.columns}) SELECT ${all(REFUSAL)} FROM json_each(?) WHERE true
  ON CONFLICT (key_id, reason) DO UPDATE SET n = n + excluded.n`;
// Each changed key its own sequence number ([[key_id, seq], ...]), so a reader pages by seq exactly.
export const MARK_CHANGED = `INSERT INTO key_changed (key_id, seq) SELECT ${col(0)}, ${col(1)} FROM json_each(?) WHERE true
  ON CONFLICT (key_id) DO UPDATE SET seq = excluded.seq`;

// What a migration imports of the replaced kind (a lease, the peers' sum, an isolate's requests
// in flight): a row this generation already holds was written after the move began, so it stays.
export const IMPORT_PEERS = `INSERT INTO peer_counters (${EXCHANGE.columns}, at)
  SELECT ${all(EXCHANGE)}, ? FROM json_each(?) WHERE true ON CONFLICT (key_id) DO NOTHING`;
export const IMPORT_LEASES = `INSERT INTO key_lease (${LEASE.columns}, at)
  SELECT ${all(LEASE)}, ? FROM json_each(?) WHERE true ON CONFLICT (key_id) DO NOTHING`;
export const IMPORT_INFLIGHT = `INSERT INTO key_inflight (key_id, isolate, n, at) VALUES (?, ?, ?, ?)
  ON CONFLICT (key_id, isolate) DO NOTHING`;

export const UPSERT_POD = `INSERT INTO pod_health (pod, state, failures, opened_at, trial_at, updated_at, failure_keys)
  VALUES (?, ?, ?, ?, ?, ?, ?)
  ON CONFLICT (pod) DO UPDATE SET state = excluded.state, failures = excluded.failures,
    opened_at = excluded.opened_at, trial_at = excluded.trial_at, updated_at = excluded.updated_at,
    failure_keys = excluded.failure_keys`;
