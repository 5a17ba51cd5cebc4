// @ts-check
// The generation's Durable Object: all of a cell's routed state, in SQLite (schema.js).
//
// One object per generation (idFromName(generation)); the class keeps its historical
// name, Breaker, because a class name is part of the deployed migration history.
// Writers: the router's reports (breaker outcomes), the isolates' batched syncs (usage
// and limit counters), and the operator endpoints (override, keys). Every answer is a
// `view` the isolate caches (state.js), so the hot path reads nothing from here.
//
// Migration: while a generation drains, the Worker passes its name in `info`. The first
// call that names a draining generation this object has not imported yet copies that
// generation's whole state (exportAll, page by page: override, keys, usage, counters) inside
// blockConcurrencyWhile, merges it, and records `imported:<name>` so it happens once. Memory
// stays bounded by a page: each page is staged into this object's own SQLite (import_stage,
// one transaction per page, with the cursor), then merged from there a chunk at a time in one
// transaction. An import cut short (the isolate's time or memory limit, an error) resumes from
// the staged cursor; the merge is all or nothing, so nothing is counted twice.
// The router also calls `importFrom` before it purges a draining generation, so nothing
// is lost even if no request touched the new generation in between. Once exported, a
// generation forwards the usage batches that still reach it (isolates of the previous
// Worker version finishing their work during a deploy) to its successor.

import { DurableObject } from "cloudflare:workers";
import { FORCE_VALUES, grantTrial, initial, initialPace, needsWitness, record, recordPace } from "./machine.js";
import { dayOf, minuteOf } from "./limits.js";
import {
  ADDED_COLUMNS, BULK_MONTH, BULK_REFUSALS, BULK_USAGE, BULK_WINDOW, INDEXES, KEY_COLUMNS, KEY_VIEW_COLUMNS, MARK_CHANGED, SCHEMA,
  SCHEMA_VERSION, UPSERT_LEASES, UPSERT_MONTH, UPSERT_PEERS, UPSERT_POD, UPSERT_USAGE, UPSERT_WINDOW, USAGE_COLUMNS,
} from "./schema.js";
import { counts as countsAnything, fallbackCapOf, monthOf, provisionalLease } from "./fleetexchange.js";
import { BACKEND, COUNTER, EXCHANGE, FALLBACK_HELD, HIST, LEASE, POD_INFLIGHT, REFUSAL, USAGE, WINDOW } from "./payloads.js";
import { REASONS, REFUSAL_KEYS } from "./refusals.js";
import { fetchColo } from "./trace.js";
import { LIVE, SYNC, mergeEncoded } from "./histogram.js";
import { BITS_PER_KEY, addDigest, filterFor } from "./keyfilter.js";

const LEGACY_KV_KEY = "breaker"; // schema 1 kept one KV entry: {snap, adopted_from}
const POD_ROW_TTL_MS = 24 * 3600 * 1000; // health rows of pods gone for a day are dropped
const MINUTE_MS = 60000;
const HOUR_MS = 3600000;
const SEG_MINUTES_KEEP = 7 * 24 * 60; // minutes kept as minutes; older ones roll up into hours
const SEG_HOURS_KEEP = 35 * 24; // hours kept
const SEG_NAMES = new Set([...LIVE, SYNC]);
export const DELTA_ROWS = 500; // key rows per answer; `more: true` asks the isolate to sync again
// An isolate further behind than this many revisions drops its few looked-up keys and
// starts from the current revision (cheaper than paging through every change since).
export const DELTA_RESET = 5000;
const INFLIGHT_KEEP_MS = 10 * 60_000; // in-flight rows of isolates silent this long are deleted
export const CHANGED_ROWS = 2000; // own-counter rows per answer to a fleet's exchange; `more: true` asks again

// The counter columns a fleet's exchange carries: those both shapes name.
const SHARED = COUNTER.names.filter((n) => /** @type {readonly string[]} */ (EXCHANGE.names).includes(n));

export const EXPORT_ROWS = 5000; // rows of one exportAll page, from as many tables as fit
// What exportAll pages through, in order: [name in the import, query, row shape or null].
/** @type {Array<[string, string, ((r: any) => unknown) | null]>} */
const EXPORT_PARTS = [
  ["keys", `SELECT ${KEY_COLUMNS} FROM client_keys`, null],
  ["usage", `SELECT ${USAGE_COLUMNS} FROM usage_daily`, null],
  ["months", "SELECT key_id, month, tokens FROM key_month", null],
  ["windows", "SELECT key_id, minute, requests, tokens FROM rate_window", null],
  ["seg_minute", "SELECT minute, colo, pod, segment, hist FROM seg_minute", (r) => [r.minute, r.colo, r.pod, r.segment, r.hist]],
  ["seg_hour", "SELECT hour, colo, pod, segment, hist FROM seg_hour", (r) => [r.hour, r.colo, r.pod, r.segment, r.hist]],
  ["seg_total", "SELECT colo, pod, segment, hist FROM seg_total", (r) => [r.colo, r.pod, r.segment, r.hist]],
  ["inflight", "SELECT key_id, isolate, n, at FROM key_inflight", null],
  ["peers", `SELECT ${EXCHANGE.columns} FROM peer_counters`, EXCHANGE.of],
  ["leases", `SELECT ${LEASE.columns} FROM key_lease`, LEASE.of],
  ["fleet_cells", "SELECT v FROM meta WHERE k = 'fleet_cells'", (r) => Number(r.v)],
  // The scaling controller's desired pod count (colocate/scaler.py), which `pulumi up` reads.
  ["scale_desired", "SELECT v FROM meta WHERE k = 'scale_desired'", (r) => r.v],
  ["refusals", "SELECT key_id, reason, n FROM refusal_total", (r) => [r.key_id, r.reason, r.n]],
];
// Staged pages of an import in progress: one row per exported row, as JSON, in export order.
const STAGE_TABLE = "CREATE TABLE IF NOT EXISTS import_stage (part TEXT NOT NULL, row TEXT NOT NULL)";
export const MERGE_ROWS = 2000; // staged rows read back per chunk of the merge
// The most rows the import holds in memory at once (a page, or a chunk of the merge): a test reads it.
export const importMemory = { peakRows: 0 };

// Breaker, not Generation: a Durable Object class name is pinned by the deployed migrations.
export class Breaker extends DurableObject {
  constructor(ctx, env) {
    super(ctx, env);
    this.sql = ctx.storage.sql;
    this.coloOnce = null;
    this.pace = new Map(); // pod URL -> pace streak and slow mark (machine.js): soft state, re-learnt in seconds after a restart
    this.purged = false; // set by purge(): no tables until the next use
    this.keyBits = null; // the key filter (keyfilter.js), built on first use, then kept up to date
    this.heldAny = null; // whether fallback_held has a row (null: not read yet): none, no sync reads it
    this.keyRoom = 0; // keys it may still take at its rate before it is built again, larger
    ctx.blockConcurrencyWhile(async () => this.load());
  }

  async load() {
    for (const stmt of SCHEMA) this.sql.exec(stmt);
    const version = this.meta("schema");
    if (version === SCHEMA_VERSION) {
      for (const stmt of INDEXES) this.sql.exec(stmt);
      return;
    }
    /** @type {{snap?: {forced?: string | null}, adopted_from?: string} | undefined} */
    const legacy = version === null ? await this.ctx.storage.get(LEGACY_KV_KEY) : undefined;
    this.ctx.storage.transactionSync(() => {
      // Schema 2 (and older): add the new columns in place; nothing is copied or lost.
      for (const [table, column, decl] of ADDED_COLUMNS) {
        if (!this.sql.exec(`SELECT * FROM ${table} LIMIT 0`).columnNames.includes(column)) {
          this.sql.exec(`ALTER TABLE ${table} ADD COLUMN ${column} ${decl}`);
        }
      }
      for (const stmt of INDEXES) this.sql.exec(stmt);
      // The month totals, once, from the daily rows they replace as the budget's input.
      this.sql.exec(`INSERT INTO key_month (key_id, month, tokens)
        SELECT key_id, substr(day, 1, 7), SUM(prompt_tokens + completion_tokens) FROM usage_daily GROUP BY key_id, substr(day, 1, 7)
        ON CONFLICT (key_id, month) DO UPDATE SET tokens = excluded.tokens`);
      // Schema 3 (and older): stored histograms into the current buckets (histogram.js reads
      // the fixed ones too; converted once, every reader sees one form), and the histograms'
      // totals the Prometheus exposition counts from, once, from what is kept.
      for (const [table, col] of [["seg_minute", "minute"], ["seg_hour", "hour"]]) {
        for (const r of this.sql.exec(`SELECT ${col} AS t, colo, pod, segment, hist FROM ${table} WHERE hist NOT LIKE '~%'`).toArray()) {
          this.sql.exec(`DELETE FROM ${table} WHERE ${col} = ? AND colo = ? AND pod = ? AND segment = ?`, r.t, r.colo, r.pod, r.segment);
          this.addSeg(table, col, [r.t, r.colo, r.pod, r.segment, r.hist]);
        }
      }
      if (this.sql.exec("SELECT COUNT(*) AS n FROM seg_total").one().n === 0) {
        for (const table of ["seg_minute", "seg_hour"]) {
          for (const r of this.sql.exec(`SELECT colo, pod, segment, hist FROM ${table}`).toArray()) this.addTotal(r.colo, r.pod, r.segment, r.hist);
        }
      }
      // Schema 1 (one KV entry): keep its override; per-pod health starts fresh.
      if (legacy && legacy.snap && FORCE_VALUES.includes(legacy.snap.forced) && legacy.snap.forced !== null) {
        this.setMeta("forced", legacy.snap.forced);
      }
      if (legacy && legacy.adopted_from) this.setMeta(`imported:${legacy.adopted_from}`, "legacy");
      this.setMeta("schema", SCHEMA_VERSION);
    });
    if (legacy) await this.ctx.storage.delete(LEGACY_KV_KEY);
  }

  meta(k) {
    const row = this.sql.exec("SELECT v FROM meta WHERE k = ?", k).toArray()[0];
    return row ? row.v : null;
  }

  setMeta(k, v) {
    if (v === null) this.sql.exec("DELETE FROM meta WHERE k = ?", k);
    else this.sql.exec("INSERT INTO meta (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = excluded.v", k, String(v));
  }

  rev() {
    return Number(this.meta("rev") || 0);
  }

  /** The next keys revision (each changed row gets its own, so deltas page by rev exactly). */
  bumpRev(n = 1) {
    const next = this.rev() + n;
    this.setMeta("rev", next);
    return next;
  }

  /** A purged instance holds no tables: its next use (a generation reused) makes them again. */
  async unpurge() {
    if (!this.purged) return;
    this.purged = false;
    await this.load();
  }

  /** Copy a draining generation's state once (see the header). */
  async readThrough(info) {
    await this.unpurge();
    const from = info && info.draining;
    if (!from || from === info.generation || this.meta(`imported:${from}`) !== null) return;
    await this.ctx.blockConcurrencyWhile(async () => {
      if (this.meta(`imported:${from}`) !== null) return;
      const ns = this.env.BREAKER;
      const id = ns.idFromName(from);
      const other = info.drainingHint ? ns.get(id, { locationHint: info.drainingHint }) : ns.get(id);
      await this.importPaged(from, other, info.generation);
    });
  }

  /**
   * Stage `from`'s export page by page (each page and the cursor after it in one transaction),
   * then merge. A previous attempt's staged pages are kept and the export resumes at its cursor.
   */
  async importPaged(from, other, successor) {
    this.sql.exec(STAGE_TABLE);
    const progressKey = `importing:${from}`;
    const progress = parseJson(this.meta(progressKey));
    if (!progress) this.sql.exec("DELETE FROM import_stage");
    let cursor = progress ? progress.next : null;
    let forced = progress ? progress.forced : null;
    if (!progress || cursor) {
      do {
        const page = await other.exportAll(successor, cursor);
        // A page of one table ({part, rows}): an object still running the version before.
        const parts = page.parts ?? [[page.part, page.rows]];
        importMemory.peakRows = Math.max(importMemory.peakRows, parts.reduce((n, [, rows]) => n + rows.length, 0));
        this.ctx.storage.transactionSync(() => {
          this.stage(parts);
          this.setMeta(progressKey, JSON.stringify({ next: page.next, forced: page.forced }));
        });
        cursor = page.next;
        forced = page.forced;
      } while (cursor);
    }
    this.mergeStaged(from, forced);
  }

  /** Rows of export parts ([[name, rows], ...]) into import_stage, one statement a part. */
  stage(parts) {
    for (const [name, rows] of parts) {
      if (rows.length) {
        this.sql.exec("INSERT INTO import_stage (part, row) SELECT ?, value FROM json_each(?)", name,
          JSON.stringify(rows.map((r) => JSON.stringify(r))));
      }
    }
  }

  /** The staged rows of `part`, MERGE_ROWS at a time, in export order. */
  eachStaged(part, fn) {
    let after = 0;
    for (;;) {
      const chunk = this.sql.exec("SELECT rowid AS id, row FROM import_stage WHERE part = ? AND rowid > ? ORDER BY rowid LIMIT ?",
        part, after, MERGE_ROWS).toArray();
      if (!chunk.length) return;
      importMemory.peakRows = Math.max(importMemory.peakRows, chunk.length);
      fn(chunk.map((r) => JSON.parse(r.row)));
      after = chunk[chunk.length - 1].id;
    }
  }

  /** A whole export at once ({forced, keys: [...], usage: [...], ...}): bench/scale.py's bulk seed. */
  importState(from, data) {
    this.sql.exec(STAGE_TABLE);
    this.ctx.storage.transactionSync(() => {
      this.sql.exec("DELETE FROM import_stage");
      this.stage(EXPORT_PARTS.map(([name]) => [name, data[name] ?? []]));
    });
    this.mergeStaged(from, data.forced ?? null);
  }

  /** Merge the staged export into this generation, in one transaction, a chunk at a time. */
  mergeStaged(from, forced) {
    this.ctx.storage.transactionSync(() => {
      if (forced && this.meta("forced") === null) this.setMeta("forced", forced);
      const has = (part) => this.sql.exec("SELECT 1 FROM import_stage WHERE part = ? LIMIT 1", part).toArray().length > 0;
      let rev = this.rev();
      this.eachStaged("keys", (keys) => {
        for (const k of keys) {
          const added = this.sql.exec(`INSERT OR IGNORE INTO client_keys (${KEY_COLUMNS}, rev) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
            k.id, k.hash, k.prefix, k.name, k.rpm, k.tpm, k.monthly_tokens, k.max_parallel ?? 0, k.created_at, k.expires_at,
            k.revoked_at, k.fallback_microusd_day ?? 0, rev + 1).rowsWritten;
          if (added) rev += 1;
        }
      });
      this.setMeta("rev", rev);
      this.eachStaged("usage", (usage) => {
        for (const u of usage) {
          this.sql.exec(UPSERT_USAGE, u.day, u.key_id, u.requests, u.prompt_tokens, u.completion_tokens, u.pod_requests,
            u.fallback_requests, u.estimated_tokens ?? 0, u.fallback_microusd ?? 0, u.refused ?? 0);
        }
      });
      // The cell's daily fallback spend follows from the daily rows, the imported ones included.
      this.sql.exec("DELETE FROM fallback_spend");
      this.sql.exec(`INSERT INTO fallback_spend (day, microusd) SELECT day, SUM(fallback_microusd) FROM usage_daily
        GROUP BY day HAVING SUM(fallback_microusd) > 0`);
      // A schema-2 exporter has no month totals: they follow from its daily rows.
      const monthsPart = has("months") ? "months" : "usage";
      if (monthsPart === "months") {
        this.eachStaged("months", (months) => { for (const m of months) this.sql.exec(UPSERT_MONTH, m.key_id, m.month, m.tokens); });
      } else {
        this.eachStaged("usage", (usage) => { for (const m of monthsOf(usage)) this.sql.exec(UPSERT_MONTH, m.key_id, m.month, m.tokens); });
      }
      this.eachStaged("windows", (windows) => {
        for (const w of windows) this.sql.exec(UPSERT_WINDOW, w.key_id, w.minute, w.requests, w.tokens);
      });
      this.eachStaged("seg_minute", (rows) => { for (const r of rows) this.addSeg("seg_minute", "minute", r); });
      this.eachStaged("seg_hour", (rows) => { for (const r of rows) this.addSeg("seg_hour", "hour", r); });
      // An exporter of schema 3 has no totals: they follow from what it kept.
      if (has("seg_total")) {
        this.eachStaged("seg_total", (rows) => { for (const [colo, pod, segment, hist] of rows) this.addTotal(colo, pod, segment, hist); });
      } else {
        for (const part of ["seg_minute", "seg_hour"]) {
          this.eachStaged(part, (rows) => { for (const r of rows) this.addTotal(r[1], r[2], r[3], r[4]); });
        }
      }
      this.eachStaged("inflight", (rows) => {
        for (const f of rows) {
          this.sql.exec(`INSERT INTO key_inflight (key_id, isolate, n, at) VALUES (?, ?, ?, ?)
            ON CONFLICT (key_id, isolate) DO UPDATE SET n = excluded.n, at = excluded.at`, f.key_id, f.isolate, f.n, f.at);
        }
      });
      this.eachStaged("refusals", (rows) => this.sql.exec(BULK_REFUSALS, JSON.stringify(rows)));
      this.eachStaged("peers", (rows) => this.sql.exec(UPSERT_PEERS, Date.now(), JSON.stringify(rows)));
      // A fleet's leases go on holding in the successor until the ledger reaches it.
      this.eachStaged("leases", (rows) => this.sql.exec(UPSERT_LEASES, Date.now(), JSON.stringify(rows)));
      const first = (part) => {
        const row = this.sql.exec("SELECT row FROM import_stage WHERE part = ? ORDER BY rowid LIMIT 1", part).toArray()[0];
        return row ? JSON.parse(row.row) : null;
      };
      const cells = first("fleet_cells");
      if (cells && this.meta("fleet_cells") === null) this.setMeta("fleet_cells", cells);
      const desired = first("scale_desired");
      if (desired && this.meta("scale_desired") === null) this.setMeta("scale_desired", desired);
      // A fleet's exchange reads this generation from its own sequence: every imported counter is
      // news. Each key once, by key id, a chunk at a time.
      let last = "";
      for (;;) {
        const ids = this.sql.exec(`SELECT DISTINCT json_extract(row, '$.key_id') AS k FROM import_stage
          WHERE part IN (?, 'windows') AND json_extract(row, '$.key_id') > ? ORDER BY k LIMIT ?`, monthsPart, last, MERGE_ROWS)
          .toArray().map((r) => r.k);
        if (!ids.length) break;
        this.markChanged(ids);
        last = ids[ids.length - 1];
      }
      this.sql.exec("DELETE FROM import_stage");
      this.keyBits = null; // the imported keys: built again on next use
      this.setMeta(`importing:${from}`, null);
      this.setMeta(`imported:${from}`, Date.now());
    });
  }

  /**
   * Everything a successor generation takes over (pod health stays: the pods change), one
   * page at a time: at most EXPORT_ROWS rows a call, from as many tables as fit (a
   * generation's whole history in one answer could pass the size an RPC carries; a call per
   * table would cost a small generation one round trip per table, an ocean each for a
   * migration's first request). `parts` is [[name, rows], ...] in EXPORT_PARTS order, a
   * table cut short continues on the next page; `cursor` is the previous page's `next`;
   * null starts over. From the first page on, usage batches that reach this generation go
   * on to `successor`.
   */
  async exportAll(successor = null, cursor = null) {
    await this.unpurge();
    if (successor) this.setMeta("successor", successor);
    /** @type {{part: number, offset: number} | null} */
    let at = cursor ?? { part: 0, offset: 0 };
    let room = EXPORT_ROWS;
    /** @type {Array<[string, unknown[]]>} */
    const parts = [];
    while (at && room > 0) {
      const [name, query, shape] = EXPORT_PARTS[at.part];
      const rows = this.sql.exec(`${query} ORDER BY rowid LIMIT ? OFFSET ?`, room + 1, at.offset).toArray();
      const more = rows.length > room;
      if (more) rows.length = room;
      parts.push([name, shape ? rows.map(shape) : rows]);
      room -= rows.length;
      at = more ? { part: at.part, offset: at.offset + rows.length }
        : at.part + 1 < EXPORT_PARTS.length ? { part: at.part + 1, offset: 0 } : null;
    }
    return { forced: this.meta("forced"), parts, next: at };
  }

  /** Import a named generation now (the router calls this before purging it). */
  async importFrom(info) {
    await this.readThrough(info);
    return { imported: this.meta(`imported:${info.draining}`) !== null };
  }

  /**
   * Key rows changed since revision `haveRev` (revoked ones included, so holders drop
   * them), at most DELTA_ROWS. A cold caller (-1) gets none, only the current revision.
   */
  keyDelta(haveRev) {
    const rev = this.rev();
    if (haveRev === rev) return { rev, keys: null, more: false };
    if (haveRev < 0 || haveRev > rev || rev - haveRev > DELTA_RESET) return { rev, keys: [], more: false, reset: haveRev >= 0 };
    const rows = this.sql.exec(`SELECT ${KEY_VIEW_COLUMNS} FROM client_keys WHERE rev > ? ORDER BY rev LIMIT ?`,
      haveRev, DELTA_ROWS + 1).toArray();
    const more = rows.length > DELTA_ROWS;
    if (more) rows.length = DELTA_ROWS;
    return { rev: more ? rows[rows.length - 1].rev : rev, keys: rows.map(keyView), more };
  }

  /**
   * This cell's own counters {id: COUNTER row} for the ids asked (absent: all zero;
   * `inflight` 0). Two indexed reads, whatever the number of keys.
   */
  ownCounts(ids, now) {
    const counts = {};
    if (!ids || ids.length === 0) return counts;
    const m = minuteOf(now);
    const list = JSON.stringify(ids);
    const slot = (id) => (counts[id] ??= COUNTER.zero(m));
    for (const w of this.sql.exec(
      "SELECT key_id, minute, requests, tokens FROM rate_window WHERE key_id IN (SELECT value FROM json_each(?)) AND minute >= ?",
      list, m - 1)) {
      const c = slot(w.key_id);
      if (w.minute === m) {
        c[COUNTER.req] += w.requests;
        c[COUNTER.tok] += w.tokens;
      } else {
        c[COUNTER.prev_req] += w.requests;
        c[COUNTER.prev_tok] += w.tokens;
      }
    }
    for (const r of this.sql.exec(
      "SELECT key_id, tokens FROM key_month WHERE key_id IN (SELECT value FROM json_each(?)) AND month = ?",
      list, monthOf(now))) {
      if (r.tokens > 0) slot(r.key_id)[COUNTER.month_tokens] = r.tokens;
    }
    return counts;
  }

  /**
   * {id: COUNTER row} for the ids asked (absent: all zero): this cell's own counters,
   * plus the other isolates' requests in flight and their reserved tokens. Four indexed reads, whatever the number
   * of keys. In a fleet the other cells' counters are not added: each cell's share is its
   * lease (leasesOf).
   */
  countsOf(ids, info, now) {
    const counts = this.ownCounts(ids, now);
    if (!ids || ids.length === 0) return counts;
    const m = minuteOf(now);
    const slot = (id) => (counts[id] ??= COUNTER.zero(m));
    const fresh = now - 2 * Math.max(info.ttlMs ?? 0, 1000);
    for (const r of this.sql.exec(`SELECT key_id, SUM(n) AS n FROM key_inflight
        WHERE key_id IN (SELECT value FROM json_each(?)) AND isolate != ? AND at >= ? GROUP BY key_id`,
    JSON.stringify(ids), info.isolate ?? "", fresh)) {
      if (r.n > 0) slot(r.key_id)[COUNTER.inflight] = r.n;
    }
    for (const r of this.sql.exec(`SELECT key_id, SUM(tokens) AS tokens FROM key_reserved
        WHERE key_id IN (SELECT value FROM json_each(?)) AND isolate != ? AND at >= ? GROUP BY key_id`,
    JSON.stringify(ids), info.isolate ?? "", fresh)) {
      if (r.tokens > 0) slot(r.key_id)[COUNTER.reserved] = r.tokens;
    }
    if (info.capKeys) {
      for (const r of this.sql.exec(`SELECT key_id, fallback_microusd FROM usage_daily
          WHERE day = ? AND key_id IN (SELECT value FROM json_each(?)) AND fallback_microusd > 0`, dayOf(now), JSON.stringify(ids))) {
        slot(r.key_id)[COUNTER.day_fallback_microusd] = r.fallback_microusd;
      }
      if (this.anyHeld()) {
        for (const r of this.sql.exec(`SELECT key_id, SUM(microusd) AS m FROM fallback_held
            WHERE key_id IN (SELECT value FROM json_each(?)) AND isolate != ? AND at >= ? GROUP BY key_id`,
        JSON.stringify(ids), info.isolate ?? "", fresh)) {
          if (r.m > 0) slot(r.key_id)[COUNTER.fallback_reserved] = r.m;
        }
      }
    }
    return counts;
  }

  /**
   * In a fleet (once its ledger has told this cell the fleet's size), each asked key's
   * lease {req, tok, month_tokens, peers}: what this cell may admit of its rpm, tpm and
   * monthly tokens (null: no such limit); a key the ledger has not apportioned yet (or not
   * this month, for monthly tokens) gets the default share. `peers`: the other cells'
   * counters as the exchange last brought them (a COUNTER row; null: none counted), so a
   * refusal by lease can tell the front door the key is under its limit and may be served
   * elsewhere (router.js). null for a lone cell.
   */
  leasesOf(ids, now, keyCap = 0) {
    const n = Number(this.meta("fleet_cells") || 0);
    if (!n) return null;
    const leases = {};
    if (!ids || ids.length === 0) return leases;
    const month = monthOf(now);
    const day = dayOf(now);
    for (const r of this.sql.exec(`SELECT k.id, k.rpm, k.tpm, k.monthly_tokens, k.fallback_microusd_day, l.req, l.tok, l.month,
        l.month_tokens, l.day, l.fallback_microusd,
        p.minute AS p_minute, p.req AS p_req, p.tok AS p_tok, p.prev_req AS p_prev_req, p.prev_tok AS p_prev_tok,
        p.month AS p_month, p.month_tokens AS p_month_tokens
        FROM client_keys k LEFT JOIN key_lease l ON l.key_id = k.id LEFT JOIN peer_counters p ON p.key_id = k.id
        WHERE k.id IN (SELECT value FROM json_each(?))`,
    JSON.stringify(ids))) {
      const fallback = provisionalLease(r, n, keyCap); // the default shares of the key's limits
      if (fallback === undefined) continue; // no limit to apportion
      const held = r.month !== null; // a row: the ledger apportioned this key here
      let peers = null;
      if (r.p_minute !== null) {
        peers = COUNTER.zero(r.p_minute);
        peers[COUNTER.req] = r.p_req;
        peers[COUNTER.tok] = r.p_tok;
        peers[COUNTER.prev_req] = r.p_prev_req;
        peers[COUNTER.prev_tok] = r.p_prev_tok;
        if (r.p_month === month) peers[COUNTER.month_tokens] = r.p_month_tokens;
      }
      leases[r.id] = {
        req: r.rpm > 0 && held && r.req !== null ? r.req : fallback.req,
        tok: r.tpm > 0 && held && r.tok !== null ? r.tok : fallback.tok,
        month_tokens: r.monthly_tokens > 0 && r.month === month && r.month_tokens !== null ? r.month_tokens : fallback.month_tokens,
        fallback_microusd: fallbackCapOf(r, keyCap) > 0 && r.day === day && r.fallback_microusd !== null ? r.fallback_microusd
          : fallback.fallback_microusd,
        peers,
      };
    }
    return leases;
  }

  // --- a fleet's exchange (fleetledger.js pulls and pushes through admin.js) ---

  /** Give each key its own next sequence number (inside the caller's transaction). */
  markChanged(ids) {
    if (!ids.length) return;
    const base = Number(this.meta("changed_seq") || 0);
    this.sql.exec(MARK_CHANGED, JSON.stringify(ids.map((id, i) => [id, base + i + 1])));
    this.setMeta("changed_seq", base + ids.length);
  }

  /**
   * This cell's own counters of the keys changed since sequence `since`, at most
   * CHANGED_ROWS, by the index on key_changed.seq: {generation, cursor, more, reset,
   * rows: [EXCHANGE row]}. A cursor ahead of this generation (a new one after a
   * migration) reads from the start.
   * @returns {Promise<import("./payloads.js").CountersAnswer>}
   */
  async changedCounters(since, info) {
    await this.readThrough(info);
    const seq = Number(this.meta("changed_seq") || 0);
    const from = since > seq ? 0 : since;
    const marks = this.sql.exec("SELECT key_id, seq FROM key_changed WHERE seq > ? ORDER BY seq LIMIT ?", from, CHANGED_ROWS + 1)
      .toArray();
    const more = marks.length > CHANGED_ROWS;
    if (more) marks.length = CHANGED_ROWS;
    const now = Date.now();
    const ids = JSON.stringify(marks.map((r) => r.key_id));
    const own = this.ownCounts(marks.map((r) => r.key_id), now);
    const month = monthOf(now);
    const day = dayOf(now);
    const spent = new Map(this.sql.exec(`SELECT key_id, fallback_microusd FROM usage_daily WHERE day = ?
      AND key_id IN (SELECT value FROM json_each(?))`, day, ids).toArray().map((r) => [r.key_id, r.fallback_microusd]));
    const rows = marks.map(({ key_id: id }) => {
      const c = own[id] ?? COUNTER.zero(minuteOf(now));
      const row = EXCHANGE.zero(id);
      for (const name of SHARED) row[EXCHANGE[name]] = c[COUNTER[name]];
      row[EXCHANGE.month] = month;
      row[EXCHANGE.day] = day;
      row[EXCHANGE.fallback_microusd] = spent.get(id) ?? 0;
      return row;
    });
    // The ledger apportions each key's limits: it learns them here, with how long this
    // cell's isolates may go on using a lease after it is replaced (their view's TTL).
    const limits = {};
    for (const k of this.sql.exec(`SELECT id, rpm, tpm, monthly_tokens, fallback_microusd_day FROM client_keys
        WHERE id IN (SELECT value FROM json_each(?))`, ids)) {
      limits[k.id] = { rpm: k.rpm, tpm: k.tpm, monthly_tokens: k.monthly_tokens, fallback_microusd_day: fallbackCapOf(k, info.keyCap ?? 0) };
    }
    return { generation: info.generation, cursor: more ? marks[marks.length - 1].seq : seq, more, reset: from !== since, rows,
      limits, ttl_ms: info.ttlMs ?? null };
  }

  /**
   * What the ledger sends: the other cells' counters as it summed them (one row per key,
   * replaced; all-zero rows deleted), this cell's leases (one row per key, replaced) and
   * the fleet's size `cells` (from then on every key with a limit has a lease here).
   */
  async setPeers(rows, info, leases = [], cells = null) {
    await this.readThrough(info);
    const keep = rows.filter(countsAnything);
    const gone = rows.filter((r) => !countsAnything(r)).map((r) => r[EXCHANGE.key_id]);
    this.ctx.storage.transactionSync(() => {
      if (keep.length) this.sql.exec(UPSERT_PEERS, Date.now(), JSON.stringify(keep));
      if (gone.length) this.sql.exec("DELETE FROM peer_counters WHERE key_id IN (SELECT value FROM json_each(?))", JSON.stringify(gone));
      if (leases.length) this.sql.exec(UPSERT_LEASES, Date.now(), JSON.stringify(leases));
      if (cells !== null) this.setMeta("fleet_cells", cells);
    });
    return { stored: keep.length, deleted: gone.length, leases: leases.length };
  }

  /**
   * One key's peer row and own counters (the operator's view of what the exchange brought).
   * @returns {Promise<import("./payloads.js").PeersAnswer>}
   */
  async peersOf(id, info) {
    await this.readThrough(info);
    const r = this.sql.exec(`SELECT ${EXCHANGE.columns}, at FROM peer_counters WHERE key_id = ?`, id).toArray()[0] ?? null;
    const now = Date.now();
    const leases = this.leasesOf([id], now, info.keyCap ?? 0);
    return { key_id: id, peers: r, own: this.ownCounts([id], now)[id] ?? null, lease: leases ? leases[id] ?? null : null,
      fleet_cells: Number(this.meta("fleet_cells") || 0) || null };
  }

  /**
   * What isolates cache: pods, override, the key rows changed since `haveRev` and, when
   * `info` names them, the counters of the keys the caller serves.
   */
  view(haveRev = -1, info = null) {
    const now = Date.now();
    const pods = {};
    for (const r of this.sql.exec("SELECT pod, state, failures, opened_at, trial_at, updated_at FROM pod_health")) {
      pods[r.pod] = { state: r.state, failures: r.failures, opened_at: r.opened_at, trial_at: r.trial_at, updated_at: r.updated_at };
    }
    const delta = this.keyDelta(haveRev);
    const counts = info ? this.countsOf(info.keys, info, now) : {};
    const leases = info ? this.leasesOf(info.keys, now, info.keyCap ?? 0) : null;
    const imported = this.sql.exec("SELECT k FROM meta WHERE k LIKE 'imported:%'").toArray().map((r) => r.k.slice(9));
    const spent = info && info.capCell ? { ...this.spentOn(dayOf(now)), reserved: this.heldElsewhere(info, now) } : null;
    // In a fleet, its size too: a key whose lease an isolate has not asked for yet gets the
    // default share from it (router.js), as the ledger counts it, not the whole limit.
    const fleet = leases ? { leases, fleet_cells: Number(this.meta("fleet_cells")) } : {};
    return { ...delta, pods, counts, ...fleet, ...(spent ? { spent } : {}), forced: this.meta("forced"), forced_at: Number(this.meta("forced_at")) || null,
      imported, at: now, colo: this.coloOnce, ...this.podLoads(info, now) };
  }

  /**
   * What balancing reads (pods.js): `others`, the requests the cell's other isolates have in
   * flight per pod index as of their last sync (the caller's own are fresher in its memory),
   * and `slow`, the pods marked slow until when, with any pod whose streak has begun (until 0).
   */
  podLoads(info, now) {
    const out = {};
    if (info && info.isolate !== undefined) {
      const others = {};
      let any = false;
      for (const r of this.sql.exec("SELECT pod, SUM(n) AS n FROM pod_inflight WHERE isolate != ? AND at >= ? GROUP BY pod",
        String(info.isolate ?? ""), now - INFLIGHT_KEEP_MS)) {
        others[r.pod] = r.n;
        any = true;
      }
      if (any) out.others = others;
    }
    let slow = null;
    for (const [pod, p] of this.pace) {
      if (p.until > now || p.n > 0) (slow ??= {})[pod] = p.until > now ? p.until : 0;
      else this.pace.delete(pod);
    }
    if (slow) out.slow = slow;
    return out;
  }

  /** One pace verdict on an answer of `pod` (machine.js recordPace): `slow` or not, from `from.key`. */
  async reportPace(pod, slow, info, from = null) {
    await this.readThrough(info);
    const before = this.pace.get(pod) ?? initialPace();
    const next = recordPace(before, slow, Date.now(), info, from);
    if (next !== before) this.pace.set(pod, next);
    return { marked: next.until > before.until, view: this.loadedView(info) };
  }

  /** The view an outcome's answer carries: without key counters, with the caller's pod loads. */
  loadedView(info) {
    return { ...this.view(info.haveRev ?? -1), ...this.podLoads(info, Date.now()) };
  }

  /** Whether any fallback request is held in flight (read once, then kept as rows come and go). */
  anyHeld() {
    this.heldAny ??= this.sql.exec("SELECT 1 FROM fallback_held LIMIT 1").toArray().length > 0;
    return this.heldAny;
  }

  /** What the other isolates' fallback requests in flight reserved, all keys together (fresh rows only). */
  heldElsewhere(info, now) {
    if (!this.anyHeld()) return 0;
    const fresh = now - 2 * Math.max(info.ttlMs ?? 0, 1000);
    return this.sql.exec("SELECT COALESCE(SUM(microusd), 0) AS m FROM fallback_held WHERE isolate != ? AND at >= ?",
      info.isolate ?? "", fresh).one().m;
  }

  /** What the fallback's answers cost the cell on `day` (one row by primary key). */
  spentOn(day) {
    const row = this.sql.exec("SELECT microusd FROM fallback_spend WHERE day = ?", day).toArray()[0];
    return { day, microusd: row ? row.microusd : 0 };
  }

  /**
   * Apply an isolate's batched deltas and answer the current view.
   * @param {import("./payloads.js").SyncInfo} info
   * @param {import("./payloads.js").SyncBatch | null} batch
   * @returns {Promise<import("./payloads.js").SyncAnswer>}
   */
  async sync(info, batch = null) {
    await this.readThrough(info);
    const successor = this.meta("successor");
    if (batch && successor && successor !== info.generation) {
      // Late usage from the previous version's isolates: counted where the state now lives.
      try {
        const next = this.env.BREAKER.get(this.env.BREAKER.idFromName(successor));
        await next.sync({ ...info, generation: successor, draining: null, haveRev: -1, keys: [] }, batch);
        batch = null;
      } catch {
        // the successor is unreachable: keep the batch here rather than lose it
      }
    }
    const now = Date.now();
    if (batch) this.apply(batch, info, now);
    if (batch && batch.hist && batch.hist.length) this.addHist(batch.hist, now);
    /** @type {import("./payloads.js").SyncAnswer} */
    const view = this.view(info.haveRev ?? -1, info);
    // An isolate starting its key list gets the key filter too (keyfilter.js): later key rows reach it as deltas.
    if ((info.haveRev ?? -1) < 0 || view.reset) view.key_filter = this.keyFilter();
    // A stale isolate's request with a key it does not hold: found in the same round trip.
    if (Array.isArray(info.lookup) && info.lookup.length) view.found = this.byDigest(info.lookup, info);
    return view;
  }

  /** One batch, one statement per table (schema.js BULK_*), one transaction. */
  apply(batch, info, now) {
    const oldest = minuteOf(now) - 1;
    this.ctx.storage.transactionSync(() => {
      if (batch.usage && batch.usage.length) {
        const rows = JSON.stringify(batch.usage.map(usageRow));
        this.sql.exec(BULK_USAGE, rows);
        this.sql.exec(BULK_MONTH, rows);
        const spent = new Map();
        for (const u of batch.usage) {
          const c = Number(u[USAGE.fallback_microusd]) || 0;
          if (c > 0) spent.set(u[USAGE.day], (spent.get(u[USAGE.day]) ?? 0) + c);
        }
        for (const [day, c] of spent) {
          this.sql.exec(`INSERT INTO fallback_spend (day, microusd) VALUES (?, ?)
            ON CONFLICT (day) DO UPDATE SET microusd = microusd + excluded.microusd`, String(day), c);
        }
      }
      if (batch.windows && batch.windows.length) this.sql.exec(BULK_WINDOW, JSON.stringify(batch.windows), oldest);
      this.sql.exec("DELETE FROM rate_window WHERE minute < ?", oldest);
      // What a fleet's exchange reads next: the keys whose own counters this batch moved.
      const changed = new Set();
      for (const w of batch.windows || []) changed.add(String(w[WINDOW.key_id]));
      for (const u of batch.usage || []) {
        if ((u[USAGE.prompt_tokens] || 0) + (u[USAGE.completion_tokens] || 0) !== 0) changed.add(String(u[USAGE.key_id]));
      }
      this.markChanged([...changed]);
      if (batch.inflight && batch.inflight.length) {
        const isolate = String(info.isolate ?? "");
        for (const [keyId, n, tokens] of batch.inflight) {
          if (n > 0) {
            this.sql.exec(`INSERT INTO key_inflight (key_id, isolate, n, at) VALUES (?, ?, ?, ?)
              ON CONFLICT (key_id, isolate) DO UPDATE SET n = excluded.n, at = excluded.at`, keyId, isolate, n, now);
          } else {
            this.sql.exec("DELETE FROM key_inflight WHERE key_id = ? AND isolate = ?", keyId, isolate);
          }
          if (tokens > 0) { // a row of a Worker from before reservations has none
            this.sql.exec(`INSERT INTO key_reserved (key_id, isolate, tokens, at) VALUES (?, ?, ?, ?)
              ON CONFLICT (key_id, isolate) DO UPDATE SET tokens = excluded.tokens, at = excluded.at`, keyId, isolate, tokens, now);
          } else {
            this.sql.exec("DELETE FROM key_reserved WHERE key_id = ? AND isolate = ?", keyId, isolate);
          }
        }
      }
      if (batch.fallback_held && batch.fallback_held.length) {
        this.heldAny = null; // read again below
        const isolate = String(info.isolate ?? "");
        for (const r of batch.fallback_held) {
          const m = Math.max(0, Number(r[FALLBACK_HELD.microusd]) || 0);
          if (m > 0) {
            this.sql.exec(`INSERT INTO fallback_held (key_id, isolate, microusd, at) VALUES (?, ?, ?, ?)
              ON CONFLICT (key_id, isolate) DO UPDATE SET microusd = excluded.microusd, at = excluded.at`,
            String(r[FALLBACK_HELD.key_id]), isolate, m, now);
          } else this.sql.exec("DELETE FROM fallback_held WHERE key_id = ? AND isolate = ?", String(r[FALLBACK_HELD.key_id]), isolate);
        }
      }
      if (this.anyHeld() && this.sql.exec("DELETE FROM fallback_held WHERE at < ?", now - INFLIGHT_KEEP_MS).rowsWritten) this.heldAny = null;
      this.sql.exec("DELETE FROM key_inflight WHERE at < ?", now - INFLIGHT_KEEP_MS);
      this.sql.exec("DELETE FROM key_reserved WHERE at < ?", now - INFLIGHT_KEEP_MS);
      if (batch.refusals && batch.refusals.length) {
        // Labels stay the fixed set whatever an isolate sends (a newer Worker's reason is "other" here).
        const rows = batch.refusals.map((r) => [String(r[REFUSAL.key_id]), REASONS.includes(r[REFUSAL.reason]) ? r[REFUSAL.reason] : "other",
          Math.max(0, Number(r[REFUSAL.n]) | 0)]);
        this.sql.exec(BULK_REFUSALS, JSON.stringify(rows));
      }
      for (const r of batch.backends || []) {
        this.sql.exec(`INSERT INTO backend_total (backend, requests, prompt_tokens, completion_tokens) VALUES (?, ?, ?, ?)
          ON CONFLICT (backend) DO UPDATE SET requests = requests + excluded.requests,
          prompt_tokens = prompt_tokens + excluded.prompt_tokens, completion_tokens = completion_tokens + excluded.completion_tokens`,
        String(r[BACKEND.backend]), r[BACKEND.requests] | 0, r[BACKEND.prompt_tokens] | 0, r[BACKEND.completion_tokens] | 0);
      }
      if (batch.pods) {
        // This isolate's counts replace its rows: a pod index it no longer has reads 0.
        const isolate = String(info.isolate ?? "");
        this.sql.exec("DELETE FROM pod_inflight WHERE isolate = ?", isolate);
        for (const r of batch.pods) {
          const n = r[POD_INFLIGHT.n] | 0;
          if (n > 0) this.sql.exec("INSERT INTO pod_inflight (isolate, pod, n, at) VALUES (?, ?, ?, ?)", isolate, r[POD_INFLIGHT.pod] | 0, n, now);
        }
      }
      this.sql.exec("DELETE FROM pod_inflight WHERE at < ?", now - INFLIGHT_KEEP_MS);
    });
  }

  // --- scaling (colocate/scaler.py reads and records through admin.js /_colocate/scale) ---

  /**
   * The controller's signals and what controllers recorded: cumulative requests and
   * tokens by backend, requests in flight per pod index (summed over isolates; an
   * isolate's row lives until it syncs 0, or for INFLIGHT_KEEP_MS), the lock and the last
   * decision.
   */
  async scaleState(info) {
    await this.readThrough(info);
    const backends = {};
    for (const r of this.sql.exec("SELECT backend, requests, prompt_tokens, completion_tokens FROM backend_total")) {
      backends[r.backend] = { requests: r.requests, prompt_tokens: r.prompt_tokens, completion_tokens: r.completion_tokens };
    }
    const inflight = {};
    for (const r of this.sql.exec("SELECT pod, SUM(n) AS n FROM pod_inflight WHERE at >= ? GROUP BY pod",
      Date.now() - INFLIGHT_KEEP_MS)) {
      inflight[r.pod] = r.n;
    }
    return { at: Date.now(), backends, inflight, lock: this.scaleLockRow(), decision: parseJson(this.meta("scale_decision")),
      desired: parseJson(this.meta("scale_desired")) };
  }

  scaleLockRow() {
    const lock = parseJson(this.meta("scale_lock"));
    return lock && lock.until > Date.now() ? lock : null;
  }

  /**
   * The controllers' lock, a lease: granted to `owner` when free, expired or already its
   * own (renewed for `ttlMs`); `release` frees it if `owner` holds it. One transaction, so
   * two controllers asking at once cannot both get it.
   */
  async scaleLock(owner, ttlMs, release, info) {
    await this.readThrough(info);
    let granted = false;
    this.ctx.storage.transactionSync(() => {
      const held = this.scaleLockRow();
      if (held && held.owner !== owner) return;
      granted = true;
      if (release) this.setMeta("scale_lock", null);
      else this.setMeta("scale_lock", JSON.stringify({ owner, since: held ? held.since : Date.now(), until: Date.now() + ttlMs }));
    });
    return { granted, lock: this.scaleLockRow() };
  }

  /**
   * Record a decision of the lock's holder (the last one is what status and the probe show),
   * and with `desired` ({pods, draining}) the count every `pulumi up` applies.
   */
  async scaleRecord(owner, decision, info, desired = null) {
    await this.readThrough(info);
    const held = this.scaleLockRow();
    if (!held || held.owner !== owner) return { recorded: false, lock: held };
    this.ctx.storage.transactionSync(() => {
      this.setMeta("scale_decision", JSON.stringify({ ...decision, owner, at: Date.now() }));
      if (desired) this.setMeta("scale_desired", JSON.stringify({ ...desired, owner, at: Date.now() }));
    });
    return { recorded: true, lock: held };
  }

  /**
   * Keys by digest, for digests an isolate does not hold: {rev, keys: [rows], counts}.
   * Revoked keys are not returned (the isolate remembers the digest as unknown).
   */
  async lookupKeys(digests, info) {
    await this.readThrough(info);
    return { rev: this.rev(), ...this.byDigest(digests, info) };
  }

  byDigest(digests, info) {
    const list = JSON.stringify((Array.isArray(digests) ? digests : [digests]).slice(0, 1000).map(String));
    const keys = this.sql.exec(`SELECT ${KEY_VIEW_COLUMNS} FROM client_keys
      WHERE hash IN (SELECT value FROM json_each(?)) AND revoked_at IS NULL`, list).toArray().map(keyView);
    const ids = keys.map((k) => k.id);
    const now = Date.now();
    const leases = this.leasesOf(ids, now, info.keyCap ?? 0);
    return { keys, counts: this.countsOf(ids, info, now), ...(leases ? { leases } : {}) };
  }

  /**
   * Add an isolate's live histograms (HIST rows) into seg_minute and seg_total; then, at
   * most once a minute, roll at most an hour of minutes older than
   * 7 days into seg_hour and drop hours older than 35 days (index ranges, bounded work).
   */
  addHist(rows, t) {
    this.ctx.storage.transactionSync(() => {
      for (const r of rows) {
        if (!Array.isArray(r) || r.length !== HIST.length || !Number.isSafeInteger(r[HIST.at]) || !SEG_NAMES.has(r[HIST.segment])) continue;
        if (this.addSeg("seg_minute", "minute", /** @type {[number, string, string, string, string]} */ (r))) {
          this.addTotal(r[HIST.colo], r[HIST.who], r[HIST.segment], r[HIST.hist]);
        }
      }
      const m = Math.floor(t / MINUTE_MS);
      if (this.rolledAt === m) return;
      this.rolledAt = m;
      const cutoff = m - SEG_MINUTES_KEEP;
      const oldest = this.sql.exec("SELECT MIN(minute) AS m FROM seg_minute").one().m;
      if (oldest !== null && oldest < cutoff) {
        const upTo = Math.min(cutoff, oldest + 60);
        for (const r of this.sql.exec("SELECT minute, colo, pod, segment, hist FROM seg_minute WHERE minute < ?", upTo).toArray()) {
          this.addSeg("seg_hour", "hour", [Math.floor(r.minute / 60), r.colo, r.pod, r.segment, r.hist]);
        }
        this.sql.exec("DELETE FROM seg_minute WHERE minute < ?", upTo);
      }
      this.sql.exec("DELETE FROM seg_hour WHERE hour < ?", Math.floor(t / HOUR_MS) - SEG_HOURS_KEEP);
    });
  }

  /** Add one histogram row to seg_minute or seg_hour; false when its text is malformed (dropped, never stored). */
  addSeg(table, col, [at, colo, pod, segment, hist]) {
    const key = [at, String(colo), String(pod), segment];
    const prev = this.sql.exec(`SELECT hist FROM ${table} WHERE ${col} = ? AND colo = ? AND pod = ? AND segment = ?`, ...key)
      .toArray()[0];
    const merged = mergedText(prev, hist);
    if (!merged) return merged !== null;
    this.sql.exec(`INSERT INTO ${table} (${col}, colo, pod, segment, hist) VALUES (?, ?, ?, ?, ?)
      ON CONFLICT (${col}, colo, pod, segment) DO UPDATE SET hist = excluded.hist`, ...key, merged);
    return true;
  }

  /** Add a histogram to seg_total (the cumulative counts since the generation began). */
  addTotal(colo, pod, segment, hist) {
    const key = [String(colo), String(pod), segment];
    const prev = this.sql.exec("SELECT hist FROM seg_total WHERE colo = ? AND pod = ? AND segment = ?", ...key).toArray()[0];
    const merged = mergedText(prev, hist);
    if (merged) {
      this.sql.exec(`INSERT INTO seg_total (colo, pod, segment, hist) VALUES (?, ?, ?, ?)
        ON CONFLICT (colo, pod, segment) DO UPDATE SET hist = excluded.hist`, ...key, merged);
    }
  }

  /**
   * What GET /_colocate/metrics exposes (never a key or its digest): the cumulative
   * histograms, requests and tokens per backend, key counts, the breaker rows and override.
   */
  async metrics(info) {
    await this.readThrough(info);
    const now = Date.now();
    return {
      segments: this.sql.exec("SELECT colo, pod, segment, hist FROM seg_total").toArray().map((r) => [r.colo, r.pod, r.segment, r.hist]),
      served: this.sql.exec("SELECT backend, requests, prompt_tokens, completion_tokens FROM backend_total").toArray(),
      keys: this.sql.exec(`SELECT COUNT(*) AS total,
          COALESCE(SUM(revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)), 0) AS active,
          COALESCE(SUM(revoked_at IS NOT NULL), 0) AS revoked FROM client_keys`, now).one(),
      pods: this.sql.exec("SELECT pod, state, failures FROM pod_health").toArray(),
      forced: this.meta("forced"),
      refusals: this.refusalCounts(),
    };
  }

  /**
   * Each key's refusals by reason since the generation began ([key_id, reason, n]): the
   * REFUSAL_KEYS keys refused most by name, the others together as key "other" (bounded labels).
   */
  refusalCounts() {
    const top = this.sql.exec(`SELECT key_id FROM refusal_total GROUP BY key_id ORDER BY SUM(n) DESC, key_id LIMIT ?`, REFUSAL_KEYS)
      .toArray().map((r) => r.key_id);
    const list = JSON.stringify(top);
    const named = this.sql.exec(`SELECT key_id, reason, n FROM refusal_total WHERE key_id IN (SELECT value FROM json_each(?))
      ORDER BY key_id, reason`, list).toArray().map((r) => [r.key_id, r.reason, r.n]);
    const rest = this.sql.exec(`SELECT reason, SUM(n) AS n FROM refusal_total WHERE key_id NOT IN (SELECT value FROM json_each(?))
      GROUP BY reason ORDER BY reason`, list).toArray().map((r) => ["other", r.reason, r.n]);
    return [...named, ...rest];
  }

  podRow(pod) {
    const r = this.sql.exec(
      "SELECT state, failures, opened_at, trial_at, updated_at, failure_keys FROM pod_health WHERE pod = ?", pod).toArray()[0];
    if (!r) return initial();
    let keys = [];
    try {
      keys = r.failure_keys ? JSON.parse(r.failure_keys) : [];
    } catch {
      // a row written by hand: the streak's sources start afresh
    }
    return { ...initial(), ...r, failure_keys: Array.isArray(keys) ? keys : [] };
  }

  savePod(pod, snap) {
    const now = Date.now();
    if (snap.state === "closed" && snap.failures === 0) this.sql.exec("DELETE FROM pod_health WHERE pod = ?", pod);
    else {
      this.sql.exec(UPSERT_POD, pod, snap.state, snap.failures, snap.opened_at, snap.trial_at, snap.updated_at ?? now,
        JSON.stringify(snap.failure_keys || []));
    }
    this.sql.exec("DELETE FROM pod_health WHERE updated_at < ?", now - POD_ROW_TTL_MS);
  }

  /**
   * One outcome at `pod` (its URL): of a request of key `from.key`, or a failed health
   * check (`from.health`). `witness`: the streak waits for a health check (machine.js).
   */
  async report(pod, ok, info, from = null) {
    await this.readThrough(info);
    const before = this.podRow(pod);
    const next = record(before, ok, Date.now(), info, from);
    if (next !== before) this.savePod(pod, next);
    return { from: before.state, to: next.state, witness: needsWitness(next, info), view: this.loadedView(info) };
  }

  /** The half-open trial slot of `pod`: at most one holder per lease. */
  async tryTrial(pod, info) {
    await this.readThrough(info);
    const { granted, snap } = grantTrial(this.podRow(pod), Date.now(), info);
    if (granted) this.savePod(pod, snap);
    return { granted, view: this.loadedView(info) };
  }

  async setForce(force, info) {
    await this.readThrough(info);
    if (!FORCE_VALUES.includes(force)) throw new TypeError('force must be "open", "closed" or null');
    this.ctx.storage.transactionSync(() => {
      this.setMeta("forced", force);
      this.setMeta("forced_at", Date.now());
    });
    return this.view(info.haveRev ?? -1);
  }

  // --- keys and usage (operator endpoints; admin.js validates the input) ---

  async createKey(row, info) {
    await this.readThrough(info);
    this.ctx.storage.transactionSync(() => this.insertKey(row));
    return this.keyRow(row.id);
  }

  /**
   * The key filter of every key not revoked (keyfilter.js): one read of the key table the
   * first time, then each key stored is added; built again, larger, once it holds more keys
   * than it was sized for.
   */
  keyFilter() {
    if (this.keyBits === null || this.keyRoom <= 0) {
      const n = this.sql.exec("SELECT COUNT(*) AS n FROM client_keys WHERE revoked_at IS NULL").one().n;
      const bytes = filterFor(n);
      for (const r of this.sql.exec("SELECT hash FROM client_keys WHERE revoked_at IS NULL")) addDigest(bytes, r.hash);
      this.keyBits = bytes;
      this.keyRoom = (bytes.length * 8) / BITS_PER_KEY - n;
    }
    return this.keyBits;
  }

  /** A new key row at the next revision (inside the caller's transaction). */
  insertKey(row) {
    if (this.keyBits !== null) {
      addDigest(this.keyBits, row.hash);
      this.keyRoom -= 1;
    }
    this.sql.exec(`INSERT INTO client_keys (${KEY_COLUMNS}, rev) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
      row.id, row.hash, row.prefix, row.name, row.rpm, row.tpm, row.monthly_tokens, row.max_parallel ?? 0, row.created_at,
      row.expires_at, null, row.fallback_microusd_day ?? 0, this.bumpRev());
  }

  /**
   * Store a key row made elsewhere (a fleet's other cells share its id and digest), once:
   * the same id and digest again answers the stored row; an id or digest already held
   * with the other half different is a conflict. One transaction, so two imports race safely.
   */
  async importKey(row, info, fleetCells = null) {
    await this.readThrough(info);
    let outcome = "created";
    this.ctx.storage.transactionSync(() => {
      // A fleet's key before the exchange's first round: the fleet's size makes leasesOf give
      // the default share at once (the exchange sets it, and keeps it current, from then on).
      if (fleetCells && this.meta("fleet_cells") === null) this.setMeta("fleet_cells", fleetCells);
      const held = this.sql.exec("SELECT id, hash FROM client_keys WHERE id = ? OR hash = ?", row.id, row.hash).toArray();
      if (held.length) {
        outcome = held.some((h) => h.id === row.id && h.hash === row.hash) ? "exists" : "conflict";
        return;
      }
      this.insertKey(row);
    });
    return { outcome, row: outcome === "conflict" ? null : this.keyRow(row.id) };
  }

  /** Every key row with its digest (never the key): what a fleet's cells compare and copy. */
  async keyDigests(info) {
    await this.readThrough(info);
    return this.sql.exec(`SELECT ${KEY_COLUMNS} FROM client_keys ORDER BY created_at, id`).toArray();
  }

  keyRow(id) {
    return this.sql.exec(`SELECT id, prefix, name, rpm, tpm, monthly_tokens, max_parallel, fallback_microusd_day, created_at, expires_at, revoked_at
      FROM client_keys WHERE id = ?`, id).toArray()[0] ?? null;
  }

  async listKeys(info) {
    await this.readThrough(info);
    return this.sql.exec(`SELECT id, prefix, name, rpm, tpm, monthly_tokens, max_parallel, fallback_microusd_day, created_at, expires_at, revoked_at
      FROM client_keys ORDER BY created_at, id`).toArray();
  }

  async revokeKey(id, info) {
    await this.readThrough(info);
    if (!this.keyRow(id)) return null;
    this.ctx.storage.transactionSync(() => {
      const changed = this.sql.exec("UPDATE client_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", Date.now(), id).rowsWritten;
      // The row's new revision is what carries the revocation to the isolates holding it.
      if (changed) this.sql.exec("UPDATE client_keys SET rev = ? WHERE id = ?", this.bumpRev(), id);
    });
    return this.keyRow(id);
  }

  async usage(query, info) {
    await this.readThrough(info);
    const args = [query.from, query.to];
    let where = "u.day >= ? AND u.day <= ?";
    if (query.key) {
      where += " AND u.key_id = ?";
      args.push(query.key);
    }
    return this.sql.exec(`SELECT u.day, u.key_id, k.name, u.requests, u.prompt_tokens, u.completion_tokens, u.pod_requests,
        u.fallback_requests, u.estimated_tokens, u.fallback_microusd, u.refused FROM usage_daily u LEFT JOIN client_keys k ON k.id = u.key_id WHERE ${where}
        ORDER BY u.day, u.key_id`,
    ...args).toArray();
  }

  /** The live histograms from `since` (ms) on: minute rows, and hour rows older than those. */
  async live(since, info) {
    await this.readThrough(info);
    const rows = (sql, ...args) => this.sql.exec(sql, ...args).toArray().map((r) => [r.t, r.colo, r.pod, r.segment, r.hist]);
    return {
      minutes: rows("SELECT minute AS t, colo, pod, segment, hist FROM seg_minute WHERE minute >= ?", Math.floor(since / MINUTE_MS)),
      hours: rows("SELECT hour AS t, colo, pod, segment, hist FROM seg_hour WHERE hour >= ?", Math.floor(since / HOUR_MS)),
      spent: this.spentOn(dayOf(Date.now())),
    };
  }

  /** Where this object runs, measured from inside it. */
  /**
   * Where this object runs, measured from inside it (the probe asks after every deploy);
   * kept for the object's lifetime and carried in every view as `colo` (null until then:
   * a sync itself makes no outside request).
   */
  async colo() {
    this.coloOnce ??= (await fetchColo()) ?? null;
    return this.coloOnce;
  }

  /**
   * Delete everything this generation stored, its schema too: a purged generation holds
   * nothing (the router refuses the active one). The tables come back only if it is used again.
   */
  async purge() {
    if (this.purged) return { had_state: false };
    const had = this.sql.exec("SELECT COUNT(*) AS n FROM meta WHERE k != 'schema'").one().n > 0
      || this.sql.exec("SELECT COUNT(*) AS n FROM client_keys").one().n > 0;
    await this.ctx.storage.deleteAll();
    this.purged = true;
    this.keyBits = null;
    this.heldAny = null;
    return { had_state: had };
  }
}

function parseJson(text) {
  try {
    return text === null ? null : JSON.parse(text);
  } catch {
    return null;
  }
}

/** A key row as isolates hold it: `revoked` tells a holder to drop it. */
function keyView(r) {
  return { id: r.id, hash: r.hash, name: r.name, rpm: r.rpm, tpm: r.tpm, monthly_tokens: r.monthly_tokens,
    max_parallel: r.max_parallel, fallback_microusd_day: r.fallback_microusd_day, expires_at: r.expires_at, rev: r.rev,
    revoked: r.revoked_at !== null };
}

/** Two histogram texts summed; "" when both are empty, null when `hist` is malformed. */
function mergedText(prev, hist) {
  try {
    return mergeEncoded(prev ? prev.hist : "", hist); // also checks the text
  } catch {
    return null;
  }
}

/** A batch usage row; a row of a Worker from before a column was added gets 0 for it. */
function usageRow(u) {
  return u.length >= USAGE.length ? u : [...u, ...new Array(USAGE.length - u.length).fill(0)];
}

/** Month totals from daily rows (an import from an exporter that had none). */
function monthsOf(usage) {
  const by = new Map();
  for (const u of usage) {
    const k = u.key_id + "|" + u.day.slice(0, 7);
    const row = by.get(k) ?? { key_id: u.key_id, month: u.day.slice(0, 7), tokens: 0 };
    row.tokens += u.prompt_tokens + u.completion_tokens;
    by.set(k, row);
  }
  return [...by.values()];
}
