// @ts-check
// A generation's migration: the successor imports the draining generation's state while it
// serves (docs/migration.md, "How the state moves").
//
// - The head, once, before the first call that names the draining generation is answered
//   (one round trip): the operator override, the fleet's size, the controller's pod count,
//   the fallback's spend per day, which generations the exporter had imported, and how
//   many rows each part holds; a generation of at most EXPORT_ROWS rows comes whole with it.
//   From then on the exporter forwards late batches here.
// - The rows, paged (EXPORT_ROWS a call, by rowid) and merged MERGE_ROWS at a time, each
//   chunk in its own transaction with the cursor after it (meta `importing:<name>`), by
//   the object's alarm in slices of PUMP_SLICE_MS: a reset, an eviction or a failed call
//   resumes at the cursor, and a chunk whose cursor moved is not applied again. Counters
//   add up (this generation counts new traffic meanwhile); replaced rows (leases, peers,
//   requests in flight) keep what this generation already holds.
// - Ahead of the import, a call that needs a key's rows (its counters for a sync, its row
//   for a look-up, a revocation, the exchange) fetches all of them from the exporter
//   (exportKeys) and records the key in import_pulled: the paged import skips that key's
//   rows, and the fetch skips rows the paged import already merged, so each row counts once.
// - Whole-table reads (usage, the live view, metrics, the key list) add the exporter's rows
//   the import has not reached yet (exportRange), so no count is missing meanwhile.
// When the cursor passes the last part, `imported:<name>` is recorded; until then the
// router's purge of that generation is refused (admin.js) and `migrate.py finish` refuses.

import { BULK_REFUSALS, KEY_COLUMNS, IMPORT_INFLIGHT, IMPORT_LEASES, IMPORT_PEERS, UPSERT_MONTH, UPSERT_USAGE, UPSERT_WINDOW, USAGE_COLUMNS } from "./schema.js";
import { EXCHANGE, LEASE } from "./payloads.js";

export const EXPORT_ROWS = 5000; // rows of one export page, from as many parts as fit
export const MERGE_ROWS = 500; // rows merged per transaction: what a concurrent call may wait behind
export const PUMP_SLICE_MS = 10_000; // one alarm's run; the next alarm goes on at once
const PULL_IDS = 100; // keys per exportKeys call
const RANGE_PAGES = 200; // exportRange pages one whole-table read takes at most
const RETRY_MS = 60_000; // the longest wait after failed calls to the exporter
// The most rows the import holds in memory at once (an export page): a test reads it.
export const importMemory = { peakRows: 0 };

const seg = (t) => (r) => [r[t], r.colo, r.pod, r.segment, r.hist];

/**
 * What the import carries, in order: [name, table, columns, key column (null: not a key's row), row shape].
 * The keyed parts come first, so fetches ahead of the import stop early; the histograms, the
 * bulk of a generation (seg_minute: 7 days of minutes x colo x pod x segment), come last.
 * @type {Array<[string, string, string, string | null, ((r: any) => unknown) | null]>}
 */
export const PARTS = [
  ["keys", "client_keys", KEY_COLUMNS, "id", null],
  ["leases", "key_lease", LEASE.columns, "key_id", null],
  ["peers", "peer_counters", EXCHANGE.columns, "key_id", null],
  ["windows", "rate_window", "key_id, minute, requests, tokens", "key_id", null],
  ["inflight", "key_inflight", "key_id, isolate, n, at", "key_id", null],
  ["months", "key_month", "key_id, month, tokens", "key_id", null],
  ["usage", "usage_daily", USAGE_COLUMNS, "key_id", null],
  ["refusals", "refusal_total", "key_id, reason, n", "key_id", null],
  ["seg_total", "seg_total", "colo, pod, segment, hist", null, (r) => [r.colo, r.pod, r.segment, r.hist]],
  ["seg_hour", "seg_hour", "hour, colo, pod, segment, hist", null, seg("hour")],
  ["seg_minute", "seg_minute", "minute, colo, pod, segment, hist", null, seg("minute")],
];
const INDEX = new Map(PARTS.map(([name], i) => [name, i]));
export const KEYED = PARTS.findIndex((p) => p[3] === null); // parts [0, KEYED) hold a key's rows

// Filters a whole-table read passes to the exporter: [SQL, its arguments].
/** @type {Record<string, (f: any) => [string, unknown[]]>} */
const FILTERS = {
  usage: (f) => (f.key ? ["day >= ? AND day <= ? AND key_id = ?", [f.from, f.to, f.key]] : ["day >= ? AND day <= ?", [f.from, f.to]]),
  seg_minute: (f) => ["minute >= ?", [f.since]],
  seg_hour: (f) => ["hour >= ?", [f.since]],
};

const progressKey = (from) => `importing:${from}`;
const yieldTurn = () => new Promise((resolve) => setTimeout(resolve, 0));

// --- the exporter (the draining generation) ---

/**
 * The head of an export (see the header). `successor` is recorded: the usage batches that
 * still reach this generation go on to it (generation.js `sync`).
 * @param {any} g  the exporting object
 */
export function exportHead(g, successor) {
  const busy = running(g);
  if (busy.length) {
    // Its rows still change: a successor reading them now would miss what arrives later.
    throw new Error(`this generation is still importing ${busy.join(", ")}; its successor imports it once that is done`);
  }
  if (successor) g.setMeta("successor", successor);
  const counts = {};
  for (const [name, table] of PARTS) counts[name] = g.sql.exec(`SELECT COUNT(*) AS n FROM ${table}`).one().n;
  // A small generation goes whole with its head: its successor's first answer has it all, in one round trip.
  const small = Object.values(counts).reduce((a, b) => a + b, 0) <= EXPORT_ROWS;
  return {
    first: small ? exportPage(g, null) : null,
    forced: g.meta("forced"),
    fleet_cells: g.meta("fleet_cells"),
    scale_desired: g.meta("scale_desired"),
    imported: g.sql.exec("SELECT k FROM meta WHERE k LIKE 'imported:%'").toArray().map((r) => r.k.slice(9)),
    spend: g.sql.exec("SELECT day, microusd FROM fallback_spend").toArray().map((r) => [r.day, r.microusd]),
    counts,
  };
}

/** One part's rows after exporter rowid `after`, at most `limit`, with their rowids. */
function rowsAfter(g, part, after, limit, where = null, args = []) {
  const [, table, columns, , shape] = PARTS[part];
  const rows = g.sql.exec(`SELECT rowid AS _r, ${columns} FROM ${table} WHERE rowid > ?${where ? ` AND ${where}` : ""}
    ORDER BY rowid LIMIT ?`, after, ...args, limit).toArray();
  const rowids = rows.map((r) => r._r);
  for (const r of rows) delete r._r;
  return { rows: shape ? rows.map(shape) : rows, rowids };
}

/**
 * A page of the export: at most EXPORT_ROWS rows, from as many parts as fit, after `cursor`
 * ({part, after}: a part's index and the last exporter rowid taken; null starts over):
 * {parts: [[name, rows, rowids], ...], next} (next null: the end). Rowids are stable: the
 * tables do not change once the successor is recorded (batches go on to it).
 */
export function exportPage(g, cursor) {
  if (cursor && !Number.isSafeInteger(cursor.after)) {
    throw new Error("an export cursor without `after` (an importer of an earlier version): it starts again once both run this one");
  }
  /** @type {{part: number, after: number} | null} */
  let at = cursor ? { part: cursor.part, after: cursor.after } : { part: 0, after: 0 };
  let room = EXPORT_ROWS;
  const parts = [];
  while (at && room > 0) {
    const { rows, rowids } = rowsAfter(g, at.part, at.after, room + 1);
    const more = rows.length > room;
    if (more) {
      rows.length = room;
      rowids.length = room;
    }
    parts.push([PARTS[at.part][0], rows, rowids]);
    room -= rows.length;
    at = more ? { part: at.part, after: rowids[rowids.length - 1] }
      : at.part + 1 < PARTS.length ? { part: at.part + 1, after: 0 } : null;
  }
  return { parts, next: at };
}

/**
 * Every row of the keys named by id or digest, in the keyed parts: {ids, parts: [[name,
 * rows, rowids], ...]}, `ids` the keys asked for and those the digests found.
 */
export function exportKeys(g, ids, digests) {
  const found = digests.length
    ? g.sql.exec("SELECT id FROM client_keys WHERE hash IN (SELECT value FROM json_each(?))", JSON.stringify(digests)).toArray().map((r) => r.id)
    : [];
  const all = [...new Set([...ids, ...found])];
  const list = JSON.stringify(all);
  const parts = [];
  for (let part = 0; part < KEYED; part++) {
    const { rows, rowids } = rowsAfter(g, part, 0, Number.MAX_SAFE_INTEGER, `${PARTS[part][3]} IN (SELECT value FROM json_each(?))`, [list]);
    parts.push([PARTS[part][0], rows, rowids]);
  }
  return { ids: all, parts };
}

/** A part's rows after rowid `after` that `filter` selects (FILTERS), a page: {rows, rowids, more}. */
export function exportRange(g, name, after, filter) {
  const part = INDEX.get(name);
  if (part === undefined) throw new TypeError(`no export part ${name}`);
  const [where, args] = FILTERS[name] ? FILTERS[name](filter ?? {}) : [null, []];
  const { rows, rowids } = rowsAfter(g, part, after, EXPORT_ROWS + 1, where, args);
  const more = rows.length > EXPORT_ROWS;
  if (more) {
    rows.length = EXPORT_ROWS;
    rowids.length = EXPORT_ROWS;
  }
  return { rows, rowids, more };
}

/** Key counts (total, active at `now`, revoked) after rowid `after`, but for the ids in `exclude`. */
export function keyCounts(g, after, exclude, now) {
  return g.sql.exec(`SELECT COUNT(*) AS total,
      COALESCE(SUM(revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)), 0) AS active,
      COALESCE(SUM(revoked_at IS NOT NULL), 0) AS revoked
    FROM client_keys WHERE rowid > ? AND id NOT IN (SELECT value FROM json_each(?))`, now, after, JSON.stringify(exclude)).one();
}

// --- the importer (the active generation) ---

/** The progress of the import from `from` ({self, hint, part, after, rows, total, started}), or null. */
export function progressOf(g, from) {
  const p = parseJson(g.meta(progressKey(from)));
  return p && p.v === 2 ? p : null;
}

/** The generations this object is importing now (kept in memory; storage is the truth after a reset). */
export function running(g) {
  g.importing ??= g.sql.exec("SELECT k, v FROM meta WHERE k >= 'importing:' AND k < 'importing;'").toArray()
    .filter((r) => parseJson(r.v)?.v === 2).map((r) => r.k.slice(10));
  return g.importing;
}

/** What the view and the probe show: [{from, rows, total, part}] of each import under way. */
export function importingView(g) {
  return running(g).map((from) => {
    const p = progressOf(g, from);
    return p ? { from, rows: p.rows, total: p.total, part: PARTS[p.part]?.[0] ?? null, started: p.started } : null;
  }).filter((p) => p !== null);
}

function exporter(g, from, hint) {
  const ns = g.env.BREAKER;
  const id = ns.idFromName(from);
  return hint ? ns.get(id, { locationHint: hint }) : ns.get(id);
}

/**
 * Begin importing `from` into this generation (`self`): take its head, record the cursor,
 * start the alarm. Calls that arrive meanwhile wait for the same head.
 */
export async function startImport(g, from, self, hint) {
  g.heads ??= new Map();
  let head = g.heads.get(from);
  if (!head) {
    head = (async () => {
      // An import begun by the version before (staged pages, nothing merged): begun again.
      const old = parseJson(g.meta(progressKey(from)));
      if (old && old.v !== 2) {
        g.ctx.storage.transactionSync(() => {
          g.setMeta(progressKey(from), null);
          g.sql.exec("DROP TABLE IF EXISTS import_stage");
        });
      }
      const h = await exporter(g, from, hint).exportHead(self);
      g.ctx.storage.transactionSync(() => {
        if (g.meta(`imported:${from}`) !== null || g.meta(progressKey(from)) !== null) return;
        if (h.forced && g.meta("forced") === null) g.setMeta("forced", h.forced);
        if (h.fleet_cells && g.meta("fleet_cells") === null) g.setMeta("fleet_cells", h.fleet_cells);
        if (h.scale_desired && g.meta("scale_desired") === null) g.setMeta("scale_desired", h.scale_desired);
        // The exporter held those generations' state: so does this one, once this import is done.
        for (const name of h.imported) if (g.meta(`imported:${name}`) === null) g.setMeta(`imported:${name}`, `via ${from}`);
        // The cell's daily spend whole, now: its fallback cap holds from the first request (the
        // daily usage rows that make it up then add to the keys' rows only).
        for (const [day, microusd] of h.spend) {
          g.sql.exec(`INSERT INTO fallback_spend (day, microusd) VALUES (?, ?)
            ON CONFLICT (day) DO UPDATE SET microusd = microusd + excluded.microusd`, day, microusd);
        }
        const total = Object.values(h.counts).reduce((a, b) => a + b, 0);
        g.setMeta(progressKey(from), JSON.stringify({ v: 2, self, hint: hint ?? null, part: 0, after: 0, rows: 0, total,
          started: Date.now() }));
      });
      g.importing = null; // read again from storage
      if (h.first && !h.first.next) {
        // The whole of a small generation came with the head: merged before the first answer.
        await mergePage(g, from, { part: 0, after: 0 }, h.first);
        const p = progressOf(g, from);
        if (p && p.part >= PARTS.length) {
          finishImport(g, from);
          return;
        }
      }
      await kick(g);
    })();
    g.heads.set(from, head);
    head.catch(() => g.heads.delete(from)); // the next call tries again
  }
  await head;
}

/** Make sure the alarm runs the import (after a reset, the first call that sees one under way). */
export async function kick(g) {
  if ((await g.ctx.storage.getAlarm()) === null) await g.ctx.storage.setAlarm(Date.now());
}

/**
 * Run the imports under way until `deadline` (ms); calls made meanwhile share the run.
 * Resolves to {done: no import left, failed: a call to an exporter failed}.
 */
export function pump(g, deadline) {
  g.pumping ??= (async () => {
    try {
      for (const from of [...running(g)]) {
        if (!(await importSome(g, from, deadline))) return { done: false, failed: false };
      }
      g.failures = 0;
      return { done: running(g).length === 0, failed: false };
    } catch (err) {
      g.failures = (g.failures ?? 0) + 1;
      g.lastError = String(err && err.message);
      return { done: false, failed: true };
    } finally {
      g.pumping = null;
    }
  })();
  return g.pumping;
}

/** How long the alarm waits after `failures` failed runs in a row: 1 s, 2 s, 4 s, ... up to RETRY_MS. */
export function retryDelay(failures) {
  return failures > 0 ? Math.min(RETRY_MS, 1000 * 2 ** (failures - 1)) : 0;
}

/** Page and merge `from` until done (true) or `deadline` (false). */
async function importSome(g, from, deadline) {
  while (Date.now() < deadline) {
    const p = progressOf(g, from);
    if (!p) return true;
    if (p.part >= PARTS.length) {
      finishImport(g, from);
      return true;
    }
    const page = await exporter(g, from, p.hint).exportAll(p.self, { part: p.part, after: p.after });
    if (!(await mergePage(g, from, { part: p.part, after: p.after }, page))) return false;
  }
  return false;
}

/** Merge a page exported after cursor `at`, a chunk a transaction; false when the cursor had moved. */
async function mergePage(g, from, at, page) {
  importMemory.peakRows = Math.max(importMemory.peakRows, page.parts.reduce((n, [, rows]) => n + rows.length, 0));
  for (const [name, rows, rowids] of page.parts) {
    const part = INDEX.get(name);
    if (part === undefined || part < at.part || !Array.isArray(rowids)) throw new Error(`export page out of order at ${name}`);
    for (let i = 0; i < rows.length; i += MERGE_ROWS) {
      const ids = rowids.slice(i, i + MERGE_ROWS);
      const next = { part, after: ids[ids.length - 1] };
      await held(g);
      if (!advance(g, from, at, next, ids.length, () => mergeChunk(g, from, part, rows.slice(i, i + MERGE_ROWS)))) return false;
      at = next;
      await yieldTurn(); // the calls waiting behind this chunk go first
    }
  }
  const end = page.next ?? { part: PARTS.length, after: 0 };
  await held(g);
  return (end.part === at.part && end.after === at.after) || advance(g, from, at, end, 0, () => {});
}

/**
 * In one transaction: apply `merge` and move the cursor from `at` to `next`, only if the
 * cursor is still at `at` (a chunk is never applied twice). False when it was not.
 */
function advance(g, from, at, next, n, merge) {
  return g.ctx.storage.transactionSync(() => {
    const p = progressOf(g, from);
    if (!p || p.part !== at.part || p.after !== at.after) return false;
    merge();
    g.setMeta(progressKey(from), JSON.stringify({ ...p, part: next.part, after: next.after, rows: p.rows + n }));
    return true;
  });
}

function finishImport(g, from) {
  g.ctx.storage.transactionSync(() => {
    g.sql.exec("DELETE FROM import_pulled WHERE src = ?", from);
    g.setMeta(progressKey(from), null);
    g.setMeta(`imported:${from}`, Date.now());
  });
  g.importing = null;
}

/** The ids among `ids` whose rows were fetched ahead of the import from `from`. */
function pulledOf(g, from, ids) {
  if (!ids.length) return new Set();
  return new Set(g.sql.exec("SELECT key_id FROM import_pulled WHERE src = ? AND key_id IN (SELECT value FROM json_each(?))",
    from, JSON.stringify([...new Set(ids)])).toArray().map((r) => r.key_id));
}

const keyOf = (part, row) => String(row[PARTS[part][3] ?? ""]);

/** A chunk of the paged import: its rows but those of keys fetched ahead of it. */
function mergeChunk(g, from, part, rows) {
  if (part < KEYED) {
    const skip = pulledOf(g, from, rows.map((r) => keyOf(part, r)));
    if (skip.size) rows = rows.filter((r) => !skip.has(keyOf(part, r)));
  }
  mergeRows(g, part, rows);
}

/**
 * Merge exported rows of part `part` into this generation (inside the caller's transaction):
 * keys by id (one held already stays as it is), counters added, replaced rows kept where
 * this generation holds one, histograms summed. Also a bench's bulk seed (importState).
 */
export function mergeRows(g, part, rows) {
  if (!rows.length) return;
  const name = PARTS[part][0];
  const sql = g.sql;
  const now = Date.now();
  if (name === "keys") {
    let rev = g.rev();
    for (const k of rows) {
      const added = sql.exec(`INSERT OR IGNORE INTO client_keys (${KEY_COLUMNS}, rev) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
        k.id, k.hash, k.prefix, k.name, k.rpm ?? 0, k.tpm ?? 0, k.monthly_tokens ?? 0, k.max_parallel ?? 0, k.created_at,
        k.expires_at ?? null, k.revoked_at ?? null, k.fallback_microusd_day ?? 0, k.max_parallel_tokens ?? null, rev + 1).rowsWritten;
      if (added) rev += 1;
    }
    g.setMeta("rev", rev);
    g.keyBits = null; // the key filter (keyfilter.js): built again with these keys on next use
  } else if (name === "leases") {
    sql.exec(IMPORT_LEASES, now, JSON.stringify(rows.map(LEASE.of)));
  } else if (name === "peers") {
    sql.exec(IMPORT_PEERS, now, JSON.stringify(rows.map(EXCHANGE.of)));
  } else if (name === "windows") {
    for (const w of rows) sql.exec(UPSERT_WINDOW, w.key_id, w.minute, w.requests, w.tokens);
  } else if (name === "inflight") {
    for (const f of rows) sql.exec(IMPORT_INFLIGHT, f.key_id, f.isolate, f.n, f.at);
  } else if (name === "months") {
    for (const m of rows) sql.exec(UPSERT_MONTH, m.key_id, m.month, m.tokens);
  } else if (name === "usage") {
    for (const u of rows) {
      sql.exec(UPSERT_USAGE, u.day, u.key_id, u.requests, u.prompt_tokens, u.completion_tokens, u.pod_requests,
        u.fallback_requests, u.estimated_tokens ?? 0, u.fallback_microusd ?? 0, u.refused ?? 0);
    }
  } else if (name === "refusals") {
    sql.exec(BULK_REFUSALS, JSON.stringify(rows.map((r) => [r.key_id, r.reason, r.n])));
  } else if (name === "seg_total") {
    for (const [colo, pod, segment, hist] of rows) g.addTotal(colo, pod, segment, hist);
  } else if (name === "seg_hour") {
    for (const r of rows) g.addSeg("seg_hour", "hour", r);
  } else if (name === "seg_minute") {
    for (const r of rows) g.addSeg("seg_minute", "minute", r);
  }
  // A fleet's exchange reads this generation from its own sequence: every imported counter is news.
  if (name === "windows" || name === "months") g.markChanged([...new Set(rows.map((r) => r.key_id))]);
}

/**
 * Before a call reads or writes the rows of these keys (by id, or by digest where this
 * generation holds none): fetch each key's rows from every import under way that has not
 * passed the keyed parts, once per key (see the header).
 */
export async function pullKeys(g, ids, digests = []) {
  for (const from of [...running(g)]) {
    const p = progressOf(g, from);
    if (!p || p.part >= KEYED) continue;
    const have = pulledOf(g, from, ids);
    const want = [...new Set(ids.map(String))].filter((id) => !have.has(id));
    const local = digests.length
      ? new Set(g.sql.exec("SELECT hash FROM client_keys WHERE hash IN (SELECT value FROM json_each(?))",
        JSON.stringify(digests)).toArray().map((r) => r.hash))
      : new Set();
    const seek = [...new Set(digests.map(String))].filter((d) => !local.has(d));
    for (let i = 0; i < Math.max(want.length, seek.length); i += PULL_IDS) {
      const got = await exporter(g, from, p.hint).exportKeys(want.slice(i, i + PULL_IDS), seek.slice(i, i + PULL_IDS));
      await held(g);
      g.ctx.storage.transactionSync(() => mergePulled(g, from, got));
    }
  }
}

/** Merge what exportKeys answered: the rows the paged import has not merged, of keys not fetched before. */
function mergePulled(g, from, got) {
  const p = progressOf(g, from);
  if (!p) return; // the import finished meanwhile: it merged every row
  const before = pulledOf(g, from, got.ids);
  const fresh = got.ids.filter((id) => !before.has(id));
  if (!fresh.length) return;
  g.sql.exec("INSERT OR IGNORE INTO import_pulled (src, key_id) SELECT ?, value FROM json_each(?)", from, JSON.stringify(fresh));
  const take = new Set(fresh);
  for (const [name, rows, rowids] of got.parts) {
    const part = INDEX.get(name);
    if (part === undefined || part < p.part) continue; // merged by the import already
    const keep = rows.filter((r, i) => take.has(keyOf(part, r)) && (part > p.part || rowids[i] > p.after));
    mergeRows(g, part, keep);
  }
}

/**
 * The rows of part `name` (FILTERS `filter`) that the imports under way have not merged
 * yet, as a function to call in the same turn as the local read it adds to: it drops what
 * was merged or fetched meanwhile, so nothing counts twice. Whole-table reads only.
 */
export async function pendingRows(g, name, filter = null) {
  const part = /** @type {number} */ (INDEX.get(name));
  const fetched = [];
  for (const from of [...running(g)]) {
    const p = progressOf(g, from);
    if (!p || p.part > part) continue;
    let after = p.part === part ? p.after : 0;
    for (let page = 0; page < RANGE_PAGES; page++) {
      const got = await exporter(g, from, p.hint).exportRange(name, after, filter);
      fetched.push([from, got.rows, got.rowids]);
      if (!got.more) break;
      after = got.rowids[got.rowids.length - 1];
    }
  }
  return () => {
    const out = [];
    for (const [from, rows, rowids] of fetched) {
      const p = progressOf(g, from);
      if (!p || p.part > part) continue;
      const skip = part < KEYED ? pulledOf(g, from, rows.map((r) => keyOf(part, r))) : new Set();
      rows.forEach((r, i) => {
        if ((p.part < part || rowids[i] > p.after) && !skip.has(keyOf(part, r))) out.push(r);
      });
    }
    return out;
  };
}

/**
 * The key counts the imports under way have not merged yet ({total, active, revoked}). The
 * import and fetches ahead of it wait meanwhile (`hold`): a count cannot be split by rowid.
 */
export async function pendingKeyCounts(g, now) {
  const sum = { total: 0, active: 0, revoked: 0 };
  const busy = running(g).filter((from) => progressOf(g, from)?.part === 0);
  if (!busy.length) return sum;
  await held(g);
  /** @type {(v?: unknown) => void} */
  let release = () => {};
  g.hold = new Promise((resolve) => { release = resolve; });
  try {
    for (const from of busy) {
      const p = progressOf(g, from);
      if (!p || p.part > 0) continue;
      const exclude = g.sql.exec("SELECT key_id FROM import_pulled WHERE src = ?", from).toArray().map((r) => r.key_id);
      const c = await exporter(g, from, p.hint).keyCounts(p.after, exclude, now);
      for (const k of ["total", "active", "revoked"]) sum[k] += c[k];
    }
  } finally {
    g.hold = null;
    release();
  }
  return sum;
}

/** Wait while a read holds the import still (pendingKeyCounts). */
async function held(g) {
  while (g.hold) await g.hold;
}

function parseJson(text) {
  try {
    return text === null ? null : JSON.parse(text);
  } catch {
    return null;
  }
}
