// @ts-check
// Forwarding to the pod and to the fallback API.

import { readUpTo } from "./body.js";
import { HttpError } from "./errors.js";

// Client headers that travel upstream (to the pod and to the fallback API, which is called
// with the owner's key): what an OpenAI-compatible server reads from a request, nothing that
// names the client's account (OpenAI-Organization, OpenAI-Project), its cookies, the front
// door's credential or Cloudflare's headers. The credential is the router's own.
const UPSTREAM_ALLOWED = ["content-type", "accept", "accept-encoding", "user-agent", "x-request-id"];

export function upstreamHeaders(incoming, token) {
  const h = new Headers();
  for (const k of UPSTREAM_ALLOWED) {
    const v = incoming.get(k);
    if (v !== null) h.set(k, v);
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

// Upstream response headers that reach the client: the body's type and caching, the
// upstream's request id and Retry-After. Nothing else an upstream (a hostile pod, or the
// fallback's account-wide rate limits) says reaches the client: no Set-Cookie, no CORS.
const CLIENT_ALLOWED = ["content-type", "cache-control", "retry-after", "x-request-id"];

/**
 * The upstream answer's status and allowed headers, as a client's Response init. The
 * headers are a plain record: the router adds its own to it and the Response is built with
 * all of them at once (a Headers object here, then set() on the Response, cost one native
 * call per header on every request).
 * @returns {{status: number, statusText: string, headers: Record<string, string>}}
 */
export function clientInit(res) {
  /** @type {Record<string, string>} */
  const headers = {};
  const from = res.headers;
  for (const k of CLIENT_ALLOWED) {
    const v = from.get(k);
    if (v !== null) headers[k] = v;
  }
  return { status: res.status, statusText: res.statusText, headers };
}

// The largest non-streamed answer the router takes from an upstream. A real one is far
// smaller: 131,072 tokens (validate.js's max_tokens) of text is about 0.5 MB, and n = 16
// of them with logprobs stays within it. Over it, the answer is a pod failure (pod) or a
// 502 (fallback), and the bytes past the cap are never read.
export const MAX_ANSWER_BYTES = 16 * 1024 * 1024;

/** A pod answer the router treats as a failure (and serves from the fallback). A redirect
 * is one: it is never followed (the prompt would go to an address the pod names). */
export function isPodFailure(status) {
  return status >= 500 || (status >= 300 && status < 400) || status === 401 || status === 403 || status === 408 || status === 429;
}

class Oversized extends Error {}

/**
 * The whole body of an upstream answer, or Oversized past `cap` bytes. A declared length
 * is checked before reading (the runtime then reads natively); without one, the body is
 * counted while read and cancelled at the cap.
 */
async function readCapped(res, cap) {
  const declared = res.headers.get("content-length");
  if (declared !== null && Number(declared) <= cap) return res.arrayBuffer();
  if (declared !== null || !res.body) {
    await res.body?.cancel().catch(() => {});
    if (!res.body) return new ArrayBuffer(0);
    throw new Oversized();
  }
  const bytes = await readUpTo(res.body, cap);
  if (bytes === null) throw new Oversized();
  return bytes.buffer;
}

export function isStream(res) {
  return (res.headers.get("content-type") || "").toLowerCase().startsWith("text/event-stream");
}

/**
 * Try the pod within `deadlineMs`. A streamed (SSE) answer to a request that asked for a
 * stream (`streamed`) counts as served once its headers arrive and is then passed through
 * chunk by chunk; any other answer must be complete within the deadline (so a pod that
 * stalls mid-body still falls back), and within MAX_ANSWER_BYTES, an event stream the
 * request did not ask for included.
 * @returns {Promise<{ok: true, response: Response, stream: boolean, bytes?: ArrayBuffer} | {ok: false, reason: string}>}
 */
export async function tryPod(fetchImpl, url, init, deadlineMs, streamed = false) {
  const ac = new AbortController();
  let expired = false;
  const timer = setTimeout(() => {
    expired = true;
    ac.abort();
  }, deadlineMs);
  try {
    init.signal = ac.signal; // init is this call's own object: no copy
    init.redirect = "manual";
    const res = await fetchImpl(url, init);
    if (isPodFailure(res.status)) {
      await res.body?.cancel().catch(() => {});
      return { ok: false, reason: `status_${res.status}` };
    }
    if (streamed && isStream(res)) return { ok: true, response: res, stream: true };
    const bytes = await readCapped(res, MAX_ANSWER_BYTES);
    return { ok: true, response: res, bytes, stream: false }; // headers from `response`, body in `bytes`
  } catch (err) {
    if (err instanceof Oversized) return { ok: false, reason: "oversized" };
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
    const res = await fetchImpl(podUrl + "/health", { signal: ac.signal, redirect: "manual" });
    await res.body?.cancel().catch(() => {});
    return !isPodFailure(res.status);
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Send the request to the fallback API; a network failure becomes a 502 JSON error, and so
 * does a redirect (never followed: it would carry the prompt and the owner's key elsewhere).
 */
export async function callFallback(fetchImpl, url, init) {
  let res;
  try {
    init.redirect = "manual";
    res = await fetchImpl(url, init);
  } catch {
    throw new HttpError(502, "upstream_unavailable", "the pod and the fallback API are both unavailable");
  }
  if (res.status >= 300 && res.status < 400) {
    await res.body?.cancel().catch(() => {});
    throw new HttpError(502, "upstream_redirect", `the fallback API answered ${res.status} (a redirect), which the router does not follow`);
  }
  return res;
}

/** A non-streamed fallback answer's bytes, or a 502 past MAX_ANSWER_BYTES. */
export async function fallbackBytes(res) {
  try {
    return await readCapped(res, MAX_ANSWER_BYTES);
  } catch (err) {
    if (err instanceof Oversized) throw new HttpError(502, "upstream_oversized", `the fallback API's answer is larger than ${MAX_ANSWER_BYTES} bytes`);
    throw err;
  }
}

const encoder = new TextEncoder();
const ASK_USAGE = encoder.encode('"stream_options":{"include_usage":true},');

// Each key's `"cache_salt":"<key id>",` field, encoded once per isolate rather than on every
// request (bounded like keys.js's remembered digests).
const saltFields = new Map();

function saltField(salt) {
  let f = saltFields.get(salt);
  if (f === undefined) {
    if (saltFields.size >= 1024) saltFields.clear();
    f = encoder.encode(`"cache_salt":${JSON.stringify(salt)},`);
    saltFields.set(salt, f);
  }
  return f;
}

/**
 * The body sent upstream: the client's bytes, with `model` replaced (the fallback's
 * FALLBACK_MODEL), `stream_options.include_usage` set when the router asks for a
 * stream's usage that the client did not ask for, and, to a pod, the key's `cache_salt`
 * (vLLM keeps prefix-cache entries of different salts apart, so one key cannot time
 * another's prompts; a client's own `cache_salt` is replaced). Without a model to replace
 * and without the client's `cache_salt` (or its `stream_options`, when usage is asked),
 * the fields are spliced in after the opening brace (the body is a JSON object, so never
 * empty): the client's bytes are not re-encoded.
 */
export function upstreamBody(bytes, json, model, askUsage, salt = null) {
  if (!json || (!model && !askUsage && salt === null)) return bytes;
  if (!model && (salt === null || json.cache_salt === undefined) && (!askUsage || json.stream_options === undefined)) {
    const saltBytes = salt === null ? null : saltField(salt);
    const add = (saltBytes ? saltBytes.length : 0) + (askUsage ? ASK_USAGE.length : 0);
    const at = bytes.indexOf(0x7b) + 1; // after "{" (and any BOM or blanks before it)
    const out = new Uint8Array(bytes.length + add);
    out.set(bytes.subarray(0, at));
    let to = at;
    if (saltBytes) {
      out.set(saltBytes, to);
      to += saltBytes.length;
    }
    if (askUsage) {
      out.set(ASK_USAGE, to);
      to += ASK_USAGE.length;
    }
    out.set(bytes.subarray(at), to);
    return out;
  }
  const body = { ...json };
  if (model) body.model = model;
  if (askUsage) body.stream_options = { ...json.stream_options, include_usage: true };
  if (salt !== null) body.cache_salt = salt;
  return encoder.encode(JSON.stringify(body));
}
