// The isolate's copy of each generation's view (module scope, plain data only).
//
// The hot path reads this copy and never waits on the Durable Object while it is fresh
// (younger than STATE_TTL_MS). From half the TTL on, one request per isolate starts a
// background sync (ctx.waitUntil), so under steady traffic the copy is renewed before it
// goes stale and no request waits. Only a cold isolate, an idle one, or STATE_TTL_MS = 0
// makes a request wait (that wait is Server-Timing `state`).
//
// A view holds the per-pod breaker rows, the operator override, the active client keys
// (by SHA-256 digest) with their limits, and the global limit counters. Keys travel only
// when their revision changed (`keys: null` otherwise). Promises, stubs and streams are
// bound to the request that made them in workerd and never live here.

const NEGATIVE_MAX = 4096; // digests known not to be keys, per generation (bounded)

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

  /** The keys revision this isolate holds (-1: none yet), sent with every sync. */
  rev(gen) {
    const e = this.entries.get(gen);
    return e && e.keys ? e.view.rev : -1;
  }

  /** Record a view the object returned; an older answer (raced by a newer one) only confirms freshness. */
  put(gen, view, now) {
    const e = this.entries.get(gen);
    if (e && view.at < e.view.at) {
      e.at = now;
      return e;
    }
    let keys = e ? e.keys : null;
    let negative = e ? e.negative : new Map();
    if (view.keys) {
      keys = new Map(view.keys.map((k) => [k.hash, k]));
      negative = new Map(); // a key created since may have been cached as unknown
    } else if (!e || e.view.rev !== view.rev) {
      keys = null; // we asked with a revision we no longer hold: the next sync fetches the list
    }
    // Without a key list the view cannot authenticate anyone: treat it as stale, so the next
    // request syncs (asking for the list) instead of refusing clients.
    const at = keys === null ? -Infinity : now;
    const next = { view, keys, negative, at, refreshAt: null, missAt: e ? e.missAt : -Infinity };
    this.entries.set(gen, next);
    return next;
  }

  markRefreshing(gen, now) {
    const e = this.entries.get(gen);
    if (e) e.refreshAt = now;
  }

  /** Remember a digest that is not a key until the key list changes (bounded). */
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
