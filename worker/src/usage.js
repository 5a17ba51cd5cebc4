// @ts-check
// Token usage from upstream answers (OpenAI's `usage` object), for limits and usage rows.
//
// A complete JSON answer carries `usage` at its top level (read from the parsed answer;
// estimated from its text when missing). A streamed (SSE) answer carries
// it in a last data event (`"choices": []`) when the request asked
// `stream_options.include_usage` (vLLM and OpenAI both do so). The router asks for it on
// every stream; when the client did not, `stripStream` takes that event out of the
// client's stream. A stream that ends (or is cut) without one is estimated from its text:
// `estimateUsage` (docs/worker.md, "Streams and tokens").

import { shortestPromptTokens } from "./validate.js";

const decoder = new TextDecoder();
const TAIL_BYTES = 16384; // the last events of a stream; a usage event is a few hundred bytes

// Counts past this are not believed as they are; the request's ceiling caps them anyway.
const MAX_COUNT = Number.MAX_SAFE_INTEGER;

/** A reported count as a whole number >= 0 (a huge or infinite one is clamped, never kept). */
function count(v) {
  return typeof v === "number" && v > 0 ? Math.min(Math.floor(v), MAX_COUNT) : 0;
}

/** {prompt, completion} from a usage object, or null. */
function fromUsage(u) {
  if (!u || typeof u !== "object") return null;
  const prompt = count(u.prompt_tokens);
  const completion = count(u.completion_tokens);
  return prompt + completion > 0 ? { prompt, completion } : null;
}

/**
 * Usage of a complete JSON answer's bytes, or null: the top-level `usage` of the parsed
 * answer, so no value inside the answer (a `"usage"` string in generated text or in
 * vLLM's `prompt_logprobs`, which it writes after `usage`) can stand in for it.
 */
export function usageOfJson(buffer) {
  const doc = parseAnswer(buffer);
  return doc === null ? null : fromUsage(doc.usage);
}

/** The answer as a JSON object, or null. */
function parseAnswer(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  try {
    const doc = JSON.parse(decoder.decode(bytes));
    return doc !== null && typeof doc === "object" && !Array.isArray(doc) ? doc : null;
  } catch {
    return null;
  }
}

/**
 * The usage of a complete JSON answer: its reported `usage`, else (none, or not a usage
 * object) `estimate(chars)` from the characters of its generated text, as a stream
 * without a usage event is estimated.
 */
export function usageOfAnswer(buffer, estimate) {
  return usageOfDoc(parseAnswer(buffer), estimate);
}

/** The same, of an answer already parsed (assemble.js builds one from a stream); null: none. */
export function usageOfDoc(doc, estimate) {
  const found = doc === null ? null : fromUsage(doc.usage);
  if (found) return found;
  let chars = 0;
  const choices = doc !== null && Array.isArray(doc.choices) ? doc.choices : [];
  for (const c of choices) {
    if (!c || typeof c !== "object") continue;
    const m = c.message && typeof c.message === "object" ? c.message : null;
    for (const v of [c.text, m && m.content, m && (m.reasoning ?? m.reasoning_content)]) if (typeof v === "string") chars += v.length;
    const calls = m && Array.isArray(m.tool_calls) ? m.tool_calls : [];
    for (const t of calls) if (t && t.function && typeof t.function.arguments === "string") chars += t.function.arguments.length;
  }
  return estimate(chars);
}

// validate.js's largest max_tokens: a request without one may be answered up to this,
// unless the cell binds the context its pods serve (MAX_MODEL_LEN, from the plan).
const MAX_COMPLETION_TOKENS = 131_072;

/**
 * How many prompts a request carries: a `/v1/completions` prompt list (strings, or lists
 * of token ids) is one generation per entry on vLLM; anything else is one.
 */
export function promptCount(json) {
  const p = json ? json.prompt : undefined;
  if (!Array.isArray(p) || p.length === 0) return 1;
  return typeof p[0] === "string" || Array.isArray(p[0]) ? p.length : 1;
}

/**
 * The completion tokens one sequence may have: the limit the endpoint honours (chat:
 * `max_completion_tokens`, else `max_tokens`, as vLLM reads them; completions:
 * `max_tokens` only, vLLM ignores `max_completion_tokens` there), cut as vLLM cuts it to
 * what fits beside the prompt in the served context `maxModelLen` (the context less the
 * fewest tokens the request's shortest prompt can be, validate.js).
 */
export function perSequence(json, maxModelLen = MAX_COMPLETION_TOKENS) {
  const chat = !!json && json.messages !== undefined;
  const max = json ? (chat ? (json.max_completion_tokens ?? json.max_tokens) : json.max_tokens) : undefined;
  const room = Math.max(maxModelLen - (json ? shortestPromptTokens(json, chat) : 0), 1);
  return Math.min(Number.isInteger(max) && max > 0 ? max : maxModelLen, room);
}

/**
 * The most usage a request can truly have: no more prompt tokens than its body has bytes
 * (every token of a prompt, a chat template's included, is written with at least one
 * byte of the JSON body, whose quoting and keys add more than a template does) nor than
 * the served context holds for each of its prompts, and no more completion tokens than
 * prompts × `n` (or `best_of`, when larger) × the tokens one sequence may have
 * (`perSequence`).
 */
export function usageCeiling(json, bodyBytes, maxModelLen = MAX_COMPLETION_TOKENS) {
  const n = Math.max(json && Number.isInteger(json.n) && json.n > 0 ? json.n : 1,
    json && Number.isInteger(json.best_of) && json.best_of > 0 ? json.best_of : 1);
  const prompts = promptCount(json);
  return { prompt: Math.min(bodyBytes, prompts * maxModelLen), completion: perSequence(json, maxModelLen) * n * prompts };
}

// A streamed answer's largest size: room for every token the request allows at 4 KiB an
// event (vLLM's event with 20 top logprobs is about 3 KiB), plus 64 KiB, and never past
// MAX_STREAM_BYTES. Past it the stream is cut, the pod's stream cancelled, and what was
// streamed counted: the router's own pumps (a pod's stream, podstream.js pumpPod; a fallback
// stream whose usage the router asked, stripStream) cut at the cap and end with an error event
// (`streamCut`); the native pipe (tapStream: a fallback stream the client asked usage for) is
// read every second, so it is cut within a second of passing the cap, its connection simply ending.
const STREAM_EVENT_BYTES = 4096;
export const MAX_STREAM_BYTES = 256 * 1024 * 1024;

// `echo` (legacy completions) writes each prompt back in the first event of each of its
// choices (vLLM's completion stream). A prompt sent as text comes back in no more bytes than
// it was sent in; one sent as token ids in at most 48 a body byte (an id takes two bytes,
// "5,", and decodes to at most 16 characters, validate.js's longest token, each at most 6
// bytes as JSON writes it, "\u0001").
const ECHO_BYTES_PER_BODY_BYTE = 48;

/** The most bytes a streamed answer to this request may have (see above): sizes the client chose are the client's. */
export function streamCap(json, bodyBytes, maxModelLen = MAX_COMPLETION_TOKENS) {
  const echo = json && json.echo === true ? Math.max(json.n ?? 1, json.best_of ?? 1, 1) * bodyBytes * ECHO_BYTES_PER_BODY_BYTE : 0;
  return Math.min(MAX_STREAM_BYTES, 65_536 + usageCeiling(json, bodyBytes, maxModelLen).completion * STREAM_EVENT_BYTES + echo);
}

const encoder = new TextEncoder();

/** The event that ends a stream cut at `cap` bytes: an OpenAI-shaped error, which OpenAI's SDKs raise. */
export function streamCut(cap) {
  const error = { message: `the upstream's stream passed ${cap} bytes, more than this request can produce: cut here`,
    type: "server_error", code: "stream_too_large" };
  return encoder.encode(`data: ${JSON.stringify({ error })}\n\n`);
}

/** `usage` within `ceiling` (unchanged when it already is; null stays null); `capped` marks a cut. */
export function capUsage(usage, ceiling) {
  if (!usage || (usage.prompt <= ceiling.prompt && usage.completion <= ceiling.completion)) return usage;
  return { ...usage, prompt: Math.min(usage.prompt, ceiling.prompt), completion: Math.min(usage.completion, ceiling.completion), capped: true };
}

// A string value of a field that carries generated text, in an SSE event's JSON.
const CONTENT = /"(?:content|text|reasoning|reasoning_content|arguments)"[ \t]*:[ \t]*"((?:[^"\\]|\\.)*)"/g;

/** Characters of generated text (content, text, tool arguments) in SSE text; JSON escapes count as written. */
export function contentChars(text) {
  let n = 0;
  CONTENT.lastIndex = 0;
  for (let m = CONTENT.exec(text); m !== null; m = CONTENT.exec(text)) n += m[1].length;
  return n;
}

/**
 * The estimate for an answer whose upstream reported no usage (or that was cut before it
 * did): about four characters a token of the streamed text; the prompt at `ceiling`'s
 * (nothing is known of it: the body's bytes, every token being at least one), or without
 * one at four characters a token of the request's `messages` (or `prompt`) as JSON. Marked
 * `estimated` for the usage report.
 */
export function estimateUsage(json, streamedChars, ceiling = null) {
  const completion = Math.ceil(streamedChars / 4);
  if (ceiling !== null) return { prompt: ceiling.prompt, completion, estimated: true };
  let promptChars = 0;
  try {
    const p = json ? (json.messages ?? json.prompt) : undefined;
    promptChars = p === undefined ? 0 : JSON.stringify(p).length;
  } catch {
    // cannot happen for a validated body; an estimate is never worth a failure
  }
  return { prompt: Math.ceil(promptChars / 4), completion, estimated: true };
}

/** Usage in the last SSE data event that has one, or null. */
export function usageOfSseTail(text) {
  const lines = text.split("\n");
  for (let i = lines.length - 1; i >= 0; i--) {
    const line = lines[i];
    if (!line.startsWith("data:") || line.indexOf('"usage"') < 0) continue;
    try {
      const u = fromUsage(JSON.parse(line.slice(5)).usage);
      if (u) return u;
    } catch {
      // a cut-off event at the start of the tail: keep looking further up
    }
  }
  return null;
}

// workerd's byte stream (Cloudflare's IdentityTransformStream) moves a native body to the
// client without a turn of JavaScript per chunk; Node (the unit tests) has only the standard one.
const Identity = typeof IdentityTransformStream === "function" ? IdentityTransformStream : TransformStream;

// While the client's branch flows, the counting branch is read at most this often: the
// tee holds what arrives in between, so one JavaScript turn takes up to a second of events
// instead of one turn per token (a real pod sends a chunk per token). It holds about that
// second of stream; the client's bytes never wait for it (docs/worker.md).
const COUNT_EVERY_MS = 1000;
// A read this long may have left more in the branch: the next one follows at once.
const FULL_READ = 4096;
// When the client's side ends early, the counting branch may read on this long: what the
// tee already holds takes a few turns, and what the pod sends meanwhile it did make.
export const DRAIN_MS = 250;

/**
 * Pass a stream through unchanged and call `done(usage | null)` once when it ends or is
 * cancelled. The runtime pipes the bytes to the client. Without `wantUsage` they are not
 * looked at, and the end is all that is learnt. With it (the client asked for usage, so
 * its stream keeps the usage event), a tee's second branch is read in batches and its
 * last TAIL_BYTES kept to find the usage event; a stream that has none (or is cut before
 * it) is estimated by `estimate(chars)` from the content in that tail, scaled to the
 * stream's whole length.
 */
export function tapStream(body, wantUsage, done, estimate = null, cap = Infinity) {
  let called = false;
  const finish = (usage) => {
    if (!called) {
      called = true;
      done(usage);
    }
  };
  const ts = new Identity();
  if (!wantUsage) {
    const end = () => finish(null);
    return { body: ts.readable, piped: body.pipeTo(ts.writable).then(end, end) };
  }
  const [toClient, toCount] = body.tee();
  const reader = toCount.getReader();
  // The counting branch passed `cap`: the client's stream is cut (aborted: a native pipe
  // leaves its destination errored, so no error event can follow), the pod's cancelled.
  const cut = new AbortController();
  // preventCancel: a tee cancels its source only once both branches are cancelled, and a
  // pipe that cancelled its own branch would wait for that before it settles.
  const delivered = toClient.pipeTo(ts.writable, { preventCancel: true, signal: cut.signal }).then(() => true, (err) => {
    // The client went away, the pod's stream broke, or it was cut. Cancelling both
    // branches cancels the pod's stream, so the pod is not left generating for nobody;
    // the counting branch first reads what the tee holds (every byte the client was sent
    // is there) for DRAIN_MS, so a client that leaves just before the usage event is
    // counted from what the pod made until then (readTail).
    toClient.cancel(err).catch(() => {});
    setTimeout(() => reader.cancel(err).catch(() => {}), DRAIN_MS);
    return false;
  });
  const counted = readTail(reader, delivered, cap, () => cut.abort());
  return {
    body: ts.readable,
    piped: Promise.all([delivered, counted]).then(([, tail]) => {
      // A cut stream is counted too: what was streamed before the cut was generated.
      const usage = tail.text !== null ? usageOfSseTail(tail.text) : null;
      if (usage || !estimate) return finish(usage);
      const seen = tail.text === null ? 0 : contentChars(tail.text) * (tail.total / Math.max(1, tail.text.length));
      return finish(estimate(Math.round(seen)));
    }),
  };
}

// {text: the last TAIL_BYTES of the branch as text (null when none was read), total: the
// bytes read}. The tail keeps references to the last chunks; they are joined once, at the end.
async function readTail(reader, delivered, cap = Infinity, onCap = () => {}) {
  let flowing = true;
  let goneAt = -1; // when the client's side ended early: what the tee holds is read for DRAIN_MS more
  delivered.then((ok) => {
    flowing = false; // the client has everything (or has gone): read the rest without pausing
    if (!ok) goneAt = Date.now();
  });
  const tail = []; // the last chunks, at least TAIL_BYTES of them when there are that many
  let size = 0;
  let total = 0;
  let full = false; // the last read filled its buffer: more may be waiting
  try {
    for (;;) {
      // Even the first read waits: a stream shorter than the pause is read once it has ended.
      if (flowing && !full) await firstOf(delivered, COUNT_EVERY_MS);
      if (goneAt >= 0 && Date.now() - goneAt > DRAIN_MS) {
        // A source that never waits (a hostile one) could keep this loop in microtasks: the
        // timer set where the client left might never run, so the bound is checked here too.
        reader.cancel(new Error("client_gone")).catch(() => {});
        break;
      }
      const { done, value } = await reader.read();
      if (done) break;
      tail.push(value);
      size += value.byteLength;
      total += value.byteLength;
      while (size - tail[0].byteLength >= TAIL_BYTES) size -= tail.shift().byteLength;
      full = value.byteLength >= FULL_READ;
      if (total > cap) {
        onCap();
        reader.cancel(new Error("stream_too_large")).catch(() => {});
        break;
      }
    }
  } catch {
    // the branch broke: so did the client's, and `delivered` says so; count what was read
  }
  if (size === 0) return { text: null, total };
  const bytes = new Uint8Array(size);
  let at = 0;
  for (const c of tail) {
    bytes.set(c, at);
    at += c.byteLength;
  }
  const text = decoder.decode(bytes.subarray(Math.max(0, size - TAIL_BYTES)));
  return { text, total: total * (text.length / Math.min(size, TAIL_BYTES)) }; // in characters, like `text`
}

// After `"usage"`: the object's opening brace (not `null`).
const USAGE_OBJECT = /"usage"[ \t\r\n]*:[ \t\r\n]*\{/;

/** The end of the last complete SSE event in `text` (after its blank line), or 0. */
function lastEventEnd(text) {
  const a = text.lastIndexOf("\n\n");
  const b = text.lastIndexOf("\n\r\n");
  return Math.max(a < 0 ? 0 : a + 2, b < 0 ? 0 : b + 3);
}

/**
 * The client's stream when the router, not the client, asked for usage: the upstream's
 * events pass on as they arrive, except the usage event (`"choices": []` with a `usage`
 * object), which is read and taken out, so the client sees what it asked for. Calls
 * `done(usage)` once at the end or cut: the reported usage, else `estimate(chars)` from
 * the content of the last TAIL_BYTES streamed, scaled to the whole stream (as tapStream).
 *
 * Cost: a tee cannot drop an event, so every chunk takes one JavaScript turn: read from
 * the upstream, written to a runtime byte stream (the client's side stays native). The
 * common chunk holds whole events and no usage object: it is decoded, searched once and
 * written as the same bytes. Only a partial event waits for the rest of itself (an SSE
 * client cannot use half an event either), and only a chunk with a usage object is cut
 * and re-encoded. The other events' `"usage": null` (OpenAI and vLLM add it to every
 * chunk once usage is asked) stays: for a client it is the same as no field, and taking it
 * out would re-encode every event.
 */
export function stripStream(body, done, estimate, cap = Infinity) {
  const ts = new Identity();
  return { body: ts.readable, piped: pumpStripping(body, ts.writable, done, estimate, cap) };
}

const LF = 10;
const CR = 13;

/** Whether bytes end an SSE event (a blank line: LF LF, or CR LF CR LF). */
function endsEvent(b) {
  const n = b.length;
  return n >= 2 && b[n - 1] === LF && (b[n - 2] === LF || (n >= 4 && b[n - 2] === CR && b[n - 3] === LF));
}

const BRACE = 0x7b;

/** Whether `b` holds `"usage"`, blanks, `:`, blanks, `{` (USAGE_OBJECT on bytes, not decoded). */
export function hasUsageObject(b) {
  for (let i = b.indexOf(BRACE); i >= 0; i = b.indexOf(BRACE, i + 1)) {
    let j = i - 1;
    while (j >= 0 && (b[j] === 32 || b[j] === 9 || b[j] === LF || b[j] === CR)) j--;
    if (j < 0 || b[j] !== 0x3a) continue; // ":"
    j--;
    while (j >= 0 && (b[j] === 32 || b[j] === 9 || b[j] === LF || b[j] === CR)) j--;
    // `"usage"`, read backwards
    if (j >= 6 && b[j] === 0x22 && b[j - 1] === 0x65 && b[j - 2] === 0x67 && b[j - 3] === 0x61 && b[j - 4] === 0x73
      && b[j - 5] === 0x75 && b[j - 6] === 0x22) return true;
  }
  return false;
}

async function pumpStripping(body, writable, done, estimate, cap) {
  const reader = body.getReader();
  const writer = writable.getWriter();
  const dec = new TextDecoder();
  const enc = new TextEncoder();
  let usage = null;
  let carry = ""; // the start of an event whose end has not arrived yet
  // The last bytes passed on, for an estimate: kept as the upstream's chunks and decoded
  // once, at the end, so the common chunk is never decoded.
  const tail = [];
  let tailBytes = 0;
  let total = 0; // bytes passed on
  let read = 0; // bytes read from the upstream
  const keep = (bytes) => {
    tail.push(bytes);
    tailBytes += bytes.byteLength;
    total += bytes.byteLength;
    while (tailBytes - tail[0].byteLength >= TAIL_BYTES) tailBytes -= tail.shift().byteLength;
  };
  // Whole events in `text`, without the usage event.
  const events = (text) => {
    let kept = "";
    for (const ev of text.split(/(?<=\n\r?\n)/)) {
      if (USAGE_OBJECT.test(ev)) {
        let obj = null;
        try {
          obj = JSON.parse(ev.slice(ev.indexOf("data:") + 5));
        } catch {
          // not one JSON event: pass it on as it came
        }
        const u = obj && fromUsage(obj.usage);
        if (u) usage = u;
        if (u && Array.isArray(obj.choices) && obj.choices.length === 0) continue;
      }
      kept += ev;
    }
    if (!kept) return null;
    const out = enc.encode(kept);
    keep(out);
    return out;
  };
  // One write in flight while the next chunk is read: the client's side keeps moving
  // without a turn of waiting per chunk, and a client that stops reading stops the pump
  // one chunk later (backpressure).
  let writing = null;
  const send = async (out) => {
    if (writing) await writing;
    writing = writer.write(out);
    writing.catch(() => {}); // a failed write is seen where it is awaited
  };
  try {
    for (;;) {
      const { done: end, value } = await reader.read();
      if (end) break;
      read += value.byteLength;
      if (read > cap) {
        // Past what the request can produce: the rest is never read, the client is told.
        await reader.cancel(new Error("stream_too_large")).catch(() => {});
        carry = "";
        await send(streamCut(cap));
        break;
      }
      let out;
      // The common chunk: whole events, no usage object: the same bytes, never decoded (a
      // chunk that ends an event leaves the decoder with nothing pending).
      if (carry === "" && endsEvent(value) && !hasUsageObject(value)) {
        keep(value);
        out = value;
      } else {
        const all = carry + dec.decode(value, { stream: true });
        const at = lastEventEnd(all);
        carry = all.slice(at);
        out = at > 0 ? events(all.slice(0, at)) : null;
      }
      if (out) await send(out);
    }
    const rest = carry + dec.decode();
    const out = rest ? events(rest) : null;
    if (out) await send(out);
    if (writing) await writing;
    await writer.close();
  } catch (err) {
    // The client went away (the write failed) or the upstream's stream broke: stop both
    // sides, so the upstream is not left generating for nobody; what was sent is counted.
    await reader.cancel(err).catch(() => {});
    await writer.abort(err).catch(() => {});
  }
  if (usage) return done(usage);
  const bytes = new Uint8Array(tailBytes);
  let at = 0;
  for (const c of tail) {
    bytes.set(c, at);
    at += c.byteLength;
  }
  const text = dec.decode(bytes);
  return done(estimate(Math.round(contentChars(text) * (total / Math.max(1, tailBytes)))));
}

/** Settles when `promise` does or after `ms`, whichever comes first; the timer is cleared. */
async function firstOf(promise, ms) {
  let timer;
  try {
    await Promise.race([promise, new Promise((resolve) => { timer = setTimeout(resolve, ms); })]);
  } finally {
    clearTimeout(timer);
  }
}
