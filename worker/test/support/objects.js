// The real generation object (generation.js's Breaker) in Node: its storage is SQLite in
// memory (sql.js, the same engine workerd's SQL storage runs), behind the part of the
// Durable Object storage API that generation.js uses, and its namespace answers `get` with
// a stub that records each call and passes arguments and answers through structuredClone,
// as RPC does. Only the transport differs from workerd: the code and the SQL are the object's.
import { register } from "node:module";
import initSqlJs from "sql.js";

register("./hooks.mjs", import.meta.url);
const SQL = await initSqlJs();

/** A cursor as SqlStorage.exec answers: rows as objects, `one()`, `columnNames`, `rowsWritten`. */
class Cursor {
  constructor(columnNames, rows, rowsWritten) {
    this.columnNames = columnNames;
    this.rows = rows;
    this.rowsRead = rows.length;
    this.rowsWritten = rowsWritten;
  }

  toArray() {
    return this.rows;
  }

  one() {
    if (this.rows.length !== 1) throw new Error(`Expected exactly one result from SQL query, but got ${this.rows.length}.`);
    return this.rows[0];
  }

  [Symbol.iterator]() {
    return this.rows[Symbol.iterator]();
  }
}

/** ctx.storage.sql: one statement per exec, bindings by position, as workerd takes them. */
class SqlStorage {
  constructor() {
    this.db = new SQL.Database();
  }

  changes() {
    return this.db.exec("SELECT total_changes()")[0].values[0][0];
  }

  exec(query, ...bindings) {
    const before = this.changes();
    const stmt = this.db.prepare(query);
    try {
      if (bindings.length) stmt.bind(bindings.map((v) => (v === undefined ? null : v)));
      const rows = [];
      while (stmt.step()) rows.push(stmt.getAsObject());
      return new Cursor(stmt.getColumnNames(), rows, this.changes() - before);
    } finally {
      stmt.free();
    }
  }
}

/** The object's ctx: SQL storage, the KV calls generation.js makes, transactions, the alarm, blockConcurrencyWhile. */
function memoryContext() {
  const sql = new SqlStorage();
  const kv = new Map();
  let pending = Promise.resolve();
  let depth = 0;
  let alarm = null; // ms, or null: the namespace's `alarm(name)` runs it, as the runtime would when due
  return {
    storage: {
      sql,
      async getAlarm() { return alarm; },
      async setAlarm(t) { alarm = Number(t); },
      async deleteAlarm() { alarm = null; },
      async get(key) { return structuredClone(kv.get(key)); },
      async put(key, value) { kv.set(key, structuredClone(value)); },
      async delete(key) { return kv.delete(key); },
      async deleteAll() { kv.clear(); alarm = null; sql.db.close(); sql.db = new SQL.Database(); },
      transactionSync(fn) {
        const name = `t${depth++}`;
        sql.db.exec(`SAVEPOINT ${name}`);
        try {
          const out = fn();
          sql.db.exec(`RELEASE ${name}`);
          return out;
        } catch (err) {
          sql.db.exec(`ROLLBACK TO ${name}`);
          sql.db.exec(`RELEASE ${name}`);
          throw err;
        } finally {
          depth--;
        }
      },
    },
    blockConcurrencyWhile(fn) {
      const run = pending.then(fn);
      pending = run.catch(() => {});
      return run;
    },
    ready: () => pending,
  };
}

/**
 * A namespace of real objects of `ObjectClass` (one per name, made on first use with the
 * bindings in `ns.env`; by default the namespace alone, as BREAKER).
 * `calls` records ["get", name, locationHint] and [method, name, ...args] for every RPC;
 * `instance(name)` is the object itself, for a test's setup and its reading of the storage;
 * `alarm(name)` runs its alarm if one is set (cleared first, as the runtime does), answering
 * whether one ran; `reset(name)` makes a new instance over the same storage (an eviction).
 */
export function objectNamespace(ObjectClass) {
  const objects = new Map();
  const calls = [];
  const made = (name) => {
    if (!objects.has(name)) {
      const ctx = memoryContext();
      objects.set(name, { ctx, object: new ObjectClass(ctx, ns.env) });
    }
    return objects.get(name);
  };
  const instance = async (name) => {
    const { ctx, object } = made(name);
    await ctx.ready();
    return object;
  };
  const stub = (name) => new Proxy({}, {
    get(_, method) {
      if (method === "then" || typeof method !== "string") return undefined; // a stub is no promise
      return async (...args) => {
        calls.push([method, name, ...structuredClone(args)]);
        const object = await instance(name);
        if (typeof object[method] !== "function") throw new TypeError(`The RPC receiver does not implement the method "${method}".`);
        return structuredClone(await object[method](...structuredClone(args)));
      };
    },
  });
  const alarm = async (name) => {
    const { ctx } = made(name);
    if ((await ctx.storage.getAlarm()) === null) return false;
    await ctx.storage.deleteAlarm();
    await (await instance(name)).alarm();
    return true;
  };
  const reset = (name) => {
    const { ctx } = made(name);
    objects.set(name, { ctx, object: new ObjectClass(ctx, ns.env) });
  };
  const ns = {
    env: null,
    calls,
    instance,
    alarm,
    reset,
    idFromName: (name) => ({ name, toString: () => name }),
    get: (id, opts) => {
      calls.push(["get", id.name, opts?.locationHint]);
      return stub(id.name);
    },
  };
  ns.env = { BREAKER: ns };
  return ns;
}
