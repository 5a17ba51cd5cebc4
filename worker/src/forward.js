// @ts-check
// Forwarding to the pod and to the fallback API.

import { concat, readUpTo } from "./body.js";
import { HttpError } from "./errors.js";

// Client headers that travel upstream (to the pod and to the fallback API, which is called
// with the owner's key): what an OpenAI-compatible server reads from a request, nothing that
// names the client's account (OpenAI-Organization, OpenAI-Project), its cookies, the front
// door's credential, Cloudflare's headers or its X-Request-Id (vLLM's engine request id).
// The credential, and a pod's request id, are the router's own.
const UPSTREAM_ALLOWED = ["content-type", "accept", "accept-encoding", "user-agent"];

export function upstreamHeaders(incoming, token, requestId = null) {
  const h = new Headers();
  for (const k of UPSTREAM_ALLOWED) {
    const v = incoming.get(k);
    if (v !== null) h.set(k, v);
  }
  h.set("authorization", `Bearer ${token}`);
  if (requestId !== null) h.set("x-request-id", requestId);
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
 * Try the pod. `deadlineMs` bounds the time to its first token: the headers and the first
 * data event of a stream (vLLM sends a stream's headers at once and its first event after
 * prefill, so the event, not the headers, is the first token). After it, the stream is
 * watched for stalls (`Pace`): no new byte for `stallMs` while the router waits for one is
 * a stall, however long the answer. `mode`:
 * - "stream": the client asked for a stream; served once the first event has arrived, then
 *   passed on (`pace.body` / `pace.stream`);
 * - "assemble": the client asked for none and the router asked the pod for a stream
 *   (`upstreamBody`); the whole stream is read here (at most `streamCap` bytes) for
 *   assemble.js to rebuild the JSON answer from;
 * - "whole": a non-streamed answer, complete within `deadlineMs` and MAX_ANSWER_BYTES.
 * A pod that answers a stream request with JSON (an OpenAI-compatible server without
 * streaming) is read whole, as in "whole". A failure after the first token carries
 * `started: true` (and the bytes read so far): it is the pod's, but the request has begun
 * and is not bought again (docs/worker.md, "Routing"). `tab` (tab.js), when given, can cancel
 * the request (the client hung up), and its tally counts what an assembled answer reports.
 * `onFirst` is called when a stream's first event arrives (the caller learns a whole answer's
 * first token when it returns).
 * @returns {Promise<any>}
 */
export async function tryPod(fetchImpl, url, init, deadlineMs, mode = "whole", stallMs = deadlineMs, streamCap = MAX_STREAM_READ,
  minTokensPerS = 25, tab = null, onFirst = null) {
  const ac = new AbortController();
  let expired = false;
  let reader = null;
  const timer = setTimeout(() => {
    expired = true;
    ac.abort();
    if (reader !== null) reader.cancel(new Error("deadline")).catch(() => {}); // whatever the runtime does with the signal
  }, deadlineMs);
  if (tab !== null) {
    tab.cancel = () => {
      ac.abort();
      if (reader !== null) reader.cancel(new Error("client_gone")).catch(() => {});
    };
  }
  let pace = null;
  try {
    init.signal = ac.signal; // init is this call's own object: no copy
    init.redirect = "manual";
    const res = await fetchImpl(url, init);
    if (isPodFailure(res.status)) {
      await res.body?.cancel().catch(() => {});
      return { ok: false, reason: `status_${res.status}` };
    }
    if (mode !== "whole" && res.body && isStream(res)) {
      // An assembled answer is read in windows where the runtime can (readAtLeast: one
      // JavaScript turn per window, not per token); a stream passed on, chunk by chunk.
      let windows = mode === "assemble" && WINDOWS;
      try {
        reader = windows ? res.body.getReader({ mode: "byob" }) : res.body.getReader();
      } catch {
        windows = false; // not a byte stream: read it chunk by chunk
        reader = res.body.getReader();
      }
      const first = await firstEvent(reader, windows);
      clearTimeout(timer);
      if (first === null) return { ok: false, reason: expired ? "deadline" : "empty_stream" };
      if (onFirst !== null) onFirst(); // the prompt's prefill is done: its queue is behind it
      pace = new Pace(reader, stallMs, first, !windows);
      pace.abort = () => ac.abort(); // a cut also ends the pod's request
      if (mode === "stream") return { ok: true, response: res, stream: true, pace };
      if (tab !== null) {
        pace.tally = tab.tally;
        tab.pace = pace;
      }
      const cap = Math.min(streamCap, MAX_STREAM_READ);
      const all = windows ? await pace.readWindows(cap, minTokensPerS) : await pace.readAll(cap);
      if (all.reason !== null) return { ok: false, reason: all.reason, started: true, bytes: all.bytes, pace };
      return { ok: true, response: res, bytes: all.bytes, stream: false, assembled: true, pace };
    }
    const bytes = await readCapped(res, MAX_ANSWER_BYTES);
    return { ok: true, response: res, bytes, stream: false }; // headers from `response`, body in `bytes`
  } catch (err) {
    if (err instanceof Oversized) return { ok: false, reason: "oversized" };
    return { ok: false, reason: expired ? "deadline" : "unreachable" };
  } finally {
    clearTimeout(timer);
  }
}

// The most stream an assembled answer reads (and less when the request allows fewer
// tokens: usage.js streamCap): its JSON is at most MAX_ANSWER_BYTES, and a stream spends
// about as much again per token on each event's envelope.
export const MAX_STREAM_READ = 2 * MAX_ANSWER_BYTES;

// workerd's BYOB readers have readAtLeast (Node's, in the unit tests, do not).
const WINDOWS = typeof ReadableStreamBYOBReader === "function" && "readAtLeast" in ReadableStreamBYOBReader.prototype;

/**
 * The bytes up to and including the first chunk that carries a data event; null: the stream
 * ended first. A BYOB read fills a FIRST_READ buffer whose unused rest the first window of
 * an assembled answer reads into (Pace.readWindows): a short answer is one buffer, never copied.
 */
async function firstEvent(reader, byob = false) {
  let got = null;
  for (;;) {
    const { done, value } = await (byob ? reader.read(new Uint8Array(FIRST_READ)) : reader.read());
    if (done) return null;
    got = got === null ? value : concat([got, value], got.byteLength + value.byteLength);
    if (hasData(got)) return got;
  }
}

// The first read's buffer (and room for an assembled answer's first window after it): a
// short answer's whole stream (about 110 bytes an event) fits, and 8 KB costs less to
// allocate and zero than the 16 KB first read and 4 KB window it replaces.
const FIRST_READ = 8192;
const D = 0x64; // "d" of "data:"

function hasData(b) {
  for (let i = b.indexOf(D); i >= 0 && i + 4 < b.length; i = b.indexOf(D, i + 1)) {
    if (b[i + 1] === 0x61 && b[i + 2] === 0x74 && b[i + 3] === 0x61 && b[i + 4] === 0x3a && (i === 0 || b[i - 1] === 10)) return true;
  }
  return false;
}

const LF = 10;
const WINDOW_TOKENS = 32; // events a window of an assembled answer's stream holds (Pace.readWindows)

/** Line feeds in `b`: an SSE data event is one line and a blank one (JSON carries no raw newline). */
function lines(b) {
  let n = 0;
  for (let i = b.indexOf(LF); i >= 0; i = b.indexOf(LF, i + 1)) n++;
  return n;
}

/** The event that ends a client's stream whose pod stalled: OpenAI's error shape, which OpenAI's SDKs raise. */
export function stallEvent(stallMs) {
  const error = { message: `the pod sent nothing for ${stallMs} ms in the middle of the answer: cut here`,
    type: "server_error", code: "upstream_stalled" };
  return encoder.encode(`data: ${JSON.stringify({ error })}\n\n`);
}

/**
 * The event that ends a client's stream whose pod broke off after its first token (its connection
 * lost: a pod preempted or killed): OpenAI's error shape, which OpenAI's SDKs raise.
 */
export function brokenEvent() {
  const error = { message: "the pod's answer broke off after it had begun (its connection was lost): cut here; retry the request",
    type: "server_error", code: "upstream_broken" };
  return encoder.encode(`data: ${JSON.stringify({ error })}\n\n`);
}

/**
 * The pace of a pod's stream after its first token: stalls (nothing for `stallMs` while
 * the router waits for the next chunk; time spent waiting on the client's side, which
 * holds the stream back, is not the pod's), and the token rate, from the events read and
 * the time spent waiting for them. One timer a `stallMs` period, not one per chunk; the
 * per-chunk cost is two clock reads and a scan for line feeds.
 */
export class Pace {
  constructor(reader, stallMs, first, watch = true) {
    this.reader = reader;
    this.stallMs = stallMs;
    this.first = first;
    this.lines = lines(first);
    this.waitMs = 0; // time spent waiting for the pod's chunks after the first
    this.since = Date.now(); // when the current wait began (or the last chunk arrived)
    this.waiting = false;
    this.stalled = false;
    this.ended = false;
    this.told = false; // the stall event was handed on
    this.onTick = null; // called each period with this (router.js judges the rate mid-stream)
    /** @type {import("./podstream.js").Tally | null} */
    this.tally = null; // an assembled answer's reads report here what the pod made (readWindows, readAll)
    this.readAt = this.since; // when the last window arrived
    this.timer = watch ? setTimeout(() => this.tick(), stallMs) : null;
  }

  /**
   * Events an assembled answer's pod has likely sent since its last window was read, at the
   * pace read so far, at most a window's (WINDOW_TOKENS): a read cancelled midway gives back
   * none of its bytes, so a client that hangs up is charged these as made (tab.js).
   */
  unread(now) {
    if (this.ended || this.waitMs <= 0) return 0;
    return Math.min(WINDOW_TOKENS, Math.round(((now - this.readAt) * Math.max(0, this.events - 1)) / this.waitMs));
  }

  tick() {
    this.timer = null;
    if (this.ended) return;
    const idle = Date.now() - this.since;
    if (this.waiting && idle >= this.stallMs) {
      this.stalled = true;
      this.reader.cancel(new Error("stalled")).catch(() => {});
      return;
    }
    if (this.onTick) this.onTick(this);
    this.timer = setTimeout(() => this.tick(), this.waiting ? Math.max(1, this.stallMs - idle) : this.stallMs);
  }

  end() {
    this.ended = true;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
  }

  /** Events read so far (the first's included). */
  get events() {
    return this.lines >> 1;
  }

  /** The next chunk: the first one, then the pod's; after a stall, the stall event once, then the end. */
  async read() {
    if (this.first !== null) {
      const value = this.first;
      this.first = null;
      return { done: false, value };
    }
    if (this.ended) return this.tell();
    const t = Date.now();
    this.since = t;
    this.waiting = true;
    let r;
    try {
      r = await this.reader.read();
    } catch (err) {
      this.end();
      if (this.stalled) return this.tell();
      throw err;
    } finally {
      this.waiting = false;
    }
    const now = Date.now();
    this.waitMs += now - t;
    this.since = now;
    if (r.done) {
      this.end();
      return this.tell();
    }
    this.lines += lines(r.value);
    return r;
  }

  tell() {
    if (this.stalled && !this.told) {
      this.told = true;
      return { done: false, value: stallEvent(this.stallMs) };
    }
    return { done: true, value: undefined };
  }

  cancel(reason) {
    this.end();
    return this.reader.cancel(reason);
  }

  /** The stream as a body whose reader is this (usage.js stripStream reads it chunk by chunk). */
  get body() {
    const self = this;
    return /** @type {any} */ ({ getReader: () => ({ read: () => self.read(), cancel: (r) => self.cancel(r), releaseLock() {} }) });
  }

  /** The stream as a ReadableStream (for a tee: usage.js tapStream). */
  stream() {
    return new ReadableStream({
      pull: async (c) => {
        const r = await this.read();
        if (r.done) c.close();
        else c.enqueue(r.value);
      },
      cancel: (reason) => this.cancel(reason),
    }, { highWaterMark: 0 });
  }

  /**
   * The rest of the stream read in windows (a BYOB reader's readAtLeast): about
   * WINDOW_TOKENS events' bytes a read (from the first event's size), so a short answer is
   * one read and a long one a read every few dozen tokens. Each window must arrive within
   * STALL_MS + 8 × its time at `minTokensPerS`: nothing for that long, or a pod under an
   * eighth of that rate over a whole window, is a stall. A busy pod is slower than its rate
   * but not that slow: the default profile's longest step (a full prefill chunk of other
   * requests' prompts beside a full batch) takes 231 ms, 4.3 tokens/s. As readAll.
   */
  async readWindows(cap, minTokensPerS) {
    const first = this.first;
    const chunks = [];
    let size = first.byteLength;
    this.first = null;
    const windowBytes = Math.max(4096, Math.min(65536, size * WINDOW_TOKENS));
    const allowMs = this.stallMs + Math.ceil((8000 * WINDOW_TOKENS) / Math.max(minTokensPerS, 0.001));
    // The first window reads into the rest of the first read's buffer (when it was one
    // read and has room): the bytes so far stay where they are, and a short answer ends
    // as one array with no copy. `head`: the buffer's view of everything read so far.
    let spare = first.byteOffset === 0 && first.buffer.byteLength - size >= 1024 ? first.buffer.byteLength - size : 0;
    let head = first;
    if (this.tally !== null) this.tally.feed(first);
    const saved = spare ? first.slice() : null; // the first bytes, should a cut read not give the buffer back
    let reason = null;
    try {
      for (;;) {
        // A window is never more than windowBytes: its time allowance is WINDOW_TOKENS events'.
        const want = Math.min(spare ? Math.min(spare, windowBytes) : windowBytes, cap + 1 - size);
        if (want <= 0) {
          reason = "oversized";
          break;
        }
        const t = Date.now();
        const timer = setTimeout(() => {
          this.stalled = true;
          this.reader.cancel(new Error("stalled")).catch(() => {});
        }, allowMs);
        const into = spare ? new Uint8Array(head.buffer, head.byteLength, want) : new Uint8Array(want);
        let r;
        try {
          r = await this.reader.readAtLeast(want, into);
        } finally {
          clearTimeout(timer);
        }
        this.readAt = Date.now();
        this.waitMs += this.readAt - t;
        if (spare) {
          // The read took the buffer over (a BYOB read transfers it): the bytes before
          // the window are in the buffer it gives back, or, when it gave none, lost.
          spare = 0;
          const back = r.value ? r.value.buffer : null;
          head = back !== null && back.byteLength >= size ? new Uint8Array(back, 0, size) : saved;
        }
        if (this.stalled) {
          reason = "stalled";
          break;
        }
        if (r.value && r.value.byteLength) {
          this.lines += lines(r.value);
          if (this.tally !== null) this.tally.feed(r.value);
          if (r.value.buffer === head.buffer && r.value.byteOffset === head.byteLength) head = new Uint8Array(head.buffer, 0, size + r.value.byteLength);
          else chunks.push(r.value);
          size += r.value.byteLength;
        }
        if (r.done) break;
      }
    } catch {
      reason = this.stalled ? "stalled" : "broken";
    }
    if (head.byteLength === 0) head = saved; // the read that took the buffer threw
    if (reason === "oversized") await this.reader.cancel(new Error("oversized")).catch(() => {});
    this.end();
    return { bytes: chunks.length ? concat([head, ...chunks], size) : head, reason };
  }

  /** The rest of the stream in one array, or why not: {bytes, reason: null | "stalled" | "broken" | "oversized"}. */
  async readAll(cap) {
    const chunks = [];
    let size = 0;
    let reason = null;
    try {
      for (;;) {
        const r = await this.read();
        if (r.done) break;
        if (this.told) {
          reason = "stalled";
          break;
        }
        size += r.value.byteLength;
        if (size > cap) {
          reason = "oversized";
          await this.cancel(new Error("oversized")).catch(() => {});
          break;
        }
        chunks.push(r.value);
        if (this.tally !== null) this.tally.feed(r.value);
        this.readAt = Date.now();
      }
    } catch {
      reason = "broken";
    }
    this.end();
    return { bytes: concat(chunks, chunks.reduce((n, c) => n + c.byteLength, 0)), reason };
  }
}

/**
 * Whether `GET <pod>/health` answers within `ms` without a failure status: a witness with
 * no key for the breaker. Any answer but a failure (even 404 from a pod without the route)
 * says the pod is up. It carries the pod token: the pod's guard opens /health to it alone
 * (colocate/pods/guard/colocate_pod_guard.py), and a 401 is a failure.
 * @param {(url: string, init: RequestInit) => Promise<Response>} fetchImpl
 * @param {string} podUrl
 * @param {number} ms
 * @param {string} token  the pod token (required: without it a guarded pod answers 401)
 */
export async function healthOk(fetchImpl, podUrl, ms, token) {
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), ms);
  try {
    const res = await fetchImpl(podUrl + "/health", { headers: { authorization: `Bearer ${token}` }, signal: ac.signal, redirect: "manual" });
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
const ASK_CONTINUOUS = encoder.encode('"stream_options":{"include_usage":true,"continuous_usage_stats":true},');
const ASK_STREAM = encoder.encode('"stream":true,');

/**
 * Whether a request the client did not stream is asked of the pod as a stream and
 * assembled (assemble.js): every chat or legacy completion, but those whose streamed form
 * vLLM refuses or writes differently: `best_of` above `n` (vLLM streams only the n it
 * returns) and `prompt_logprobs` (a non-streamed answer's field a stream does not carry;
 * validate.js refuses it today, this keeps the rule if that changes).
 */
export function streamable(json) {
  if (!json || json.stream === true) return false;
  if (json.prompt_logprobs !== undefined && json.prompt_logprobs !== null) return false;
  const n = Number.isInteger(json.n) ? json.n : 1;
  return !(Number.isInteger(json.best_of) && json.best_of > n);
}

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
 * stream's usage that the client did not ask for, `stream: true` when the router asks
 * for a stream the client did not (`streamIt`, with usage), and, to a pod, the key's
 * `cache_salt` (vLLM keeps prefix-cache entries of different salts apart, so one key
 * cannot time another's prompts; a client's own `cache_salt` is replaced). When none of
 * the fields it sets is in the client's body (and no model is replaced), they are spliced
 * in after the opening brace (the body is a JSON object, so never empty): the client's
 * bytes are not re-encoded. `continuous` (a pod's stream): usage on every event as well
 * (`continuous_usage_stats`, podstream.js), whether or not the client asked for usage.
 */
export function upstreamBody(bytes, json, model, askUsage, salt = null, streamIt = false, continuous = false) {
  const keep = continuous && (streamIt || (!!json && json.stream === true));
  if (!json || (!model && !askUsage && salt === null && !streamIt && !keep)) return bytes;
  const usage = askUsage || streamIt || keep;
  const ask = keep ? ASK_CONTINUOUS : ASK_USAGE;
  if (!model && (salt === null || json.cache_salt === undefined) && (!usage || json.stream_options === undefined)
    && (!streamIt || json.stream === undefined)) {
    const saltBytes = salt === null ? null : saltField(salt);
    const add = (saltBytes ? saltBytes.length : 0) + (usage ? ask.length : 0) + (streamIt ? ASK_STREAM.length : 0);
    const at = bytes.indexOf(0x7b) + 1; // after "{" (and any BOM or blanks before it)
    const out = new Uint8Array(bytes.length + add);
    out.set(bytes.subarray(0, at));
    let to = at;
    if (saltBytes) {
      out.set(saltBytes, to);
      to += saltBytes.length;
    }
    if (streamIt) {
      out.set(ASK_STREAM, to);
      to += ASK_STREAM.length;
    }
    if (usage) {
      out.set(ask, to);
      to += ask.length;
    }
    out.set(bytes.subarray(at), to);
    return out;
  }
  const body = { ...json };
  if (model) body.model = model;
  if (streamIt) body.stream = true;
  if (usage) {
    body.stream_options = { ...(json.stream_options || {}), include_usage: true };
    if (keep) body.stream_options.continuous_usage_stats = true;
  }
  if (salt !== null) body.cache_salt = salt;
  return encoder.encode(JSON.stringify(body));
}
