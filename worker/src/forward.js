// Forwarding to the pod and to the fallback API.

import { HttpError } from "./errors.js";

// Client headers that must not travel upstream: credentials (replaced), hop and
// Cloudflare headers (re-made by fetch), and the length (the body is re-sent as bytes).
const DROP = new Set(["authorization", "host", "content-length", "connection", "keep-alive",
  "transfer-encoding", "upgrade", "te", "trailer", "proxy-authorization", "x-forwarded-for", "x-real-ip"]);

export function upstreamHeaders(incoming, token) {
  const h = new Headers();
  for (const [k, v] of incoming) {
    if (!DROP.has(k) && !k.startsWith("cf-")) h.set(k, v);
  }
  h.set("authorization", `Bearer ${token}`);
  return h;
}

const hops = new WeakMap();

/**
 * How the Worker reaches its pods: through the POD_TLS binding when the plan binds it (its
 * fetch presents the cell's client certificate: mutual TLS to the pod), else plain fetch
 * (RunPod's proxy path, where no client certificate can reach the pod). One per env.
 */
export function podFetch(env) {
  let f = hops.get(env);
  if (f === undefined) {
    const binding = env.POD_TLS;
    f = binding ? (url, init) => binding.fetch(url, init) : fetch;
    hops.set(env, f);
  }
  return f;
}

/** A pod answer the router treats as a failure (and serves from the fallback). */
export function isPodFailure(status) {
  return status >= 500 || status === 401 || status === 403 || status === 408 || status === 429;
}

export function isStream(res) {
  return (res.headers.get("content-type") || "").toLowerCase().startsWith("text/event-stream");
}

/**
 * Try the pod within `deadlineMs`. A streamed (SSE) answer counts as served once its
 * headers arrive and is then passed through chunk by chunk; any other answer must be
 * complete within the deadline (so a pod that stalls mid-body still falls back).
 * @returns {Promise<{ok: true, response: Response, stream: boolean, bytes?: ArrayBuffer} | {ok: false, reason: string}>}
 */
export async function tryPod(fetchImpl, url, init, deadlineMs) {
  const ac = new AbortController();
  let expired = false;
  const timer = setTimeout(() => {
    expired = true;
    ac.abort();
  }, deadlineMs);
  try {
    init.signal = ac.signal; // init is this call's own object: no copy
    const res = await fetchImpl(url, init);
    if (isPodFailure(res.status)) {
      await res.body?.cancel().catch(() => {});
      return { ok: false, reason: `status_${res.status}` };
    }
    if (isStream(res)) return { ok: true, response: res, stream: true };
    const bytes = await res.arrayBuffer();
    return { ok: true, response: res, bytes, stream: false }; // headers from `response`, body in `bytes`
  } catch {
    return { ok: false, reason: expired ? "deadline" : "unreachable" };
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Whether `GET <pod>/health` answers within `ms` without a failure status: a witness with
 * no key for the breaker. Any answer but a failure (even 404 from a pod without the route)
 * says the pod is up.
 */
export async function healthOk(fetchImpl, podUrl, ms) {
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), ms);
  try {
    const res = await fetchImpl(podUrl + "/health", { signal: ac.signal });
    await res.body?.cancel().catch(() => {});
    return !isPodFailure(res.status);
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

/** Send the request to the fallback API; a network failure becomes a 502 JSON error. */
export async function callFallback(fetchImpl, url, init) {
  try {
    return await fetchImpl(url, init);
  } catch {
    throw new HttpError(502, "upstream_unavailable", "the pod and the fallback API are both unavailable");
  }
}

const encoder = new TextEncoder();
const ASK_USAGE = encoder.encode('"stream_options":{"include_usage":true},');

/**
 * The body sent upstream: the client's bytes, with `model` replaced (the fallback's
 * FALLBACK_MODEL) and `stream_options.include_usage` set when the router asks for a
 * stream's usage that the client did not ask for. Without `stream_options` in the body
 * and without a model to replace, the option is spliced in after the opening brace (the
 * body is a JSON object with `stream`, so never empty): the client's bytes are not
 * re-encoded.
 */
export function upstreamBody(bytes, json, model, askUsage) {
  if (!json || (!model && !askUsage)) return bytes;
  if (!model && json.stream_options === undefined) {
    const at = bytes.indexOf(0x7b) + 1; // after "{" (and any BOM or blanks before it)
    const out = new Uint8Array(bytes.length + ASK_USAGE.length);
    out.set(bytes.subarray(0, at));
    out.set(ASK_USAGE, at);
    out.set(bytes.subarray(at), at + ASK_USAGE.length);
    return out;
  }
  const body = { ...json };
  if (model) body.model = model;
  if (askUsage) body.stream_options = { ...json.stream_options, include_usage: true };
  return encoder.encode(JSON.stringify(body));
}
