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
// generation's whole state (exportAll: override, keys, usage, counters) inside
// blockConcurrencyWhile, merges it, and records `imported:<name>` so it happens once.
// The router also calls `importFrom` before it purges a draining generation, so nothing
// is lost even if no request touched the new generation in between. Once exported, a
// generation forwards the usage batches that still reach it (isolates of the previous
// Worker version finishing their work during a deploy) to its successor.

import { DurableObject } from "cloudflare:workers";
import { FORCE_VALUES, grantTrial, initial, needsWitness, record } from "./machine.js";
import { minuteOf, monthStartDay } from "./limits.js";
import { KEY_COLUMNS, SCHEMA, SCHEMA_VERSION, UPSERT_POD, UPSERT_USAGE, UPSERT_WINDOW, USAGE_COLUMNS } from "./schema.js";
import { fetchColo } from "./trace.js";
import { ROUTED, SYNC, mergeEncoded } from "./histogram.js";

const LEGACY_KV_KEY = "breaker"; // schema 1 kept one KV entry: {snap, adopted_from}
const POD_ROW_TTL_MS = 24 * 3600 * 1000; // health rows of pods gone for a day are dropped
const MINUTE_MS = 60000;
const HOUR_MS = 3600000;
const SEG_MINUTES_KEEP = 7 * 24 * 60; // minutes kept as minutes; older ones roll up into hours
const SEG_HOURS_KEEP = 35 * 24; // hours kept
const SEG_NAMES = new Set([...ROUTED, SYNC]);

export class Breaker extends DurableObject {
  constructor(ctx, env) {
    super(ctx, env);
    this.sql = ctx.storage.sql;
    this.coloOnce = null;
    ctx.blockConcurrencyWhile(async () => this.load());
  }

  async load() {
    for (const stmt of SCHEMA) this.sql.exec(stmt);
    if (this.meta("schema") === SCHEMA_VERSION) return;
    // Schema 1 (one KV entry): keep its override; per-pod health starts fresh.
    const legacy = await this.ctx.storage.get(LEGACY_KV_KEY);
    this.ctx.storage.transactionSync(() => {
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

  bumpRev() {
    this.setMeta("rev", this.rev() + 1);
  }

  /** Copy a draining generation's state once (see the header). */
  async readThrough(info) {
    const from = info && info.draining;
    if (!from || from === info.generation || this.meta(`imported:${from}`) !== null) return;
    await this.ctx.blockConcurrencyWhile(async () => {
      if (this.meta(`imported:${from}`) !== null) return;
      const ns = this.env.BREAKER;
      const id = ns.idFromName(from);
      const other = info.drainingHint ? ns.get(id, { locationHint: info.drainingHint }) : ns.get(id);
      this.importState(from, await other.exportAll(info.generation));
    });
  }

  importState(from, data) {
    this.ctx.storage.transactionSync(() => {
      if (data.forced && this.meta("forced") === null) this.setMeta("forced", data.forced);
      for (const k of data.keys) {
        this.sql.exec(`INSERT OR IGNORE INTO client_keys (${KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
          k.id, k.hash, k.prefix, k.name, k.rpm, k.tpm, k.monthly_tokens, k.created_at, k.expires_at, k.revoked_at);
      }
      for (const u of data.usage) {
        this.sql.exec(UPSERT_USAGE, u.day, u.key_id, u.requests, u.prompt_tokens, u.completion_tokens, u.pod_requests, u.fallback_requests);
      }
      for (const w of data.windows) this.sql.exec(UPSERT_WINDOW, w.key_id, w.minute, w.requests, w.tokens);
      for (const r of data.seg_minute || []) this.addSeg("seg_minute", "minute", r); // a generation from before has none
      for (const r of data.seg_hour || []) this.addSeg("seg_hour", "hour", r);
      this.setMeta(`imported:${from}`, Date.now());
      this.bumpRev();
    });
  }

  /**
   * Everything a successor generation takes over (pod health stays: the pods change).
   * From now on usage batches that reach this generation go on to `successor`.
   */
  async exportAll(successor = null) {
    if (successor) this.setMeta("successor", successor);
    return {
      forced: this.meta("forced"),
      keys: this.sql.exec(`SELECT ${KEY_COLUMNS} FROM client_keys`).toArray(),
      usage: this.sql.exec(`SELECT ${USAGE_COLUMNS} FROM usage_daily`).toArray(),
      windows: this.sql.exec("SELECT key_id, minute, requests, tokens FROM rate_window").toArray(),
      seg_minute: this.sql.exec("SELECT minute, colo, pod, segment, hist FROM seg_minute").toArray()
        .map((r) => [r.minute, r.colo, r.pod, r.segment, r.hist]),
      seg_hour: this.sql.exec("SELECT hour, colo, pod, segment, hist FROM seg_hour").toArray()
        .map((r) => [r.hour, r.colo, r.pod, r.segment, r.hist]),
    };
  }

  /** Import a named generation now (the router calls this before purging it). */
  async importFrom(info) {
    await this.readThrough(info);
    return { imported: this.meta(`imported:${info.draining}`) !== null };
  }

  /**
   * What isolates cache. `haveRev` is the keys revision the caller holds: the key list is
   * sent only when it changed (null otherwise), so a sync stays small.
   */
  view(haveRev = -1) {
    const now = Date.now();
    const pods = {};
    for (const r of this.sql.exec("SELECT pod, state, failures, opened_at, trial_at, updated_at FROM pod_health")) {
      pods[r.pod] = { state: r.state, failures: r.failures, opened_at: r.opened_at, trial_at: r.trial_at, updated_at: r.updated_at };
    }
    const rev = this.rev();
    const keys = rev === haveRev ? null : this.sql.exec(
      "SELECT id, hash, name, rpm, tpm, monthly_tokens, expires_at FROM client_keys WHERE revoked_at IS NULL").toArray();
    const m = minuteOf(now);
    const counts = {};
    const slot = (id) => (counts[id] ??= { minute: m, req: 0, tok: 0, prev_req: 0, prev_tok: 0, month_tokens: 0 });
    for (const w of this.sql.exec("SELECT key_id, minute, requests, tokens FROM rate_window WHERE minute >= ?", m - 1)) {
      const c = slot(w.key_id);
      if (w.minute === m) {
        c.req += w.requests;
        c.tok += w.tokens;
      } else {
        c.prev_req += w.requests;
        c.prev_tok += w.tokens;
      }
    }
    const month = this.sql.exec(
      "SELECT key_id, SUM(prompt_tokens + completion_tokens) AS t FROM usage_daily WHERE day >= ? GROUP BY key_id", monthStartDay(now));
    for (const r of month) if (r.t > 0) slot(r.key_id).month_tokens = r.t;
    const imported = this.sql.exec("SELECT k FROM meta WHERE k LIKE 'imported:%'").toArray().map((r) => r.k.slice(9));
    return { rev, keys, pods, counts, forced: this.meta("forced"), forced_at: Number(this.meta("forced_at")) || null,
      imported, at: now, colo: this.coloOnce };
  }

  /** Apply an isolate's batched deltas and answer the current view. */
  async sync(info, batch = null) {
    await this.readThrough(info);
    this.learnColo();
    const successor = this.meta("successor");
    if (batch && successor && successor !== info.generation) {
      // Late usage from the previous version's isolates: counted where the state now lives.
      try {
        const next = this.env.BREAKER.get(this.env.BREAKER.idFromName(successor));
        await next.sync({ ...info, generation: successor, draining: null, haveRev: -1 }, batch);
        batch = null;
      } catch {
        // the successor is unreachable: keep the batch here rather than lose it
      }
    }
    if (batch && batch.hist && batch.hist.length) this.addHist(batch.hist, Date.now());
    if (batch && (batch.usage.length || batch.windows.length)) {
      const oldest = minuteOf(Date.now()) - 1;
      this.ctx.storage.transactionSync(() => {
        for (const u of batch.usage) this.sql.exec(UPSERT_USAGE, ...u);
        for (const w of batch.windows) if (w[1] >= oldest) this.sql.exec(UPSERT_WINDOW, ...w);
        this.sql.exec("DELETE FROM rate_window WHERE minute < ?", oldest);
      });
    }
    return this.view(info.haveRev ?? -1);
  }

  /**
   * Add an isolate's live histograms (rows [minute, colo, pod, segment, "index:count,..."])
   * into seg_minute; then, at most once a minute, roll at most an hour of minutes older than
   * 7 days into seg_hour and drop hours older than 35 days (index ranges, bounded work).
   */
  addHist(rows, t) {
    this.ctx.storage.transactionSync(() => {
      for (const r of rows) {
        if (!Array.isArray(r) || r.length !== 5 || !Number.isSafeInteger(r[0]) || !SEG_NAMES.has(r[3])) continue;
        this.addSeg("seg_minute", "minute", r);
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

  addSeg(table, col, [at, colo, pod, segment, hist]) {
    const key = [at, String(colo), String(pod), segment];
    const prev = this.sql.exec(`SELECT hist FROM ${table} WHERE ${col} = ? AND colo = ? AND pod = ? AND segment = ?`, ...key)
      .toArray()[0];
    let merged;
    try {
      merged = prev ? mergeEncoded(prev.hist, hist) : mergeEncoded("", hist); // also checks the text
    } catch {
      return; // a malformed row from an isolate: dropped, never stored
    }
    this.sql.exec(`INSERT INTO ${table} (${col}, colo, pod, segment, hist) VALUES (?, ?, ?, ?, ?)
      ON CONFLICT (${col}, colo, pod, segment) DO UPDATE SET hist = excluded.hist`, ...key, merged);
  }

  /** Where this object runs: fetched once per object lifetime, in the background. */
  learnColo() {
    if (this.coloOnce !== null || this.coloAsked) return;
    this.coloAsked = true;
    this.ctx.waitUntil(fetchColo().then((c) => { this.coloOnce = c ?? null; }, () => {}));
  }

  podRow(pod) {
    const select = () => this.sql.exec(
      "SELECT state, failures, opened_at, trial_at, updated_at, failure_keys FROM pod_health WHERE pod = ?", pod).toArray()[0];
    let r;
    try {
      r = select();
    } catch (err) {
      // A table made before failure_keys (a deployed schema-2 object): add the column once.
      if (!/failure_keys/.test(String(err && err.message))) throw err;
      this.sql.exec("ALTER TABLE pod_health ADD COLUMN failure_keys TEXT");
      r = select();
    }
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
      this.sql.exec(UPSERT_POD, pod, snap.state, snap.failures, snap.opened_at, snap.trial_at, snap.updated_at ?? now);
      this.sql.exec("UPDATE pod_health SET failure_keys = ? WHERE pod = ?", JSON.stringify(snap.failure_keys || []), pod);
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
    return { from: before.state, to: next.state, witness: needsWitness(next, info), view: this.view(info.haveRev ?? -1) };
  }

  /** The half-open trial slot of `pod`: at most one holder per lease. */
  async tryTrial(pod, info) {
    await this.readThrough(info);
    const { granted, snap } = grantTrial(this.podRow(pod), Date.now(), info);
    if (granted) this.savePod(pod, snap);
    return { granted, view: this.view(info.haveRev ?? -1) };
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
    this.ctx.storage.transactionSync(() => {
      this.sql.exec(`INSERT INTO client_keys (${KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
        row.id, row.hash, row.prefix, row.name, row.rpm, row.tpm, row.monthly_tokens, row.created_at, row.expires_at, null);
      this.bumpRev();
    });
    return this.keyRow(row.id);
  }

  keyRow(id) {
    return this.sql.exec("SELECT id, prefix, name, rpm, tpm, monthly_tokens, created_at, expires_at, revoked_at FROM client_keys WHERE id = ?", id)
      .toArray()[0] ?? null;
  }

  async listKeys(info) {
    await this.readThrough(info);
    return this.sql.exec(
      "SELECT id, prefix, name, rpm, tpm, monthly_tokens, created_at, expires_at, revoked_at FROM client_keys ORDER BY created_at, id").toArray();
  }

  async revokeKey(id, info) {
    await this.readThrough(info);
    if (!this.keyRow(id)) return null;
    this.ctx.storage.transactionSync(() => {
      this.sql.exec("UPDATE client_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", Date.now(), id);
      this.bumpRev();
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
        u.fallback_requests FROM usage_daily u LEFT JOIN client_keys k ON k.id = u.key_id WHERE ${where} ORDER BY u.day, u.key_id`,
    ...args).toArray();
  }

  /** The live histograms from `since` (ms) on: minute rows, and hour rows older than those. */
  async live(since, info) {
    await this.readThrough(info);
    const rows = (sql, ...args) => this.sql.exec(sql, ...args).toArray().map((r) => [r.t, r.colo, r.pod, r.segment, r.hist]);
    return {
      minutes: rows("SELECT minute AS t, colo, pod, segment, hist FROM seg_minute WHERE minute >= ?", Math.floor(since / MINUTE_MS)),
      hours: rows("SELECT hour AS t, colo, pod, segment, hist FROM seg_hour WHERE hour >= ?", Math.floor(since / HOUR_MS)),
    };
  }

  /** Where this object runs, measured from inside it. */
  async colo() {
    return fetchColo();
  }

  /** Delete every stored row of this generation (the router refuses the active one). */
  async purge() {
    const had = this.sql.exec("SELECT COUNT(*) AS n FROM meta WHERE k != 'schema'").one().n > 0
      || this.sql.exec("SELECT COUNT(*) AS n FROM client_keys").one().n > 0;
    await this.ctx.storage.deleteAll();
    await this.load();
    return { had_state: had };
  }
}
