// @ts-check
// Server-Timing: the contract names and their formatting.

export const ROUTED_METRICS = ["state", "upstream", "fallback", "total"];
export const PROBE_METRICS = ["state_rtt", "pod_rtt", "total"];
export const POD_PROBE_METRICS = ["pod_rtt", "total"]; // ?only=pods: no state was asked

/** Milliseconds since an arbitrary origin. Inside workerd the clock only moves across
 * I/O, so a span with no I/O in it measures exactly 0: the cached hot path. */
export function now() {
  return typeof performance !== "undefined" && performance.now ? performance.now() : Date.now();
}

/** ms rounded to 0.01 as text, like String(Math.round(ms * 100) / 100), in integers:
 * formatting a fractional double costs several times more (it is on every response). */
function fmt(ms) {
  if (!(ms > 0) || ms === Infinity) return "0";
  const c = Math.round(ms * 100);
  const whole = Math.floor(c / 100);
  const frac = c - whole * 100;
  if (frac === 0) return String(whole);
  return whole + (frac % 10 === 0 ? "." + frac / 10 : frac < 10 ? ".0" + frac : "." + frac);
}

/** "state;dur=0, upstream;dur=12.5, ..." in the order of `names` (missing = 0). */
export function serverTiming(values, names = ROUTED_METRICS) {
  let s = "";
  for (let i = 0; i < names.length; i++) s += (i ? ", " : "") + names[i] + ";dur=" + fmt(values[names[i]]);
  return s;
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
