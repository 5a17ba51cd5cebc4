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
// what it is owed) stays, so the next round catches up. The hot path never waits on this:
// each cell's isolates read the peers from their own generation through their usual sync.
//
// The front door pokes the ledger (fleetexchange.js pokeLedger, in the background); the
// alarm stops rescheduling QUIET_MS after the last poke once a round moves nothing, so an
// idle fleet costs nothing. See docs/fleet.md, "Limits across cells".

import { DurableObject } from "cloudflare:workers";
import { log } from "./errors.js";
import { readFleet } from "./fleetfront.js";
import { MAX_ROWS, rowProblem, sumRows } from "./fleetexchange.js";
import { EXCHANGE } from "./payloads.js";
import { now } from "./timing.js";

export const QUIET_MS = 30_000; // rounds go on this long after the last poke (and while they move counters)
const PULL_PAGES = 5; // pages of changed keys per cell per round; the rest come next round

const SCHEMA = [
  `CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)`,
  // Per cell: where its changes were read up to (its own sequence), and what it was sent (ours).
  `CREATE TABLE IF NOT EXISTS cells (cell TEXT PRIMARY KEY, generation TEXT, cursor INTEGER NOT NULL DEFAULT 0,
     pushed INTEGER NOT NULL DEFAULT 0)`,
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
    ctx.blockConcurrencyWhile(async () => {
      for (const stmt of SCHEMA) this.sql.exec(stmt);
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
    const timeoutMs = Math.max(1000, cfg.exchangeMs);
    const pulls = await Promise.allSettled(cfg.cells.map((cell) => this.pull(cfg, cell, timeoutMs, stats)));
    pulls.forEach((p, i) => {
      if (p.status === "rejected") stats.skipped.push(`${names[i]} (${String(p.reason && p.reason.message)})`);
    });
    const pushes = await Promise.allSettled(cfg.cells.map((cell) => this.push(cfg, cell, timeoutMs, stats)));
    pushes.forEach((p, i) => {
      if (p.status === "rejected" && pulls[i].status !== "rejected") stats.skipped.push(`${names[i]} (${String(p.reason && p.reason.message)})`);
    });
    stats.ms = Math.round((now() - t0) * 100) / 100;
    if (stats.pulled || stats.pushed || stats.skipped.length || stats.dropped) log(this.env, "fleet_exchange", stats);
    return stats;
  }

  /** The cell's changed own counters since our cursor, stored with our next sequence numbers. */
  async pull(cfg, cell, timeoutMs, stats) {
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
          // Another generation (a migration): its rows replace the old one's, pushed afresh.
          this.sql.exec("DELETE FROM counters WHERE cell = ?", cell.name);
        }
        for (let i = 0; i < body.rows.length; i++) {
          const r = body.rows[i];
          if (rowProblem(r, i) !== null) {
            stats.dropped += 1; // a broken row is left out, never the cell's whole page
            continue;
          }
          seq += 1;
          this.sql.exec(UPSERT_COUNTERS, cell.name, ...r, seq);
        }
        this.setMeta("seq", seq);
        this.sql.exec("UPDATE cells SET generation = ?, cursor = ? WHERE cell = ?", body.generation, body.cursor, cell.name);
      });
      stats.pulled += body.rows.length;
      if (!body.more) return;
    }
  }

  /** To `cell`, for the keys other cells changed since it was last sent, their sum. */
  async push(cfg, cell, timeoutMs, stats) {
    const { pushed } = this.sql.exec("SELECT pushed FROM cells WHERE cell = ?", cell.name).one();
    const changed = this.sql.exec(`SELECT key_id, MAX(seq) AS seq FROM counters WHERE seq > ? AND cell != ?
      GROUP BY key_id ORDER BY MAX(seq) LIMIT ?`, pushed, cell.name, MAX_ROWS + 1).toArray();
    const upTo = changed.length > MAX_ROWS ? changed[MAX_ROWS - 1].seq : Number(this.meta("seq") || 0);
    if (changed.length > MAX_ROWS) changed.length = MAX_ROWS;
    if (changed.length) {
      const others = new Map();
      for (const r of this.sql.exec(`SELECT ${EXCHANGE.columns} FROM counters
          WHERE key_id IN (SELECT value FROM json_each(?)) AND cell != ?`, JSON.stringify(changed.map((c) => c.key_id)), cell.name)) {
        const list = others.get(r.key_id) ?? [];
        list.push(EXCHANGE.of(r));
        others.set(r.key_id, list);
      }
      const t = Date.now();
      const body = JSON.stringify({ rows: changed.map((c) => sumRows(c.key_id, others.get(c.key_id) ?? [], t)) });
      stats.bytes_out += body.length;
      const res = await call(cfg, cell, "/_colocate/fleet/peers", body, timeoutMs);
      await res.body?.cancel().catch(() => {});
      if (res.status !== 200) throw new Error(`peers answered ${res.status}`);
      stats.pushed += changed.length;
    }
    this.sql.exec("UPDATE cells SET pushed = ? WHERE cell = ?", upTo, cell.name);
  }

  /** What the ledger holds (tests, operators): per cell its cursor and what it was sent. */
  async status() {
    return {
      cells: this.sql.exec("SELECT cell, generation, cursor, pushed FROM cells ORDER BY cell").toArray(),
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
