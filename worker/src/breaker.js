// The breaker's Durable Object: one object per generation holds the authoritative
// snapshot in SQLite-backed storage (one key), applies the state machine
// (machine.js), and serves RPC methods to the router.
//
// Read-through: while a generation drains, the Worker passes its name in `info`.
// An object that has never been written reads the draining object's snapshot once
// (through the BREAKER namespace, with the draining hint) and adopts it, so an
// override or an open breaker set before a move is still in force after it.

import { DurableObject } from "cloudflare:workers";
import { grantTrial, initial, record, setForce } from "./machine.js";
import { fetchColo } from "./trace.js";

// One key holds the snapshot. The KV API of a SQLite-backed object (the class is
// created by `new_sqlite_classes`) is stored in SQLite in the cloud; it also works on
// workerd's in-memory storage, where the SQL API is unavailable.
const KEY = "breaker";

export class Breaker extends DurableObject {
  constructor(ctx, env) {
    super(ctx, env);
    this.snap = initial();
    this.written = false;
    this.adoptedFrom = null;
    this.readThroughDone = new Set(); // draining names already consulted (memory only)
    ctx.blockConcurrencyWhile(async () => this.load());
  }

  async load() {
    const stored = await this.ctx.storage.get(KEY);
    if (stored) {
      this.snap = { ...initial(), ...stored.snap };
      this.adoptedFrom = stored.adopted_from ?? null;
      this.written = true;
    }
  }

  save() {
    // Not awaited: the output gate holds every response of this object until the
    // write is durable, so no caller sees a state that could be lost.
    this.ctx.storage.put(KEY, { snap: this.snap, adopted_from: this.adoptedFrom });
    this.written = true;
  }

  view() {
    return { ...this.snap, written: this.written, adopted_from: this.adoptedFrom };
  }

  /** Adopt the draining generation's snapshot if this object was never written. */
  async readThrough(info) {
    const from = info && info.draining;
    if (this.written || !from || from === info.generation || this.readThroughDone.has(from)) return;
    await this.ctx.blockConcurrencyWhile(async () => {
      if (this.written || this.readThroughDone.has(from)) return;
      const ns = this.env.BREAKER;
      const id = ns.idFromName(from);
      const other = info.drainingHint ? ns.get(id, { locationHint: info.drainingHint }) : ns.get(id);
      const peek = await other.peek();
      this.readThroughDone.add(from);
      if (peek.written) {
        this.snap = { ...initial(), ...peek.snap };
        this.adoptedFrom = from;
        this.save();
      }
    });
  }

  /** The snapshot without read-through: what another generation adopts. */
  async peek() {
    return { written: this.written, snap: { ...this.snap } };
  }

  async snapshot(info) {
    await this.readThrough(info);
    return this.view();
  }

  async report(ok, info) {
    await this.readThrough(info);
    const next = record(this.snap, ok, Date.now(), info);
    if (next !== this.snap) {
      this.snap = next;
      this.save();
    }
    return this.view();
  }

  async tryTrial(info) {
    await this.readThrough(info);
    const { granted, snap } = grantTrial(this.snap, Date.now(), info);
    if (granted) {
      this.snap = snap;
      this.save();
    }
    return { granted, snap: this.view() };
  }

  async setForce(force, info) {
    await this.readThrough(info);
    this.snap = setForce(this.snap, force, Date.now());
    this.save();
    return this.view();
  }

  /** Where this object runs, measured from inside it. */
  async colo() {
    return fetchColo();
  }

  /** Delete every stored row of this generation (the router refuses the active one). */
  async purge() {
    const had = this.written;
    await this.ctx.storage.deleteAll();
    this.snap = initial();
    this.written = false;
    this.adoptedFrom = null;
    this.readThroughDone.clear();
    return { had_state: had };
  }
}
