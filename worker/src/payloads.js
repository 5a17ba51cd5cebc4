// Every row that crosses a boundary, declared once: between an isolate and its generation's
// object (a sync's batch and answer), between a cell and a fleet's exchange, and what the
// operator endpoints answer. Rows are arrays (a sync stays small); their columns are named
// here and every reader and writer goes through these names, in JavaScript and in Python
// (colocate/payloads.py reads SHAPES from this file). docs/worker.md "Adding a counter".
//
// SHAPES is JSON as well as JavaScript (double quotes, no trailing commas, no comments
// inside it): each shape is its columns in order, [name, meaning].

export const SHAPES = {
  "counter": [
    ["minute", "the minute bucket (ms / 60000) that req and tok count"],
    ["req", "requests in bucket minute"],
    ["tok", "tokens in bucket minute"],
    ["prev_req", "requests in bucket minute - 1"],
    ["prev_tok", "tokens in bucket minute - 1"],
    ["month_tokens", "tokens this UTC month"],
    ["inflight", "requests in flight in the other isolates (as of their last sync)"]
  ],
  "exchange": [
    ["key_id", "the client key's id"],
    ["minute", "the minute bucket (ms / 60000) that req and tok count"],
    ["req", "requests in bucket minute"],
    ["tok", "tokens in bucket minute"],
    ["prev_req", "requests in bucket minute - 1"],
    ["prev_tok", "tokens in bucket minute - 1"],
    ["month", "the UTC month of month_tokens, YYYY-MM"],
    ["month_tokens", "tokens in month"]
  ],
  "lease": [
    ["key_id", "the client key's id"],
    ["req", "this cell's share of the key's rpm (null: no rpm limit)"],
    ["tok", "this cell's share of the key's tpm (null: no tpm limit)"],
    ["month", "the UTC month of month_tokens, YYYY-MM"],
    ["month_tokens", "this cell's share of the key's monthly tokens in month (null: no monthly limit)"]
  ],
  "usage": [
    ["day", "the UTC day, YYYY-MM-DD"],
    ["key_id", "the client key's id"],
    ["requests", "requests admitted"],
    ["prompt_tokens", "prompt tokens"],
    ["completion_tokens", "completion tokens"],
    ["pod_requests", "requests a pod answered"],
    ["fallback_requests", "requests the fallback answered"],
    ["estimated_tokens", "tokens counted from streamed text (no usage in the answer)"]
  ],
  "window": [
    ["key_id", "the client key's id"],
    ["minute", "the minute bucket (ms / 60000)"],
    ["requests", "requests admitted in it"],
    ["tokens", "tokens used in it"]
  ],
  "inflight": [
    ["key_id", "the client key's id"],
    ["n", "its requests in flight in this isolate now (0: none, the object's row goes)"]
  ]
};

/**
 * A shape's column indexes by name (`COUNTER.req` is 1), plus `names`, `columns` (the
 * names as a SQL column list), `length`, `zero`
 * (a row of zeros after the `first` columns given) and `of` (a row from a SQL record
 * whose columns carry the same names). worker/test/payloads.test.js checks that every
 * `SHAPE.name` in the sources names a declared column.
 * @param {[string, string][]} columns
 */
function shape(columns) {
  const names = columns.map(([n]) => n);
  /** @type {Record<string, number>} */
  const index = {};
  names.forEach((n, i) => {
    if (n in RESERVED) throw new Error(`column name ${n} is reserved`);
    index[n] = i;
  });
  return Object.freeze({
    ...index,
    names: Object.freeze(names),
    columns: names.join(", "),
    length: names.length,
    /** @param {...(string | number)} first */
    zero: (...first) => [...first, ...new Array(names.length - first.length).fill(0)],
    /** @param {Record<string, any>} record */
    of: (record) => names.map((n) => record[n]),
  });
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
