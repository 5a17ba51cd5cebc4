// @ts-check
// Each pod's prefix-cache counters as the pod itself reports them: vLLM's /metrics
// (`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`, tokens since the pod
// started), read over the pod hop when an operator asks (the live view, the Prometheus
// endpoint), never on a routed request. A pod may be broken or hostile: its answer is read up
// to MAX_BYTES within a time limit, and only finite counts with hits <= queries are believed.

export const MAX_BYTES = 4 * 1024 * 1024; // vLLM's /metrics is about 100 KB; this is far past it
const LIMIT_MS = 2000;
const SAMPLE = /^vllm:prefix_cache_(hits|queries)(?:_total)?(?:\{[^}\n]*\})?[ \t]+([0-9.eE+-]+)[ \t]*(?:[0-9]+)?[ \t]*$/gm;

/** {hits, queries} summed over the series of a /metrics text (vLLM has one per engine), or null when absent. */
export function prefixCounters(text) {
  let hits = null;
  let queries = null;
  for (const m of text.matchAll(SAMPLE)) {
    const v = Number(m[2]);
    if (!Number.isFinite(v) || v < 0) return null;
    if (m[1] === "hits") hits = (hits ?? 0) + v;
    else queries = (queries ?? 0) + v;
  }
  if (hits === null || queries === null || hits > queries) return null;
  return { hits, queries };
}

/** The text of an answer, at most `max` bytes of it (null past that). */
async function boundedText(res, max) {
  if (!res.body) return "";
  const reader = res.body.getReader();
  const parts = [];
  let n = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    n += value.byteLength;
    if (n > max) {
      await reader.cancel().catch(() => {});
      return null;
    }
    parts.push(value);
  }
  const all = new Uint8Array(n);
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.byteLength;
  }
  return new TextDecoder().decode(all);
}

/** One pod's counters, or null (unreachable, not 200, too long, too slow, or no such counters). */
async function onePod(fetchImpl, url, token, ms) {
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), ms);
  try {
    const res = await fetchImpl(url + "/metrics", { headers: { authorization: `Bearer ${token}` }, signal: ac.signal, redirect: "manual" });
    if (res.status !== 200) {
      await res.body?.cancel().catch(() => {});
      return null;
    }
    const text = await boundedText(res, MAX_BYTES);
    return text === null ? null : prefixCounters(text);
  } catch {
    return null;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Every pod's counters, in POD_URLS order: [{index, hits, queries}] for the pods that reported
 * them (a pod that did not is left out), all asked at once within min(deadline, 2 s).
 */
export async function podPrefixCaches(cfg, fetchImpl) {
  const ms = Math.min(cfg.deadlineMs, LIMIT_MS);
  const got = await Promise.all(cfg.podUrls.map((u) => onePod(fetchImpl, u, cfg.podToken, ms)));
  const out = [];
  got.forEach((c, index) => {
    if (c) out.push({ index, hits: c.hits, queries: c.queries });
  });
  return out;
}
