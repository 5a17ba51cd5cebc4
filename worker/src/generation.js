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
// call that names it takes its head (one round trip: override, spend, sizes) and starts
// importing its rows in the background (migration.js: paged, each chunk its own
// transaction with the cursor, driven by this object's alarm, resumed after a reset); the
// calls meanwhile are served at once, fetching the rows of the keys they need ahead of the
// import. `imported:<name>` records the end. The router's purge of a draining generation
// asks `importFrom` first and is refused until the import is done. Once exported, a
// generation forwards the usage batches that still reach it (isolates of the previous
// Worker version finishing their work during a deploy) to its successor.

import { DurableObject } from "cloudflare:workers";
import { FORCE_VALUES, grantTrial, initial, initialPace, needsWitness, record, recordPace } from "./machine.js";
import { dayOf, minuteOf } from "./limits.js";
import {
  ADDED_COLUMNS, BULK_MONTH, BULK_REFUSALS, BULK_USAGE, BULK_WINDOW, INDEXES, KEY_COLUMNS, KEY_VIEW_COLUMNS, MARK_CHANGED, SCHEMA,
  SCHEMA_VERSION, UPSERT_LEASES, UPSERT_PEERS, UPSERT_POD,
} from "./schema.js";
import { counts as countsAnything, fallbackCapOf, monthOf, provisionalLease } from "./fleetexchange.js";
import { BACKEND, COUNTER, EXCHANGE, FALLBACK_HELD, HIST, LEASE, POD_INFLIGHT, REFUSAL, USAGE, WINDOW } from "./payloads.js";
import { REASONS, REFUSAL_KEYS } from "./refusals.js";
import { fetchColo } from "./trace.js";
import { LIVE, SYNC, mergeEncoded } from "./histogram.js";
import { BITS_PER_KEY, addDigest, filterFor } from "./keyfilter.js";
import { log } from "./errors.js";
import {
  MERGE_ROWS, PARTS, PUMP_SLICE_MS, exportHead, exportKeys, exportPage, exportRange, importingView, keyCounts, kick,
  mergeRows, pendingKeyCounts, pendingRows, progressOf, pullKeys, pump, retryDelay, running, startImport,
} from "./migration.js";

export { EXPORT_ROWS, MERGE_ROWS, importMemory } from "./migration.js";

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

const IMPORT_WAIT_MS = 5000; // how long importFrom (the purge's question) lets the import run before it answers

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
    this.known = new Set(); // generations imported, or being imported (migration.js)
    this.importing = null; // the generations being imported, as storage says (migration.js running)
    this.kicked = false; // the alarm was checked since this instance began
    this.heads = null; // generation -> the promise of its import's head, while it is taken
    this.pumping = null; // the import's run in progress (migration.js pump), shared by callers
    this.hold = null; // a read that needs the import still (migration.js pendingKeyCounts)
    this.failures = 0; // the import's failed runs in a row (the alarm waits longer after each)
    this.lastError = null;
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

  /**
   * The migration's part in every call (see the header): the first call naming a draining
   * generation not imported yet starts its import (waiting for its head only); after a
   * reset, the first call makes sure the alarm goes on with an import under way.
   */
  async readThrough(info) {
    await this.unpurge();
    const from = info && info.draining;
    if (from && from !== info.generation && !this.known.has(from)) {
      if (this.meta(`imported:${from}`) === null && !progressOf(this, from)) {
        await startImport(this, from, info.generation, info.drainingHint || null);
      }
      this.known.add(from);
    }
    if (!this.kicked && running(this).length) {
      this.kicked = true;
      await kick(this);
    }
  }

  /** The alarm runs the imports under way, a slice at a time (migration.js). */
  async alarm() {
    const { done, failed } = await pump(this, Date.now() + PUMP_SLICE_MS);
    if (failed) log(this.env, "import_failed", { failures: this.failures, error: this.lastError });
    if (!done) await this.ctx.storage.setAlarm(Date.now() + retryDelay(failed ? this.failures : 0));
  }

  /**
   * A whole export at once ({forced, keys: [...], usage: [...], seg_minute: [...], ...}, rows
   * as exportAll's pages carry them), merged MERGE_ROWS rows a transaction: a bench's or
   * test's bulk seed (bench/scale.py, bench/migration.py), reachable through the namespace only.
   */
  importState(from, data) {
    if (data.forced && this.meta("forced") === null) this.setMeta("forced", data.forced);
    PARTS.forEach(([name], part) => {
      const rows = data[name] ?? [];
      for (let i = 0; i < rows.length; i += MERGE_ROWS) {
        this.ctx.storage.transactionSync(() => mergeRows(this, part, rows.slice(i, i + MERGE_ROWS)));
      }
    });
    this.setMeta(`imported:${from}`, Date.now());
  }

  // --- the migration, the exporter's side (migration.js; a successor calls these) ---

  /** The head of an export: override, spend, sizes; from now on batches go on to `successor`. */
  async exportHead(successor) {
    await this.unpurge();
    return exportHead(this, successor);
  }

  /**
   * A page of the export after `cursor` ({part, after}; null: from the start): at most
   * EXPORT_ROWS rows from as many parts as fit, each row with its rowid. Pod health stays
   * (the pods change with the region).
   */
  async exportAll(successor = null, cursor = null) {
    await this.unpurge();
    if (successor) this.setMeta("successor", successor);
    return exportPage(this, cursor);
  }

  /** Every row of these keys (by id or digest) in the keyed parts: what a successor needs ahead of its import. */
  async exportKeys(ids, digests) {
    await this.unpurge();
    return exportKeys(this, ids.map(String).slice(0, 1000), digests.map(String).slice(0, 1000));
  }

  /** A page of one part's rows after rowid `after`, filtered (a successor's whole-table read). */
  async exportRange(name, after, filter) {
    await this.unpurge();
    return exportRange(this, name, after, filter);
  }

  /** Key counts after rowid `after`, but for the ids in `exclude` (a successor's metrics). */
  async keyCounts(after, exclude, now) {
    await this.unpurge();
    return keyCounts(this, after, exclude, now);
  }

  /**
   * Import a named generation (the router asks before it purges it): starts it if needed,
   * lets it run up to IMPORT_WAIT_MS, then answers {imported, progress} (progress: rows
   * merged of total, while it runs).
   */
  async importFrom(info) {
    await this.readThrough(info);
    const from = info.draining;
    if (this.meta(`imported:${from}`) === null && progressOf(this, from)) {
      await Promise.race([pump(this, Date.now() + IMPORT_WAIT_MS), new Promise((resolve) => setTimeout(resolve, IMPORT_WAIT_MS))]);
    }
    const progress = importingView(this).find((p) => p.from === from) ?? null;
    return { imported: this.meta(`imported:${from}`) !== null, progress };
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
   * plus the other isolates' requests in flight, their reserved tokens and their prompts not
   * begun at a pod. Five indexed reads, whatever the number of keys. In a fleet the other cells' counters are not added: each cell's share is its
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
    for (const r of this.sql.exec(`SELECT key_id, SUM(tokens) AS tokens FROM key_prompt
        WHERE key_id IN (SELECT value FROM json_each(?)) AND isolate != ? AND at >= ? GROUP BY key_id`,
    JSON.stringify(ids), info.isolate ?? "", fresh)) {
      if (r.tokens > 0) slot(r.key_id)[COUNTER.prompt_inflight] = r.tokens;
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
    await pullKeys(this, marks.map((r) => r.key_id));
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
    // Their rows first, if a migration has not brought them yet: the import must not replace these.
    await pullKeys(this, [...rows.map((r) => r[EXCHANGE.key_id]), ...leases.map((l) => l[LEASE.key_id])]);
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
    await pullKeys(this, [id]);
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
    // A migration under way: how far its import is (the probe and migrate.py show it).
    const importing = this.importing === null || this.importing.length ? importingView(this) : [];
    return { ...delta, pods, counts, ...fleet, ...(spent ? { spent } : {}), forced: this.meta("forced"), forced_at: Number(this.meta("forced_at")) || null,
      imported, ...(importing.length ? { importing } : {}), at: now, colo: this.coloOnce, ...this.podLoads(info, now) };
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
      // Unreachable, the call fails and the isolate keeps the batch for its next sync: written
      // here, it could land behind the successor's import cursor and never be counted.
      const next = this.env.BREAKER.get(this.env.BREAKER.idFromName(successor));
      await next.sync({ ...info, generation: successor, draining: null, haveRev: -1, keys: [] }, batch);
      batch = null;
    }
    if (this.importing === null || this.importing.length) {
      // A migration under way: the rows of the keys this isolate asks about come first.
      await pullKeys(this, Array.isArray(info.keys) ? info.keys : [], Array.isArray(info.lookup) ? info.lookup : []);
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
        for (const [keyId, n, tokens, prompt] of batch.inflight) {
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
          if (prompt > 0) { // a row of a Worker from before max_parallel_tokens has none
            this.sql.exec(`INSERT INTO key_prompt (key_id, isolate, tokens, at) VALUES (?, ?, ?, ?)
              ON CONFLICT (key_id, isolate) DO UPDATE SET tokens = excluded.tokens, at = excluded.at`, keyId, isolate, prompt, now);
          } else {
            this.sql.exec("DELETE FROM key_prompt WHERE key_id = ? AND isolate = ?", keyId, isolate);
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
      this.sql.exec("DELETE FROM key_prompt WHERE at < ?", now - INFLIGHT_KEEP_MS);
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

  // --- scaling (colocate/scaling/controller.py reads and records through admin.js /_colocate/scale) ---

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
      desired: parseJson(this.meta("scale_desired")), keeper: parseJson(this.meta("keeper")) };
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
   * with `desired` ({pods, draining, replaced?}) what every `pulumi up` applies (a desired
   * without `replaced` keeps the one recorded), and with `keeper` the keeper's last pass.
   */
  async scaleRecord(owner, decision, info, desired = null, keeper = null) {
    await this.readThrough(info);
    const held = this.scaleLockRow();
    if (!held || held.owner !== owner) return { recorded: false, lock: held };
    this.ctx.storage.transactionSync(() => {
      this.setMeta("scale_decision", JSON.stringify({ ...decision, owner, at: Date.now() }));
      if (desired) {
        const replaced = desired.replaced ?? parseJson(this.meta("scale_desired"))?.replaced;
        this.setMeta("scale_desired", JSON.stringify({ ...desired, ...(replaced ? { replaced } : {}), owner, at: Date.now() }));
      }
      if (keeper) this.setMeta("keeper", JSON.stringify({ ...keeper, owner, at: Date.now() }));
    });
    return { recorded: true, lock: held };
  }

  /**
   * Keys by digest, for digests an isolate does not hold: {rev, keys: [rows], counts}.
   * Revoked keys are not returned (the isolate remembers the digest as unknown).
   */
  async lookupKeys(digests, info) {
    await this.readThrough(info);
    await pullKeys(this, [], (Array.isArray(digests) ? digests : [digests]).slice(0, 1000).map(String));
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
      const good = rows.filter((r) => Array.isArray(r) && r.length === HIST.length && Number.isSafeInteger(r[HIST.at])
        && SEG_NAMES.has(r[HIST.segment]));
      const kept = this.mergeSegs("seg_minute", ["minute", "colo", "pod", "segment"],
        good.map((r) => [r[HIST.at], String(r[HIST.colo]), String(r[HIST.who]), r[HIST.segment], r[HIST.hist]]));
      this.mergeSegs("seg_total", ["colo", "pod", "segment"], kept.map((r) => r.slice(1)));
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

  /**
   * Add rows (the key's columns `cols`, then the text) into `table` as `addSeg` adds them one
   * by one, in two statements: the stored rows of their keys read at once, merged in order,
   * written at once (a sync's rows took four statements each). The rows whose text was well
   * formed; the others are dropped, never stored.
   */
  mergeSegs(table, cols, rows) {
    if (rows.length === 0) return rows;
    const n = cols.length;
    const keyOf = (r) => JSON.stringify(r.slice(0, n));
    const names = cols.join(", ");
    const texts = new Map(); // key -> its text, stored or merged so far
    const asked = JSON.stringify(rows.map((r) => r.slice(0, n)));
    const from = cols.map((_, i) => `value ->> ${i}`).join(", ");
    for (const r of this.sql.exec(`SELECT ${names}, hist FROM ${table} WHERE (${names}) IN (SELECT ${from} FROM json_each(?))`, asked)) {
      texts.set(keyOf(cols.map((c) => r[c])), r.hist);
    }
    const kept = [];
    const changed = new Map();
    for (const r of rows) {
      const k = keyOf(r);
      const merged = mergedText(texts.has(k) ? { hist: texts.get(k) } : undefined, r[n]);
      if (merged === null) continue;
      kept.push(r);
      if (!merged) continue;
      texts.set(k, merged);
      changed.set(k, [...r.slice(0, n), merged]);
    }
    if (changed.size) {
      this.sql.exec(`INSERT INTO ${table} (${names}, hist) SELECT ${from}, value ->> ${n} FROM json_each(?) WHERE true
        ON CONFLICT (${names}) DO UPDATE SET hist = excluded.hist`, JSON.stringify([...changed.values()]));
    }
    return kept;
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
    // A migration under way: with what its import has not brought yet.
    const pendingKeys = await pendingKeyCounts(this, now);
    const pendingSegs = await pendingRows(this, "seg_total");
    const keys = this.sql.exec(`SELECT COUNT(*) AS total,
        COALESCE(SUM(revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)), 0) AS active,
        COALESCE(SUM(revoked_at IS NOT NULL), 0) AS revoked FROM client_keys`, now).one();
    for (const k of ["total", "active", "revoked"]) keys[k] += pendingKeys[k];
    const segments = sumHists(this.sql.exec("SELECT colo, pod, segment, hist FROM seg_total").toArray()
      .map((r) => [r.colo, r.pod, r.segment, r.hist]), pendingSegs(), 3);
    return {
      segments,
      served: this.sql.exec("SELECT backend, requests, prompt_tokens, completion_tokens FROM backend_total").toArray(),
      keys,
      pods: this.sql.exec("SELECT pod, state, failures FROM pod_health").toArray(),
      forced: this.meta("forced"),
      refusals: this.refusalCounts(),
      keeper: parseJson(this.meta("keeper")),
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
    this.sql.exec(`INSERT INTO client_keys (${KEY_COLUMNS}, rev) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
      row.id, row.hash, row.prefix, row.name, row.rpm, row.tpm, row.monthly_tokens, row.max_parallel ?? 0, row.created_at,
      row.expires_at, null, row.fallback_microusd_day ?? 0, row.max_parallel_tokens ?? null, this.bumpRev());
  }

  /**
   * Store a key row made elsewhere (a fleet's other cells share its id and digest), once:
   * the same id and digest again answers the stored row; an id or digest already held
   * with the other half different is a conflict. One transaction, so two imports race safely.
   */
  async importKey(row, info, fleetCells = null) {
    await this.readThrough(info);
    await pullKeys(this, [String(row.id)], [String(row.hash)]);
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
    const pending = await pendingRows(this, "keys");
    return withPendingKeys(this.sql.exec(`SELECT ${KEY_COLUMNS} FROM client_keys ORDER BY created_at, id`).toArray(), pending());
  }

  keyRow(id) {
    return this.sql.exec(`SELECT id, prefix, name, rpm, tpm, monthly_tokens, max_parallel, max_parallel_tokens, fallback_microusd_day, created_at,
      expires_at, revoked_at
      FROM client_keys WHERE id = ?`, id).toArray()[0] ?? null;
  }

  async listKeys(info) {
    await this.readThrough(info);
    const pending = await pendingRows(this, "keys");
    return withPendingKeys(this.sql.exec(`SELECT id, prefix, name, rpm, tpm, monthly_tokens, max_parallel, max_parallel_tokens,
      fallback_microusd_day, created_at, expires_at, revoked_at
      FROM client_keys ORDER BY created_at, id`).toArray(), pending().map(({ hash, ...row }) => row));
  }

  async revokeKey(id, info) {
    await this.readThrough(info);
    await pullKeys(this, [String(id)]); // a key a migration has not brought yet is revoked here, and stays so
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
      await pullKeys(this, [String(query.key)]);
    }
    // A migration under way: with the daily rows its import has not brought yet, added.
    const pending = query.key ? () => [] : await pendingRows(this, "usage", { from: query.from, to: query.to });
    const rows = this.sql.exec(`SELECT u.day, u.key_id, k.name, u.requests, u.prompt_tokens, u.completion_tokens, u.pod_requests,
        u.fallback_requests, u.estimated_tokens, u.fallback_microusd, u.refused FROM usage_daily u LEFT JOIN client_keys k ON k.id = u.key_id WHERE ${where}
        ORDER BY u.day, u.key_id`,
    ...args).toArray();
    const more = pending();
    if (!more.length) return rows;
    const by = new Map(rows.map((r) => [`${r.day}|${r.key_id}`, r]));
    for (const u of more) {
      const k = `${u.day}|${u.key_id}`;
      const r = by.get(k);
      if (!r) by.set(k, { day: u.day, key_id: u.key_id, name: this.keyRow(u.key_id)?.name ?? null, ...countsOfUsage(u) });
      else for (const [c, n] of Object.entries(countsOfUsage(u))) r[c] += n;
    }
    return [...by.values()].sort((a, b) => (a.day < b.day ? -1 : a.day > b.day ? 1 : a.key_id < b.key_id ? -1 : a.key_id > b.key_id ? 1 : 0));
  }

  /** The live histograms from `since` (ms) on: minute rows, and hour rows older than those. */
  async live(since, info) {
    await this.readThrough(info);
    const minute = Math.floor(since / MINUTE_MS);
    const hour = Math.floor(since / HOUR_MS);
    // A migration under way: with the histograms its import has not brought yet, added.
    const pendingMinutes = await pendingRows(this, "seg_minute", { since: minute });
    const pendingHours = await pendingRows(this, "seg_hour", { since: hour });
    const rows = (sql, ...args) => this.sql.exec(sql, ...args).toArray().map((r) => [r.t, r.colo, r.pod, r.segment, r.hist]);
    return {
      minutes: sumHists(rows("SELECT minute AS t, colo, pod, segment, hist FROM seg_minute WHERE minute >= ?", minute), pendingMinutes(), 4),
      hours: sumHists(rows("SELECT hour AS t, colo, pod, segment, hist FROM seg_hour WHERE hour >= ?", hour), pendingHours(), 4),
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
    this.known = new Set();
    this.importing = null;
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
    max_parallel: r.max_parallel, max_parallel_tokens: r.max_parallel_tokens, fallback_microusd_day: r.fallback_microusd_day,
    expires_at: r.expires_at, rev: r.rev,
    revoked: r.revoked_at !== null };
}

/**
 * Histogram rows ([...key, hist], the key `width` columns) with `more` added in: rows of the
 * same key summed (a migration's rows not imported yet, added to a read).
 */
function sumHists(rows, more, width) {
  if (!more.length) return rows;
  const by = new Map(rows.map((r) => [JSON.stringify(r.slice(0, width)), r]));
  for (const r of more) {
    const k = JSON.stringify(r.slice(0, width));
    const prev = by.get(k);
    const merged = mergedText(prev ? { hist: prev[width] } : undefined, r[width]);
    if (merged) by.set(k, [...r.slice(0, width), merged]);
  }
  return [...by.values()];
}

/** Two histogram texts summed; "" when both are empty, null when `hist` is malformed. */
function mergedText(prev, hist) {
  try {
    return mergeEncoded(prev ? prev.hist : "", hist); // also checks the text
  } catch {
    return null;
  }
}

/** The counted columns of an exported usage row (USAGE's after the row's key). */
function countsOfUsage(u) {
  const out = {};
  for (const n of USAGE.names.slice(USAGE.requests)) out[n] = u[n] ?? 0;
  return out;
}

/** Key rows with a migration's rows not imported yet (`more`), by id, in created_at, id order. */
function withPendingKeys(rows, more) {
  if (!more.length) return rows;
  const have = new Set(rows.map((r) => r.id));
  const all = [...rows, ...more.filter((r) => !have.has(r.id))];
  return all.sort((a, b) => a.created_at - b.created_at || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
}

/** A batch usage row; a row of a Worker from before a column was added gets 0 for it. */
function usageRow(u) {
  return u.length >= USAGE.length ? u : [...u, ...new Array(USAGE.length - u.length).fill(0)];
}
