// @ts-check
// Where code runs: Cloudflare has no runtime API for a colo, so the Worker and the
// Durable Object each fetch /cdn-cgi/trace and read its `colo=` line.

export const TRACE_URL = "https://www.cloudflare.com/cdn-cgi/trace";
const TRACE_TIMEOUT_MS = 2000;

/** The `colo=` value of a trace body, or null. */
export function parseTraceColo(body) {
  const m = /^colo=([A-Za-z0-9]+)\s*$/m.exec(String(body || ""));
  return m ? m[1].toUpperCase() : null;
}

/** The colo suffix of a CF-Ray header ("8f1a2b3c4d5e6f70-NRT" -> "NRT"), or null. */
export function rayColo(ray) {
  const m = /-([A-Za-z]{3,4})$/.exec(String(ray || "").trim());
  return m ? m[1].toUpperCase() : null;
}

/** This isolate's colo, or null when the trace cannot be fetched (e.g. offline workerd). */
export async function fetchColo(fetchImpl = fetch) {
  try {
    const res = await fetchImpl(TRACE_URL, { signal: AbortSignal.timeout(TRACE_TIMEOUT_MS) });
    if (!res.ok) {
      await res.body?.cancel();
      return null;
    }
    return parseTraceColo(await res.text());
  } catch {
    return null;
  }
}
