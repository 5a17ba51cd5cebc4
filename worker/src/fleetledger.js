// @ts-check
// The fleet's exchange of limit counters: one Durable Object of the front door's Worker
// (idFromName("ledger")), driven by its alarm every EXCHANGE_MS while the fleet is used.
//
// A round: from every cell, over its service binding and with its exchange token, the own
// counters of the keys that changed since this ledger's cursor for that cell
// (GET /_colocate/fleet/counters?since=<cursor>; the cell reads them by index, so a round
// costs what changed, not how many keys exist); stored per (cell, key) with this ledger's
// own sequence number; then to every cell, for the keys other cells changed since what
// that cell was last sent, the sum of the other cells' counters
// (POST /_colocate/fleet/peers). A cell that does not answer is skipped: its cursor (or
// what it is owed) stays, so the next round catches up.
//
// Leases: for every key whose counters moved (and every key with a lease decrease now
// certainly in effect), each cell's share of the key's rpm, tpm and monthly tokens
// (fleetexchange.js fairShares, grant), sent with the peers, with the fleet's size. The
// ledger keeps, per cell and key, the largest lease the cell may still be using (`held`:
// a replaced lease is used by the cell's isolates until their view's TTL after the push
// landed), so that what every cell may still admit never sums past the key's cap. The hot
// path never waits on any of this: each cell's isolates read their leases from their own
// generation through their usual sync.
//
// The front door pokes the ledger (fleetexchange.js pokeLedger, in the background); the
// alarm stops rescheduling QUIET_MS after the last poke once a round moves nothing, so an
// idle fleet costs nothing. See docs/fleet.md, "Limits across cells".

import { DurableObject } from "cloudflare:workers";
import { log } from "./errors.js";
import { readFleet } from "./fleetfront.js";
import {
  MAX_ROWS, aligned, dayOf, defaultShare, fairShares, floorShare, grant, monthOf, rowProblem, sumRows, upgradeRow, weights,
} from "./fleetexchange.js";
import { WINDOW_MS, minuteOf } from "./limits.js";
import { EXCHANGE, LEASE } from "./payloads.js";
import { now } from "./timing.js";

export const QUIET_MS = 30_000; // rounds go on this long after the last poke (and while they move counters)
const PULL_PAGES = 5; // pages of changed keys per cell per round; the rest come next round
// After a push lands, a cell's isolates may use the lease it replaced for their view's TTL,
// plus this for a sync that read the object just before the push and answers after it.
export const GRACE_MARGIN_MS = 1000;
// A cell that sent a key's counters this recently is using the key (fleetexchange.js weights).
export const ACTIVE_MS = 2000;
const UNKNOWN_TTL_MS = 60_000; // a cell whose TTL the ledger has not learnt yet (never pulled)
// The limits a lease shares: [limit's column in key_limits, the lease's columns, the period a
// count or lease holds for (null: the sliding minute)]. `fallback`: the key's daily cap on the
// fallback's spend, in millionths of a dollar (its own, else its cell's per-key cap).
const RESOURCES = [["rpm", "req", "held_req", null], ["tpm", "tok", "held_tok", null],
  ["monthly_tokens", "month_tokens", "held_month_tokens", "month"], ["fallback", "fallback_microusd", "held_fallback_microusd", "day"]];

const SCHEMA = [
  `CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)`,
  // Per cell: where its changes were read up to (its own sequence), and what it was sent (ours).
  `CREATE TABLE IF NOT EXISTS cells (cell TEXT PRIMARY KEY, generation TEXT, cursor INTEGER NOT NULL DEFAULT 0,
     pushed INTEGER NOT NULL DEFAULT 0)`,
  // The limits of the keys seen, as the cells report them (a key's limits never change).
  `CREATE TABLE IF NOT EXISTS key_limits (key_id TEXT PRIMARY KEY, rpm INTEGER NOT NULL, tpm INTEGER NOT NULL,
     monthly_tokens INTEGER NOT NULL)`,
  // Per cell and key: the lease decided (req, tok, month_tokens for `month`; null: no such
  // limit), the largest one the cell may still use (held_*), when held falls to the lease
  // (until: the last push's landing + grace; null while a push is owed), sent: 0 while owed.
  `CREATE TABLE IF NOT EXISTS leases (cell TEXT NOT NULL, key_id TEXT NOT NULL, month TEXT NOT NULL,
     req INTEGER, tok INTEGER, month_tokens INTEGER, held_req INTEGER, held_tok INTEGER, held_month_tokens INTEGER,
     until INTEGER, sent INTEGER NOT NULL, PRIMARY KEY (cell, key_id))`,
  `CREATE INDEX IF NOT EXISTS leases_owed ON leases (cell, sent)`,
  `CREATE INDEX IF NOT EXISTS leases_until ON leases (until)`,
  // Each cell's own counters per key, as last pulled; seq: this ledger's sequence when stored.
  `CREATE TABLE IF NOT EXISTS counters (cell TEXT NOT NULL, key_id TEXT NOT NULL, minute INTEGER NOT NULL,
     req INTEGER NOT NULL, tok INTEGER NOT NULL, prev_req INTEGER NOT NULL, prev_tok INTEGER NOT NULL,
     month TEXT NOT NULL, month_tokens INTEGER NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (cell, key_id))`,
  `CREATE INDEX IF NOT EXISTS counters_seq ON counters (seq)`,
  `CREATE INDEX IF NOT EXISTS counters_key ON counters (key_id)`,
];

// A cell's row as pulled (payloads.js EXCHANGE, the counters table's columns by name).
const UPSERT_COUNTERS = `INSERT INTO counters (cell, ${EXCHANGE.columns}, seq)
  VALUES (?, ${EXCHANGE.names.map(() => "?").join(", ")}, ?) ON CONFLICT (cell, key_id) DO UPDATE SET
  ${[...EXCHANGE.names.filter((n) => n !== "key_id"), "seq"].map((n) => `${n} = excluded.${n}`).join(", ")}`;

export class FleetLedger extends DurableObject {
  constructor(ctx, env) {
    super(ctx, env);
    this.sql = ctx.storage.sql;
    this.active = new Map(); // key id -> Map(cell -> {at}: when its counters last moved); memory only
    ctx.blockConcurrencyWhile(async () => {
      for (const stmt of SCHEMA) this.sql.exec(stmt);
      // Columns added since `cells` was first created (a ledger deployed before leases).
      const have = this.sql.exec("SELECT * FROM cells LIMIT 0").columnNames;
      for (const [col, decl] of [["ttl_ms", "INTEGER"], ["told_n", "INTEGER"], ["told_until", "INTEGER"]]) {
        if (!have.includes(col)) this.sql.exec(`ALTER TABLE cells ADD COLUMN ${col} ${decl}`);
      }
      // ... and since the fleet's fallback caps (a key's day of fallback spend, leased as a month's tokens are).
      for (const [table, col, decl] of [["key_limits", "fallback", "INTEGER NOT NULL DEFAULT 0"],
        ["leases", "day", "TEXT NOT NULL DEFAULT ''"], ["leases", "fallback_microusd", "INTEGER"],
        ["leases", "held_fallback_microusd", "INTEGER"], ["counters", "day", "TEXT NOT NULL DEFAULT ''"],
        ["counters", "fallback_microusd", "INTEGER NOT NULL DEFAULT 0"]]) {
        if (!this.sql.exec(`SELECT * FROM ${table} LIMIT 0`).columnNames.includes(col)) this.sql.exec(`ALTER TABLE ${table} ADD COLUMN ${col} ${decl}`);
      }
    });
  }

  meta(k) {
    const row = this.sql.exec("SELECT v FROM meta WHERE k = ?", k).toArray()[0];
    return row ? row.v : null;
  }

  setMeta(k, v) {
    this.sql.exec("INSERT INTO meta (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = excluded.v", k, String(v));
  }

  /** The fleet is in use: run rounds (start the alarm if it is not set). */
  async poke() {
    const t = Date.now();
    this.setMeta("poked_at", t);
    if ((await this.ctx.storage.getAlarm()) === null) await this.ctx.storage.setAlarm(t + readFleet(this.env).exchangeMs);
    return { poked_at: t };
  }

  async alarm() {
    const cfg = readFleet(this.env);
    const start = Date.now();
    let moved = 0;
    try {
      moved = (await this.round(cfg)).pulled;
    } catch (err) {
      log(this.env, "fleet_exchange_failed", { message: String(err && err.message) });
    }
    const pokedAt = Number(this.meta("poked_at") || 0);
    if (Date.now() - pokedAt < QUIET_MS || moved > 0) {
      await this.ctx.storage.setAlarm(Math.max(Date.now(), start + cfg.exchangeMs));
    }
  }

  /** One exchange round over every cell (also callable directly, e.g. by a test or a bench). */
  async round(cfg = readFleet(this.env)) {
    const t0 = now();
    const stats = { pulled: 0, pushed: 0, bytes_in: 0, bytes_out: 0, skipped: [], dropped: 0 };
    const names = cfg.cells.map((c) => c.name);
    this.sql.exec("DELETE FROM counters WHERE cell NOT IN (SELECT value FROM json_each(?))", JSON.stringify(names));
    this.sql.exec("DELETE FROM cells WHERE cell NOT IN (SELECT value FROM json_each(?))", JSON.stringify(names));
    for (const name of names) this.sql.exec("INSERT OR IGNORE INTO cells (cell) VALUES (?)", name);
    this.sql.exec("DELETE FROM leases WHERE cell NOT IN (SELECT value FROM json_each(?))", JSON.stringify(names));
    const timeoutMs = Math.max(1000, cfg.exchangeMs);
    const touched = new Set();
    const pulls = await Promise.allSettled(cfg.cells.map((cell) => this.pull(cfg, cell, timeoutMs, stats, touched)));
    pulls.forEach((p, i) => {
      if (p.status === "rejected") stats.skipped.push(`${names[i]} (${String(p.reason && p.reason.message)})`);
    });
    stats.leased = this.apportion(cfg, touched, Date.now());
    const pushes = await Promise.allSettled(cfg.cells.map((cell) => this.push(cfg, cell, timeoutMs, stats)));
    pushes.forEach((p, i) => {
      if (p.status === "rejected" && pulls[i].status !== "rejected") stats.skipped.push(`${names[i]} (${String(p.reason && p.reason.message)})`);
    });
    stats.ms = Math.round((now() - t0) * 100) / 100;
    if (stats.pulled || stats.pushed || stats.skipped.length || stats.dropped) log(this.env, "fleet_exchange", stats);
    return stats;
  }

  /** The cell's changed own counters since our cursor, stored with our next sequence numbers. */
  async pull(cfg, cell, timeoutMs, stats, touched) {
    for (let page = 0; page < PULL_PAGES; page++) {
      const at = this.sql.exec("SELECT generation, cursor FROM cells WHERE cell = ?", cell.name).one();
      const res = await call(cfg, cell, `/_colocate/fleet/counters?since=${at.cursor}`, null, timeoutMs);
      const text = await res.text();
      stats.bytes_in += text.length;
      if (res.status !== 200) throw new Error(`counters answered ${res.status}`);
      const body = JSON.parse(text);
      this.ctx.storage.transactionSync(() => {
        let seq = Number(this.meta("seq") || 0);
        if (body.generation !== at.generation && at.generation !== null) {
          // Another generation (a migration): its rows replace the old one's, pushed afresh;
          // its leases too (it holds the old one's copies until told, so counted as lone till then).
          this.sql.exec("DELETE FROM counters WHERE cell = ?", cell.name);
          this.sql.exec("DELETE FROM leases WHERE cell = ?", cell.name);
          this.sql.exec("UPDATE cells SET told_n = NULL WHERE cell = ?", cell.name);
        }
        for (const [id, l] of Object.entries(body.limits ?? {})) {
          this.sql.exec(`INSERT INTO key_limits (key_id, rpm, tpm, monthly_tokens, fallback) VALUES (?, ?, ?, ?, ?) ON CONFLICT (key_id)
            DO UPDATE SET rpm = excluded.rpm, tpm = excluded.tpm, monthly_tokens = excluded.monthly_tokens, fallback = excluded.fallback`,
          id, l.rpm, l.tpm, l.monthly_tokens, Number.isSafeInteger(l.fallback_microusd_day) ? l.fallback_microusd_day : 0);
        }
        if (Number.isSafeInteger(body.ttl_ms)) this.sql.exec("UPDATE cells SET ttl_ms = ? WHERE cell = ?", body.ttl_ms, cell.name);
        for (let i = 0; i < body.rows.length; i++) {
          const r = upgradeRow(body.rows[i], EXCHANGE); // a cell of the release before sends no day of fallback spend
          if (rowProblem(r, i) !== null) {
            stats.dropped += 1; // a broken row is left out, never the cell's whole page
            continue;
          }
          seq += 1;
          this.sql.exec(UPSERT_COUNTERS, cell.name, ...r, seq);
          const id = r[EXCHANGE.key_id];
          touched.add(id);
          // This cell is using the key: its weight in the key's shares (fleetexchange.js weights).
          const seen = this.active.get(id) ?? new Map();
          seen.set(cell.name, { at: Date.now() });
          this.active.set(id, seen);
        }
        this.setMeta("seq", seq);
        this.sql.exec("UPDATE cells SET generation = ?, cursor = ? WHERE cell = ?", body.generation, body.cursor, cell.name);
      });
      stats.pulled += body.rows.length;
      if (!body.more) return;
    }
  }

  /** To `cell`: for the keys other cells changed since it was last sent, their sum; its leases owed; the fleet's size. */
  async push(cfg, cell, timeoutMs, stats) {
    const { pushed, ttl_ms: ttl, told_n: told } = this.sql.exec("SELECT pushed, ttl_ms, told_n FROM cells WHERE cell = ?", cell.name).one();
    const owed = this.sql.exec(`SELECT ${LEASE.columns} FROM leases WHERE cell = ? AND sent = 0 LIMIT ?`, cell.name, MAX_ROWS)
      .toArray().map(LEASE.of);
    const n = cfg.cells.length;
    const changed = this.sql.exec(`SELECT key_id, MAX(seq) AS seq FROM counters WHERE seq > ? AND cell != ?
      GROUP BY key_id ORDER BY MAX(seq) LIMIT ?`, pushed, cell.name, MAX_ROWS + 1).toArray();
    const upTo = changed.length > MAX_ROWS ? changed[MAX_ROWS - 1].seq : Number(this.meta("seq") || 0);
    if (changed.length > MAX_ROWS) changed.length = MAX_ROWS;
    let rows = [];
    if (changed.length) {
      const others = new Map();
      for (const r of this.sql.exec(`SELECT ${EXCHANGE.columns} FROM counters
          WHERE key_id IN (SELECT value FROM json_each(?)) AND cell != ?`, JSON.stringify(changed.map((c) => c.key_id)), cell.name)) {
        const list = others.get(r.key_id) ?? [];
        list.push(EXCHANGE.of(r));
        others.set(r.key_id, list);
      }
      const t = Date.now();
      rows = changed.map((c) => sumRows(c.key_id, others.get(c.key_id) ?? [], t));
    }
    if (rows.length || owed.length || told !== n) {
      const body = JSON.stringify({ rows, leases: owed, cells: n });
      stats.bytes_out += body.length;
      const res = await call(cfg, cell, "/_colocate/fleet/peers", body, timeoutMs);
      await res.body?.cancel().catch(() => {});
      if (res.status !== 200) throw new Error(`peers answered ${res.status}`);
      stats.pushed += rows.length + owed.length;
      // Landed: from now + the cell's TTL (+ margin) its isolates use only what was sent.
      const until = Date.now() + (ttl ?? UNKNOWN_TTL_MS) + GRACE_MARGIN_MS;
      if (owed.length) {
        this.sql.exec(`UPDATE leases SET sent = 1, until = ? WHERE cell = ? AND sent = 0 AND key_id IN (SELECT value FROM json_each(?))`,
          until, cell.name, JSON.stringify(owed.map((r) => r[LEASE.key_id])));
      }
      if (told !== n) this.sql.exec("UPDATE cells SET told_n = ?, told_until = ? WHERE cell = ?", n, until, cell.name);
    }
    this.sql.exec("UPDATE cells SET pushed = ? WHERE cell = ?", upTo, cell.name);
  }

  /**
   * New leases for the keys whose counters moved this round (`touched`) and the keys with a
   * decrease now certainly in effect somewhere (its capacity can go to the others): per
   * key and limit, fairShares toward the targets, grant within the cap. Returns how many
   * (cell, key) leases changed (they are sent with the next pushes).
   */
  apportion(cfg, touched, t) {
    const due = this.sql.exec(`SELECT DISTINCT key_id FROM leases WHERE until <= ?
      AND (held_req > req OR held_tok > tok OR held_month_tokens > month_tokens OR held_fallback_microusd > fallback_microusd)`, t)
      .toArray();
    const keys = new Set(touched);
    for (const r of due) keys.add(r.key_id);
    const n = cfg.cells.length;
    const cells = new Map(this.sql.exec("SELECT cell, told_n, told_until FROM cells").toArray().map((c) => [c.cell, c]));
    const told = (c) => c !== undefined && c.told_n === n && c.told_until !== null && c.told_until <= t;
    // Once every cell surely knows the fleet's size, the limit each untold cell was counted
    // at is free: every key with leases is apportioned again (once per change of the fleet).
    const settled = cfg.cells.every((c) => told(cells.get(c.name)));
    if (settled && this.meta("settled") !== String(n)) {
      for (const r of this.sql.exec("SELECT DISTINCT key_id FROM leases LIMIT ?", MAX_ROWS)) keys.add(r.key_id);
      this.setMeta("settled", n);
    } else if (!settled && this.meta("settled") !== "0") this.setMeta("settled", 0);
    const activeMs = Math.max(ACTIVE_MS, 2 * cfg.exchangeMs);
    for (const [id, seen] of this.active) {
      for (const [c, x] of seen) if (t - x.at > activeMs) seen.delete(c);
      if (seen.size === 0) this.active.delete(id);
    }
    if (keys.size === 0) return 0;
    const month = monthOf(t);
    const day = dayOf(t);
    const m = minuteOf(t);
    const w = 1 - (t - m * WINDOW_MS) / WINDOW_MS; // the previous minute's weight in the sliding estimate
    let changed = 0;
    this.ctx.storage.transactionSync(() => {
      for (const id of keys) {
        const limits = this.sql.exec("SELECT rpm, tpm, monthly_tokens, fallback FROM key_limits WHERE key_id = ?", id).toArray()[0];
        if (!limits || !(limits.rpm > 0 || limits.tpm > 0 || limits.monthly_tokens > 0 || limits.fallback > 0)) continue;
        const own = new Map(this.sql.exec(`SELECT cell, ${EXCHANGE.columns} FROM counters WHERE key_id = ?`, id).toArray()
          .map((r) => [r.cell, r]));
        const held = new Map(this.sql.exec("SELECT * FROM leases WHERE key_id = ?", id).toArray().map((r) => [r.cell, r]));
        const next = cfg.cells.map(() => ({ same: true }));
        const seen = this.active.get(id);
        const weight = weights(cfg.cells.map((c) => (seen ? seen.get(c.name) : undefined)));
        for (const [limitCol, col, heldCol, periodCol] of RESOURCES) {
          const period = periodCol === "month" ? month : day; // a count and a lease hold for this period only
          const limit = limits[limitCol];
          if (!(limit > 0)) {
            for (const x of next) x[col] = x[heldCol] = null;
            continue;
          }
          const floor = floorShare(limit, n);
          const used = [];
          const current = [];
          const kept = []; // the largest lease each cell may still be using
          const hold = []; // what each cell may admit up to, as far as the ledger can be sure
          for (const cell of cfg.cells) {
            const c = own.get(cell.name);
            if (periodCol !== null) used.push(c && c[periodCol] === period ? c[col] : 0);
            else {
              const a = c ? aligned(EXCHANGE.of(c), m) : [0, 0, 0, 0];
              used.push(col === "req" ? a[0] + a[2] * w : a[1] + a[3] * w);
            }
            const r = held.get(cell.name);
            const row = r && (periodCol === null || r[periodCol] === period) && r.month === month && r[col] !== null ? r : null;
            const lease = row ? row[col] : defaultShare(limit, n);
            const landed = row && row.sent === 1 && row.until !== null && row.until <= t;
            current.push(lease);
            kept.push(!row || landed ? lease : Math.max(row[heldCol] ?? lease, lease));
            // Not told the fleet's size for sure yet: a lone cell, it may admit up to the limit;
            // told, at least its floor share, what an isolate that forgot the lease admits (fleetexchange.js floorShare).
            hold.push(told(cells.get(cell.name)) ? Math.max(kept.at(-1), floor) : limit);
          }
          const g = grant(limit, used, hold, current, fairShares(limit, used, weight));
          next.forEach((x, j) => {
            x[col] = g.lease[j];
            x[heldCol] = Math.max(kept[j], g.lease[j]);
            if (g.lease[j] !== current[j]) x.same = false;
          });
        }
        cfg.cells.forEach((cell, j) => {
          const x = next[j];
          const r = held.get(cell.name);
          const same = x.same && (!r || (r.month === month && r.day === day));
          // Unchanged and already sent: nothing owed, its landing time stays; else owed again.
          const sent = same && (!r || r.sent === 1) ? 1 : 0;
          const until = sent && r ? r.until : null;
          this.sql.exec(`INSERT INTO leases (cell, key_id, month, req, tok, month_tokens, held_req, held_tok, held_month_tokens,
              day, fallback_microusd, held_fallback_microusd, until, sent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
              ON CONFLICT (cell, key_id) DO UPDATE SET month = excluded.month,
              req = excluded.req, tok = excluded.tok, month_tokens = excluded.month_tokens, held_req = excluded.held_req,
              held_tok = excluded.held_tok, held_month_tokens = excluded.held_month_tokens, day = excluded.day,
              fallback_microusd = excluded.fallback_microusd, held_fallback_microusd = excluded.held_fallback_microusd,
              until = excluded.until, sent = excluded.sent`, cell.name, id, month, x.req, x.tok, x.month_tokens, x.held_req,
          x.held_tok, x.held_month_tokens, day, x.fallback_microusd, x.held_fallback_microusd, until, sent);
          if (!same) changed += 1;
        });
      }
    });
    return changed;
  }

  /** What the ledger holds (tests, operators): per cell its cursor and what it was sent. */
  async status() {
    return {
      cells: this.sql.exec("SELECT cell, generation, cursor, pushed, ttl_ms, told_n FROM cells ORDER BY cell").toArray(),
      seq: Number(this.meta("seq") || 0),
      poked_at: Number(this.meta("poked_at") || 0) || null,
      alarm: await this.ctx.storage.getAlarm(),
    };
  }
}

/** One call to a cell's operator endpoint over its service binding, with its exchange token. */
function call(cfg, cell, path, body, timeoutMs) {
  const init = {
    method: body === null ? "GET" : "POST",
    headers: { authorization: `Bearer ${cfg.tokens[cell.index]}`, "content-type": "application/json" },
    signal: AbortSignal.timeout(timeoutMs),
  };
  if (body !== null) init.body = body;
  return cell.service.fetch(new Request(`https://${cell.name}.cell${path}`, init));
}
