// @ts-check
// GET /_colocate/metrics: the cell in Prometheus' text exposition format (version 0.0.4).
// Pure: the generation object's `metrics` answer and the cell's config in, text out.
//
// Histograms are classic ones (`_bucket{le}`, `_sum`, `_count`) on every second edge of
// histogram.js's buckets (OpenTelemetry's scale 4: each 4.4 % wide), so `histogram_quantile`
// interpolates within one such bucket: within 4.4 % of the truth. Every series has the same
// `le` from its first non-empty bucket up to 60 s (below it every count is 0, which a sum
// by `le` does not miss), so series of backends, colos and cells add up exactly. The counts
// are cumulative since the generation began (seg_total). `_sum` is estimated from the
// buckets (within 1.08 %): the Worker keeps no exact sum. Labels name pods by index and
// colos by IATA code, keys by id (bounded: the keys refused most); never a key, a digest or a URL.

import { BUCKETS, CUTS, EDGES, PICKS, REPS, TOP, decode, total } from "./histogram.js";
import { CLOSED, HALF_OPEN, OPEN } from "./machine.js";
import { REFUSAL_KEYS } from "./refusals.js";

export const CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8";
const STATES = [CLOSED, OPEN, HALF_OPEN];
const STEP = 2; // fine buckets per exposed bucket (TOP is a multiple of it)

/** A label value, escaped as the format says (backslash, double quote, newline). */
function esc(v) {
  return String(v).replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n");
}

function labels(o) {
  return "{" + Object.entries(o).map(([k, v]) => `${k}="${esc(v)}"`).join(",") + "}";
}

/** An edge in seconds, as Prometheus wants durations, in 6 digits: the same text on every scrape and cell. */
const LE = Array.from(EDGES, (ms) => String(Number((ms / 1000).toPrecision(6))));

function histogramLines(out, name, base, counts) {
  let first = 0;
  while (first < BUCKETS - 1 && counts[first] === 0) first++;
  // from the exposed edge just below the first value (count 0: the interpolation's lower bound)
  let cum = 0;
  let i = 0;
  for (let k = first === 0 ? 0 : (Math.ceil(first / STEP) - 1) * STEP; k <= TOP; k += STEP) {
    for (; i <= k; i++) cum += counts[i];
    out.push(`${name}_bucket${labels({ ...base, le: LE[k] })} ${cum}`);
  }
  for (; i < BUCKETS; i++) cum += counts[i];
  let sum = 0;
  for (let k = 0; k < BUCKETS; k++) sum += counts[k] * REPS[k];
  out.push(`${name}_bucket${labels({ ...base, le: "+Inf" })} ${cum}`);
  out.push(`${name}_sum${labels(base)} ${sum / 1000}`);
  out.push(`${name}_count${labels(base)} ${cum}`);
}

function family(out, name, type, help) {
  out.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${type}`);
}

/**
 * The exposition of one cell. `m` is the object's answer ({segments: [[colo, who, segment,
 * text]], served, keys, pods, forced}); `cfg` names the pods and the generation; `caches` each
 * pod's own prefix-cache counters ([{index, hits, queries}], podmetrics.js).
 */
export function exposition(m, cfg, caches = []) {
  const out = [];
  family(out, "colocate_segment_seconds", "histogram",
    "Server-Timing segments of routed requests by backend and the Worker's colo; segment sync: the isolates' round trips to the state object (state_colo); ttft, itl: streamed answers' first byte and mean gap between tokens; queue: a pod request's wait for its first token.");
  // One series per (segment, backend, colo): a fleet's client colos ("0@NRT") are added
  // together here, so the series stay as few as the cell's pods and colos.
  const series = new Map();
  const picks = new Map(); // "pod-<i>|affinity" -> requests (prefix affinity's picks: counts, not durations)
  const cuts = new Map(); // "pod-<i>" -> streams cut after their first token (counts, not durations)
  for (const [colo, who, segment, text] of m.segments) {
    if (CUTS.includes(segment)) {
      try {
        const k = `pod-${who.split("@")[0]}`;
        cuts.set(k, (cuts.get(k) || 0) + total(decode(text)));
      } catch {
        // as below
      }
      continue;
    }
    if (PICKS.includes(segment)) {
      try {
        const k = `pod-${who.split("@")[0]}|${segment}`;
        picks.set(k, (picks.get(k) || 0) + total(decode(text)));
      } catch {
        // as below
      }
      continue;
    }
    const pod = segment === "sync" ? who : who.split("@")[0];
    const base = segment === "sync"
      ? { segment, backend: "state", colo: pod, state_colo: colo }
      : { segment, backend: pod === "fallback" ? pod : `pod-${pod}`, colo };
    const key = JSON.stringify(base);
    try {
      series.set(key, decode(text, series.get(key)));
    } catch {
      // the object stores only checked text; a hand-edited row is left out
    }
  }
  for (const key of [...series.keys()].sort()) histogramLines(out, "colocate_segment_seconds", JSON.parse(key), series.get(key));
  // backend_total: pod-<i>, fallback, and none (a front door's deferral, served by another cell)
  const served = [...m.served].sort((a, b) => (a.backend < b.backend ? -1 : 1));
  if (!served.some((r) => r.backend === "fallback")) served.push({ backend: "fallback", requests: 0, prompt_tokens: 0, completion_tokens: 0 });
  family(out, "colocate_requests_total", "counter", "Requests answered, by backend (pod-<i>, fallback, none: deferred to another cell).");
  for (const r of served) out.push(`colocate_requests_total${labels({ backend: r.backend })} ${r.requests}`);
  family(out, "colocate_tokens_total", "counter", "Tokens by backend and kind; the fallback's are its spend at colocate:fallbackPrice.");
  for (const r of served) {
    out.push(`colocate_tokens_total${labels({ backend: r.backend, kind: "prompt" })} ${r.prompt_tokens}`);
    out.push(`colocate_tokens_total${labels({ backend: r.backend, kind: "completion" })} ${r.completion_tokens}`);
  }
  family(out, "colocate_breaker_state", "gauge", "Each pod's circuit breaker: 1 for its current state, 0 for the others.");
  const byUrl = new Map(m.pods.map((r) => [r.pod, r]));
  const failures = [];
  cfg.podUrls.forEach((url, i) => {
    const row = byUrl.get(url);
    const state = row ? row.state : CLOSED;
    for (const s of STATES) out.push(`colocate_breaker_state${labels({ pod: i, state: s })} ${s === state ? 1 : 0}`);
    failures.push(`colocate_breaker_failures${labels({ pod: i })} ${row ? row.failures : 0}`);
  });
  family(out, "colocate_breaker_failures", "gauge", "Each pod's current failure streak.");
  out.push(...failures);
  family(out, "colocate_breaker_forced", "gauge", "The operator's override of every pod's breaker: 1 for the one set (none: no override).");
  for (const s of ["open", "closed"]) out.push(`colocate_breaker_forced${labels({ state: s })} ${m.forced === s ? 1 : 0}`);
  family(out, "colocate_balance_picks_total", "counter",
    "Requests colocate:worker.balance prefix sent to their prefix's own pod (by=affinity) or shed to another by the load bound (by=load).");
  for (const k of [...picks.keys()].sort()) {
    const [backend, by] = k.split("|");
    out.push(`colocate_balance_picks_total${labels({ backend, by: by === "shed" ? "load" : "affinity" })} ${picks.get(k)}`);
  }
  family(out, "colocate_streams_cut_total", "counter",
    "Streams a pod broke off or stalled after their first token (a preempted pod's), each ended with an error event in OpenAI's shape and charged what was sent.");
  for (const k of [...cuts.keys()].sort()) out.push(`colocate_streams_cut_total${labels({ backend: k })} ${cuts.get(k)}`);
  family(out, "colocate_pod_prefix_cache_hits_total", "counter",
    "Prompt tokens each pod found in its prefix cache, as the pod reports (vllm:prefix_cache_hits), since it started.");
  for (const c of caches) out.push(`colocate_pod_prefix_cache_hits_total${labels({ pod: c.index })} ${c.hits}`);
  family(out, "colocate_pod_prefix_cache_queries_total", "counter",
    "Prompt tokens each pod looked up in its prefix cache, as the pod reports (vllm:prefix_cache_queries), since it started.");
  for (const c of caches) out.push(`colocate_pod_prefix_cache_queries_total${labels({ pod: c.index })} ${c.queries}`);
  family(out, "colocate_refusals_total", "counter",
    `Requests refused with a 429, by key id (the ${REFUSAL_KEYS} refused most; key=other: the rest) and reason (the limit that refused).`);
  for (const [key, reason, n] of m.refusals ?? []) out.push(`colocate_refusals_total${labels({ key, reason })} ${n}`);
  family(out, "colocate_keys", "gauge", "Client API keys by state (counts only).");
  const k = m.keys;
  out.push(`colocate_keys${labels({ state: "active" })} ${k.active}`);
  out.push(`colocate_keys${labels({ state: "revoked" })} ${k.revoked}`);
  out.push(`colocate_keys${labels({ state: "expired" })} ${k.total - k.active - k.revoked}`);
  family(out, "colocate_generation_info", "gauge", "The active generation (and the draining one, if any) of this cell.");
  out.push(`colocate_generation_info${labels({ generation: cfg.activeGeneration, draining: cfg.drainingGeneration ?? "", region: cfg.region ?? "" })} 1`);
  if (m.keeper && typeof m.keeper === "object") keeperLines(out, m.keeper);
  return out.join("\n") + "\n";
}

// What the keeper raises (colocate/scaling/keeper.py ALERTS, the same names): each is exposed, 0 or 1, so a
// rule needs no absent(); docs/grafana/alerts.yml pages on any of them.
export const KEEPER_ALERTS = ["replace_failed", "update_failing", "stack_locked", "stale_checkout"];
const count = (v) => (Number.isFinite(v) && v >= 0 ? v : 0);

/** The keeper's last pass as the generation holds it (colocate/scaling/keeper.py Record): alerts, pod verdicts, replacements. */
function keeperLines(out, k) {
  const raised = new Set((Array.isArray(k.alerts) ? k.alerts : []).map((a) => a && a.name));
  family(out, "colocate_keeper_alert", "gauge", "1 while the keeper raises this alert (a pod it cannot replace, failing updates, a stack lock held too long, a checkout other than the running Worker's).");
  for (const name of KEEPER_ALERTS) out.push(`colocate_keeper_alert${labels({ alert: name })} ${raised.has(name) ? 1 : 0}`);
  family(out, "colocate_keeper_last_pass_timestamp_seconds", "gauge", "When the keeper last recorded a pass (an old value: no keeper runs).");
  out.push(`colocate_keeper_last_pass_timestamp_seconds ${count(k.at) / 1000}`);
  family(out, "colocate_keeper_pod_state", "gauge", "Each pod as the keeper last found it (ok, dead, preempted, gone, remapped, misplaced, unhealthy, unknown): 1 for the state it is in.");
  for (const p of Array.isArray(k.pods) ? k.pods : []) {
    if (p && Number.isInteger(p.index) && typeof p.state === "string") out.push(`colocate_keeper_pod_state${labels({ pod: p.index, state: p.state })} 1`);
  }
  family(out, "colocate_keeper_replacements_total", "counter", "Pods the keeper replaced alone, by pod index and why (dead, preempted, gone, remapped, misplaced, unhealthy, certificate).");
  for (const r of Array.isArray(k.replacements) ? k.replacements : []) {
    if (r && Number.isInteger(r.pod) && typeof r.reason === "string") out.push(`colocate_keeper_replacements_total${labels({ pod: r.pod, reason: r.reason })} ${count(r.n)}`);
  }
}
