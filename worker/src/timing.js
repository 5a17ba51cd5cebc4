// Server-Timing: the contract names and their formatting.

export const ROUTED_METRICS = ["state", "upstream", "fallback", "total"];
export const PROBE_METRICS = ["state_rtt", "pod_rtt", "total"];

/** Milliseconds since an arbitrary origin. Inside workerd the clock only moves across
 * I/O, so a span with no I/O in it measures exactly 0: the cached hot path. */
export function now() {
  return typeof performance !== "undefined" && performance.now ? performance.now() : Date.now();
}

function fmt(ms) {
  const v = Number.isFinite(ms) && ms > 0 ? ms : 0;
  return String(Math.round(v * 100) / 100);
}

/** "state;dur=0, upstream;dur=12.5, ..." in the order of `names` (missing = 0). */
export function serverTiming(values, names = ROUTED_METRICS) {
  return names.map((n) => `${n};dur=${fmt(values[n])}`).join(", ");
}

/** Parse a Server-Timing header into {name: ms}. Used by tests and tools. */
export function parseServerTiming(header) {
  const out = {};
  for (const part of String(header || "").split(",")) {
    const [name, ...params] = part.trim().split(";");
    if (!name) continue;
    const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
    out[name] = dur ? Number(dur.slice(4)) : 0;
  }
  return out;
}
