// The isolate's copy of each generation's breaker snapshot (module scope).
//
// The hot path reads this copy and never waits on the Durable Object while it is
// fresh (younger than STATE_TTL_MS). From half the TTL on, one request per isolate
// starts a background refresh (ctx.waitUntil), so under steady traffic the copy is
// renewed before it goes stale and no request waits. Only a cold isolate, an idle
// one, or STATE_TTL_MS = 0 makes a request wait (that wait is Server-Timing `state`).
//
// Only plain data lives here: promises, stubs and streams are bound to the request
// that made them and must not be shared across requests in workerd.

export class SnapshotCache {
  constructor() {
    this.entries = new Map(); // generation -> {snap, at, refreshAt}
  }

  /** "fresh" | "refresh" (use it, and refresh in the background) | "stale" (must wait). */
  status(gen, now, ttlMs) {
    const e = this.entries.get(gen);
    if (!e || ttlMs <= 0) return "stale";
    const age = now - e.at;
    if (age >= ttlMs) return "stale";
    if (age >= ttlMs / 2 && (e.refreshAt === null || now - e.refreshAt >= ttlMs / 2)) return "refresh";
    return "fresh";
  }

  get(gen) {
    const e = this.entries.get(gen);
    return e ? e.snap : null;
  }

  /** Record a snapshot the object returned (newer `updated_at` wins a race). */
  put(gen, snap, now) {
    const e = this.entries.get(gen);
    if (e && e.snap.updated_at !== null && snap.updated_at !== null && snap.updated_at < e.snap.updated_at) {
      e.at = now; // the object answered; our copy is newer but confirmed recent enough
      return;
    }
    this.entries.set(gen, { snap, at: now, refreshAt: null });
  }

  markRefreshing(gen, now) {
    const e = this.entries.get(gen);
    if (e) e.refreshAt = now;
  }

  drop(gen) {
    this.entries.delete(gen);
  }
}
