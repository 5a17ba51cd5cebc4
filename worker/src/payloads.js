// @ts-check
// Every row that crosses a boundary, declared once: between an isolate and its generation's
// object (a sync's batch and answer), between a cell and a fleet's exchange, and what the
// operator endpoints answer. Rows are arrays (a sync stays small); their columns are named
// here and every reader and writer goes through these names, in JavaScript and in Python
// (colocate/cell/payloads.py reads SHAPES from this file). docs/worker.md "Adding a counter".
//
// SHAPES is JSON as well as JavaScript inside its parentheses (double quotes, no trailing
// commas, no comments): each shape is its columns in order, [name, meaning].

export const SHAPES = /** @type {const} */ ({
  "counter": [
    ["minute", "the minute bucket (ms / 60000) that req and tok count"],
    ["req", "requests in bucket minute"],
    ["tok", "tokens in bucket minute"],
    ["prev_req", "requests in bucket minute - 1"],
    ["prev_tok", "tokens in bucket minute - 1"],
    ["month_tokens", "tokens this UTC month"],
    ["inflight", "requests in flight in the other isolates (as of their last sync)"],
    ["day_fallback_microusd", "the fallback's cost of this key's requests on the UTC day of minute, in millionths of a dollar"],
    ["reserved", "tokens the other isolates' requests in flight may still use, reserved at admission (as of their last sync)"],
    ["prompt_inflight", "prompt tokens of the other isolates' requests in flight that no pod has begun answering (as of their last sync)"],
    ["fallback_reserved", "what the other isolates' fallback requests of this key in flight may still cost, in millionths of a dollar"]
  ],
  "exchange": [
    ["key_id", "the client key's id"],
    ["minute", "the minute bucket (ms / 60000) that req and tok count"],
    ["req", "requests in bucket minute"],
    ["tok", "tokens in bucket minute"],
    ["prev_req", "requests in bucket minute - 1"],
    ["prev_tok", "tokens in bucket minute - 1"],
    ["month", "the UTC month of month_tokens, YYYY-MM"],
    ["month_tokens", "tokens in month"],
    ["day", "the UTC day of fallback_microusd, YYYY-MM-DD (\"\": none)"],
    ["fallback_microusd", "what the fallback's answers of the key cost on day, in millionths of a dollar"]
  ],
  "lease": [
    ["key_id", "the client key's id"],
    ["req", "this cell's share of the key's rpm (null: no rpm limit)"],
    ["tok", "this cell's share of the key's tpm (null: no tpm limit)"],
    ["month", "the UTC month of month_tokens, YYYY-MM"],
    ["month_tokens", "this cell's share of the key's monthly tokens in month (null: no monthly limit)"],
    ["day", "the UTC day of fallback_microusd, YYYY-MM-DD (\"\": none)"],
    ["fallback_microusd", "this cell's share of the key's daily fallback cap on day, millionths of a dollar (null: no cap)"]
  ],
  "usage": [
    ["day", "the UTC day, YYYY-MM-DD"],
    ["key_id", "the client key's id"],
    ["requests", "requests admitted"],
    ["prompt_tokens", "prompt tokens"],
    ["completion_tokens", "completion tokens"],
    ["pod_requests", "requests a pod answered"],
    ["fallback_requests", "requests the fallback answered"],
    ["estimated_tokens", "tokens counted from streamed text (no usage in the answer)"],
    ["fallback_microusd", "what the fallback's answers cost at FALLBACK_PRICE, in millionths of a dollar"],
    ["refused", "requests refused with a 429 (a limit, a lease, the fallback's spend cap)"]
  ],
  "fallback_held": [
    ["key_id", "the client key's id"],
    ["microusd", "what this isolate's fallback requests of the key in flight may still cost (0: none, the row goes)"]
  ],
  "refusal": [
    ["key_id", "the client key's id"],
    ["reason", "the limit that refused it: refusals.js REASONS"],
    ["n", "refusals since the last sync"]
  ],
  "window": [
    ["key_id", "the client key's id"],
    ["minute", "the minute bucket (ms / 60000)"],
    ["requests", "requests admitted in it"],
    ["tokens", "tokens used in it"]
  ],
  "inflight": [
    ["key_id", "the client key's id"],
    ["n", "its requests in flight in this isolate now (0: none, the object's row goes)"],
    ["tokens", "the tokens those requests reserved at admission (their ceilings, usage.js usageCeiling)"],
    ["prompt", "the prompt tokens of those requests that no pod has begun answering (max_parallel_tokens)"]
  ],
  "hist": [
    ["at", "the minute (ms / 60000), or the hour (ms / 3600000) in seg_hour"],
    ["colo", "routed segments: where the Worker ran; sync: where the state object answered"],
    ["who", "routed segments: the pod index or fallback, @<client colo> behind a front door; sync: the Worker's colo"],
    ["segment", "state, upstream, fallback, total or sync"],
    ["hist", "the histogram's text, ~gap*count,... (histogram.js)"]
  ],
  "backend": [
    ["backend", "who answered: pod-<i>, fallback, or none (a fleet's front door took it elsewhere)"],
    ["requests", "requests it answered since the last sync"],
    ["prompt_tokens", "their prompt tokens"],
    ["completion_tokens", "their completion tokens"]
  ],
  "pod_inflight": [
    ["pod", "the pod's index in POD_URLS"],
    ["n", "requests this isolate has in flight there now"]
  ]
});

/**
 * A shape's column indexes by name (`COUNTER.req` is 1), plus `names`, `columns` (the
 * names as a SQL column list), `length`, `zero`
 * (a row of zeros after the `first` columns given) and `of` (a row from a SQL record
 * whose columns carry the same names). tsc and tests/test_payloads.py check that every
 * `SHAPE.name` in the sources names a declared column.
 * @template {string} N
 * @param {ReadonlyArray<readonly [N, string]>} columns
 * @returns {Readonly<Record<N, number> & {names: readonly N[], columns: string, length: number,
 *   zero: (...first: (string | number)[]) => any[], of: (record: Record<string, any>) => any[]}>}
 */
function shape(columns) {
  const names = columns.map(([n]) => n);
  /** @type {Record<string, number>} */
  const index = {};
  names.forEach((n, i) => {
    if (n in RESERVED) throw new Error(`column name ${n} is reserved`);
    index[n] = i;
  });
  return /** @type {any} */ (Object.freeze({
    ...index,
    names: Object.freeze(names),
    columns: names.join(", "),
    length: names.length,
    /** @param {...(string | number)} first */
    zero: (...first) => [...first, ...new Array(names.length - first.length).fill(0)],
    /** @param {Record<string, any>} record */
    of: (record) => names.map((n) => record[n]),
  }));
}

const RESERVED = { names: 1, columns: 1, length: 1, zero: 1, of: 1 };

/** One key's counters in a sync's answer (`counts[id]`), as limits.js reads them. */
export const COUNTER = shape(SHAPES.counter);
/** One key's counters as a fleet's exchange carries them (one cell's, or the other cells' sum); peer_counters' columns. */
export const EXCHANGE = shape(SHAPES.exchange);
/** A cell's lease of one key as a fleet's exchange pushes it (key_lease's columns). */
export const LEASE = shape(SHAPES.lease);
/** A sync batch's `usage` row: one key's usage on one day (usage_daily's columns, same names). */
export const USAGE = shape(SHAPES.usage);
/** A sync batch's `windows` row: one key's requests and tokens in one minute (rate_window). */
export const WINDOW = shape(SHAPES.window);
/** A sync batch's `inflight` row. */
export const INFLIGHT = shape(SHAPES.inflight);
/** A sync batch's `fallback_held` row: a key's fallback spend reserved in this isolate (fallback_held's columns). */
export const FALLBACK_HELD = shape(SHAPES.fallback_held);
/** A sync batch's `refusals` row: one key's 429s for one reason (refusal_total's columns). */
export const REFUSAL = shape(SHAPES.refusal);
/** A sync batch's `hist` row (seg_minute's), and GET /_colocate/live's `minutes` and `hours`. */
export const HIST = shape(SHAPES.hist);
/** A sync batch's `backends` row: the scaling controller's demand signal (backend_total). */
export const BACKEND = shape(SHAPES.backend);
/** A sync batch's `pods` row: every pod of this isolate's POD_URLS, whenever one's count moved (pod_inflight). */
export const POD_INFLIGHT = shape(SHAPES.pod_inflight);

// --- the shapes of the objects that cross a boundary (JSDoc; tsc checks their use) ---

/**
 * The cell Worker's bindings (colocate/cell/plan.py `worker_bindings` generates them; config.js
 * reads and checks them). Numbers arrive as text.
 * @typedef {object} Env
 * @property {DurableObjectNamespace<import("./generation.js").Breaker>} BREAKER  the generation objects (class Breaker)
 * @property {string} ACTIVE_GENERATION
 * @property {string} [ACTIVE_HINT]
 * @property {string} [DRAINING_GENERATION]
 * @property {string} [DRAINING_HINT]
 * @property {string} [CELL_REGION]
 * @property {string} POD_URLS  a JSON array of the pods' base URLs
 * @property {string} POD_TOKEN
 * @property {string} PROBE_TOKEN
 * @property {string} FALLBACK_URL
 * @property {string} FALLBACK_API_KEY
 * @property {string} FALLBACK_MODEL
 * @property {string} [DEADLINE_MS]
 * @property {string} [MAX_BODY_BYTES]
 * @property {string} [FAILURE_THRESHOLD]
 * @property {string} [OPEN_MS]
 * @property {string} [STATE_TTL_MS]
 * @property {string} [SERVED_KEEP_MS]
 * @property {string} [DEFAULT_MAX_PARALLEL]
 * @property {string} [DEFAULT_MAX_PARALLEL_TOKENS]
 * @property {string} [BODY_TIMEOUT_MS]
 */

/**
 * The fleet front door's bindings (colocate/fleet/plan.py generates them; fleetfront.js reads them).
 * @typedef {object} FrontEnv
 * @property {DurableObjectNamespace<import("./fleetledger.js").FleetLedger>} LEDGER  the limits exchange
 * @property {string} CELLS  the member cells, JSON
 * @property {string} [EXCHANGE_MS]
 * @property {string} [REMEMBER_MS]
 * @property {string} [MAX_BODY_BYTES]
 */

/**
 * What every call from an isolate to its generation's object carries (state.js `infoOf`).
 * @typedef {object} SyncInfo
 * @property {string} generation
 * @property {string | null} draining
 * @property {string | null} [drainingHint]
 * @property {number} failureThreshold
 * @property {number} openMs
 * @property {number} deadlineMs
 * @property {number} haveRev  the keys revision the isolate holds (-1: none)
 * @property {string} isolate
 * @property {number} ttlMs
 * @property {string[]} keys  the ids whose counters a sync asks for
 * @property {string[]} [lookup]  digests to look up in the same round trip
 * @property {boolean} [capCell]  the cell's fallback spend is capped: the answer carries `spent`
 * @property {boolean} [capKeys]  each key's fallback spend is capped: its counters carry day_fallback_microusd
 * @property {number} [keyCap]  colocate:fallbackCap.keyUsdPerDay in millionths of a dollar: a key without a cap of its own has it
 */

/**
 * A sync's batch: each part's rows in the shape named above (hist: histogram.js rows).
 * @typedef {object} SyncBatch
 * @property {any[][]} [usage]  USAGE rows
 * @property {any[][]} [windows]  WINDOW rows
 * @property {any[][]} [inflight]  INFLIGHT rows
 * @property {any[][]} [refusals]  REFUSAL rows
 * @property {any[][]} [fallback_held]  FALLBACK_HELD rows
 * @property {any[][]} [hist]  [minute, colo, pod, segment, "index:count,..."]
 */

/**
 * A sync's answer (generation.js `view`): what the isolate caches.
 * @typedef {object} SyncAnswer
 * @property {number} rev
 * @property {object[] | null} keys  the key rows changed since `haveRev` (null: none changed)
 * @property {boolean} more
 * @property {boolean} [reset]
 * @property {Record<string, object>} pods  per-pod breaker rows by URL
 * @property {Record<string, number[]>} counts  COUNTER rows of the keys asked for
 * @property {string | null} forced
 * @property {string[]} imported
 * @property {{from: string, rows: number, total: number, part: string | null, started: number}[]} [importing]  migrations under way: how far each import is
 * @property {number} at
 * @property {string | null} [colo]
 * @property {Record<string, object>} [leases]  in a fleet: this cell's leases of the keys asked for
 * @property {number} [fleet_cells]  in a fleet: its size, for the default share of a key not asked for yet
 * @property {{day: string, microusd: number, reserved?: number}} [spent]  the fallback's cost to the cell today, and what
 *   the other isolates' fallback requests in flight reserved (with `capCell`)
 * @property {{keys: object[], counts: Record<string, number[]>}} [found]  the look-up's answer
 * @property {Uint8Array} [key_filter]  to an isolate starting its key list: keyfilter.js's filter of the keys
 */

/**
 * A cell's answer to the exchange's pull (GET /_colocate/fleet/counters).
 * @typedef {object} CountersAnswer
 * @property {string} generation
 * @property {number} cursor
 * @property {boolean} more
 * @property {boolean} reset
 * @property {any[][]} rows  EXCHANGE rows
 * @property {Record<string, {rpm: number, tpm: number, monthly_tokens: number, fallback_microusd_day?: number}>} [limits]
 *   each key's limits for the ledger (fallback_microusd_day: its daily fallback cap as this cell holds it: its own, else the cell's)
 * @property {number | null} [ttl_ms]  how long this cell's isolates may go on using a lease after it is replaced
 */

/**
 * One key's counters in a cell (GET /_colocate/fleet/peers?key=): the operator's view.
 * @typedef {object} PeersAnswer
 * @property {string} key_id
 * @property {object | null} peers  the peer_counters record (EXCHANGE's names, plus `at`)
 * @property {number[] | null} own  COUNTER row of this cell's own traffic
 * @property {number[] | null} [counts]  COUNTER row as a sync answers it
 * @property {object | null} [lease]  the key's lease from the ledger
 * @property {number | null} [fleet_cells]  the cells of the fleet, as the ledger last said
 */
