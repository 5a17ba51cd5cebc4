// @ts-check
// The isolate's copy of each generation's view (module scope, plain data only).
//
// The hot path reads this copy and never waits on the Durable Object while it is fresh
// (younger than STATE_TTL_MS). From half the TTL on, one request per isolate starts a
// background sync (ctx.waitUntil), so under steady traffic the copy is renewed before it
// goes stale and no request waits. Only a cold isolate, an idle one, or STATE_TTL_MS = 0
// makes a request wait (that wait is Server-Timing `state`).
//
// An entry holds the per-pod breaker rows and the operator override (the last view), the
// keys revision this isolate is in step with, the client keys it has looked up (by
// SHA-256 digest, bounded), their limit counters, and digests known not to be keys.
// Keys arrive two ways: a look-up of one the isolate was shown (lookupKeys), and the
// rows changed since the revision held, sent with every sync (a holder updates or drops
// its row; a digest remembered as unknown becomes known). A cold isolate starts at the
// current revision with no keys: it never downloads the list. Promises, stubs and
// streams are bound to the request that made them in workerd and never live here.

import { addDigest, mayHold } from "./keyfilter.js";

export const NEGATIVE_MAX = 4096; // digests known not to be keys, per generation (bounded)
export const KEYS_MAX = 50_000; // keys held per generation; the oldest looked-up goes first

export class ViewCache {
  constructor() {
    this.entries = new Map(); // generation -> entry
  }

  entry(gen) {
    return this.entries.get(gen) ?? null;
  }

  /** "fresh" | "refresh" (use it, and sync in the background) | "stale" (must wait). */
  status(gen, now, ttlMs) {
    const e = this.entries.get(gen);
    if (!e || ttlMs <= 0) return "stale";
    const age = now - e.at;
    if (age >= ttlMs) return "stale";
    if (age >= ttlMs / 2 && (e.refreshAt === null || now - e.refreshAt >= ttlMs / 2)) return "refresh";
    return "fresh";
  }

  /** The keys revision this isolate is in step with (-1: none yet), sent with every sync. */
  rev(gen) {
    const e = this.entries.get(gen);
    return e && e.keys ? e.rev : -1;
  }

  /**
   * Record a view the object returned. `asked` lists the key ids whose counters the
   * sync asked for: those absent from the answer are zero. An older answer (raced by a
   * newer one) only confirms freshness: the newer one holds every change it had.
   */
  put(gen, view, now, asked = null) {
    const e = this.entries.get(gen);
    if (e && view.at < e.view.at) {
      if (e.keys !== null) e.at = now;
      return e;
    }
    const next = e ?? { view, rev: -1, keys: null, counts: new Map(), leases: new Map(), negative: new Map(), at: -Infinity,
      refreshAt: null, filter: null };
    next.view = view;
    next.refreshAt = null;
    // The key filter comes with the answer that starts the key list; every later key row is added to it.
    if (view.key_filter) next.filter = view.key_filter;
    if (next.filter !== null && Array.isArray(view.keys)) for (const row of view.keys) addDigest(next.filter, row.hash);
    if (Array.isArray(view.keys)) {
      if (next.keys === null || view.reset) {
        next.keys = new Map();
        next.negative = new Map(); // keys may have been created since a digest was called unknown
        next.rev = view.rev;
      }
      for (const row of view.keys) applyRow(next, row);
      next.rev = Math.max(next.rev, view.rev);
    }
    // Without keys (never synced, or we asked with a revision we no longer hold) the view
    // cannot authenticate anyone: treat it as stale, so the next request syncs.
    next.at = next.keys === null ? -Infinity : now;
    if (asked) for (const id of asked) if (!view.counts || !view.counts[id]) next.counts.delete(id);
    if (view.counts) for (const id in view.counts) next.counts.set(id, view.counts[id]);
    if (asked) for (const id of asked) if (!view.leases || !view.leases[id]) next.leases.delete(id);
    if (view.leases) for (const id in view.leases) next.leases.set(id, view.leases[id]);
    this.entries.set(gen, next);
    return next;
  }

  /**
   * A look-up's answer ({rev, keys, counts}) for `digests`: found keys are held, the rest
   * remembered as unknown. A row older than the revision held is used by the request
   * that asked but not kept: a revocation between the two would not reach it.
   * @returns Map digest -> row of the keys found
   */
  putLookup(gen, res, digests, now, ttlMs) {
    const found = new Map(res.keys.map((k) => [k.hash, k]));
    const e = this.entries.get(gen);
    if (!e || e.keys === null) return found;
    if (res.rev >= e.rev) for (const row of res.keys) holdKey(e, row);
    for (const id in res.counts) e.counts.set(id, res.counts[id]);
    if (res.leases) for (const id in res.leases) e.leases.set(id, res.leases[id]);
    // "Unknown" only from an answer as new as our revision: an older one may predate a key
    // whose creation we already passed (and, not holding it, ignored).
    if (res.rev >= e.rev) for (const d of digests) if (!found.has(d)) this.forget(gen, d, now, ttlMs);
    return found;
  }

  /**
   * Whether a digest may be a key of the generation (its key filter, keyfilter.js): false
   * only when no key this isolate could know of has it; null without a filter yet.
   */
  mayBeKey(gen, digest) {
    const e = this.entries.get(gen);
    return e && e.filter ? mayHold(e.filter, digest) : null;
  }

  /** The counters of a key as of the last answer that carried them, or undefined. */
  count(gen, id) {
    const e = this.entries.get(gen);
    return e ? e.counts.get(id) : undefined;
  }

  /** This cell's lease of a key in a fleet ({req, tok, month_tokens}), or undefined (a lone cell). */
  lease(gen, id) {
    const e = this.entries.get(gen);
    return e ? e.leases.get(id) : undefined;
  }

  /** The fleet's size as the last view said it (0: a lone cell, or not yet told). */
  fleetCells(gen) {
    const e = this.entries.get(gen);
    return (e && e.view.fleet_cells) || 0;
  }

  /** Forget counters (and leases) of keys this isolate no longer serves. */
  dropCounts(gen, ids) {
    const e = this.entries.get(gen);
    if (e) {
      for (const id of ids) {
        e.counts.delete(id);
        e.leases.delete(id);
      }
    }
  }

  /** Drop a key at once (revoked through this isolate; elsewhere the next sync drops it). */
  dropKey(gen, id) {
    const e = this.entries.get(gen);
    if (!e || !e.keys) return;
    for (const [hash, row] of e.keys) {
      if (row.id === id) e.keys.delete(hash);
    }
  }

  markRefreshing(gen, now) {
    const e = this.entries.get(gen);
    if (e) e.refreshAt = now;
  }

  /** Remember a digest that is not a key, for the TTL or until a delta adds it (bounded). */
  forget(gen, digest, now, ttlMs) {
    const e = this.entries.get(gen);
    if (!e) return;
    if (e.negative.size >= NEGATIVE_MAX) e.negative.clear();
    e.negative.set(digest, now + Math.max(ttlMs, 1000));
  }

  isKnownBad(gen, digest, now) {
    const e = this.entries.get(gen);
    const until = e ? e.negative.get(digest) : undefined;
    return until !== undefined && now < until;
  }

  drop(gen) {
    this.entries.delete(gen);
  }
}

/** One changed key row from a sync: holders update or drop it; an awaited digest is held. */
function applyRow(e, row) {
  const held = e.keys.get(row.hash);
  if (row.revoked) {
    if (held) e.keys.delete(row.hash);
    return;
  }
  if (held) {
    if (row.rev >= held.rev) e.keys.set(row.hash, row);
  } else if (e.negative.delete(row.hash)) {
    holdKey(e, row); // a client presented it before it existed here: it is wanted
  }
}

function holdKey(e, row) {
  const held = e.keys.get(row.hash);
  if (held && held.rev > row.rev) return;
  if (!held && e.keys.size >= KEYS_MAX) e.keys.delete(e.keys.keys().next().value);
  e.keys.set(row.hash, row);
}
