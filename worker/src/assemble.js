// @ts-check
// A non-streamed answer assembled from the pod's stream, as the pod would have written it.
//
// The router asks a pod for every answer as a stream (docs/worker.md, "Routing"), so it
// sees the first token and the pace of the rest, and judges the pod by those, never by
// the whole answer's length. A client that did not ask for a stream gets the JSON answer
// vLLM writes for a non-streamed request, rebuilt field by field from the chunks, with
// LiteLLM's `stream_chunk_builder` (litellm/litellm_core_utils/streaming_chunk_builder_utils.py)
// as the checklist: id, created, model and the other top-level fields from the first
// chunk; per choice (by `index`, so n > 1 works) the role, the content, `reasoning_content`,
// tool calls assembled by their own `index` (id, type, function name once, arguments
// concatenated), logprobs concatenated, the last `finish_reason` and `stop_reason`; the
// usage event's `usage`. Legacy completions (`/v1/completions`) concatenate `text` and the
// logprobs' `tokens`, `token_logprobs`, `top_logprobs` and `text_offset` (vLLM streams
// absolute offsets, so joining them is the whole answer's list). The shape is vLLM 0.10's
// (ChatCompletionResponse, CompletionResponse in vllm/entrypoints/openai/protocol.py):
// `reasoning_content` and `tool_calls` always in the message, `stop_reason` always in a
// choice, `prompt_logprobs` and `kv_transfer_params` null.
//
// Cost: the stream's data payloads are parsed in ONE JSON.parse, as the elements of an
// array ("[" + payloads joined by "," + "]"); only a stream with a malformed event falls
// back to one parse per event (the bad one skipped). The answer is then one JSON.stringify.

const decoder = new TextDecoder();

/**
 * The data payloads of an SSE text (the JSON after `data:` of each event), `[DONE]` left out.
 * @param {string} text
 * @returns {string[]}
 */
export function ssePayloads(text) {
  const out = [];
  let at = 0;
  const n = text.length;
  while (at < n) {
    let end = text.indexOf("\n", at);
    if (end < 0) end = n;
    // "data:" lines only; comments (":"), "event:", "id:", blank lines are skipped.
    if (text.startsWith("data:", at)) {
      let from = at + 5;
      if (text.charCodeAt(from) === 32) from++;
      let to = end;
      if (to > from && text.charCodeAt(to - 1) === 13) to--;
      const p = text.slice(from, to);
      if (p !== "[DONE]" && p !== "") out.push(p);
    }
    at = end + 1;
  }
  return out;
}

/**
 * The stream's events as parsed objects: one parse for all of them, or (a malformed event
 * among them) one per event, skipping what does not parse or is not an object.
 * @param {string[]} payloads
 * @returns {any[]}
 */
export function parseEvents(payloads) {
  if (payloads.length === 0) return [];
  try {
    const all = JSON.parse("[" + payloads.join(",") + "]");
    if (all.length === payloads.length && all.every((e) => e !== null && typeof e === "object" && !Array.isArray(e))) return all;
  } catch {
    // one of them is not JSON: parse them one by one below
  }
  const out = [];
  for (const p of payloads) {
    try {
      const e = JSON.parse(p);
      if (e !== null && typeof e === "object" && !Array.isArray(e)) out.push(e);
    } catch {
      // a broken event carries nothing the answer can use
    }
  }
  return out;
}

// Top-level fields of a chunk that are the chunk's own, not the answer's.
const CHUNK_ONLY = new Set(["object", "choices", "usage"]);

/**
 * The answer the pod would have written for the same request without `stream`, from the
 * stream's parsed events; `chat`: /v1/chat/completions (else /v1/completions).
 * An `error` event (vLLM ends a failed stream with one) is returned as `{error}`.
 * @param {any[]} events
 * @param {boolean} chat
 * @returns {{answer: any, error: any}}
 */
export function assemble(events, chat) {
  /** @type {Record<string, any>} */
  const top = {};
  let topSeen = false;
  let usage;
  /** @type {Map<number, any>} */
  const choices = new Map();
  for (const ev of events) {
    if (ev.error !== undefined || ev.object === "error") return { answer: null, error: ev.error ?? ev };
    if (!topSeen && typeof ev.id === "string") {
      for (const k in ev) if (!CHUNK_ONLY.has(k)) top[k] = ev[k];
      topSeen = true;
    }
    if (ev.usage && typeof ev.usage === "object") usage = ev.usage;
    const list = Array.isArray(ev.choices) ? ev.choices : null;
    if (list === null) continue;
    for (const c of list) {
      if (c === null || typeof c !== "object") continue;
      const index = Number.isInteger(c.index) ? c.index : 0;
      let acc = choices.get(index);
      if (acc === undefined) {
        acc = { index, role: null, content: [], reasoning: null, tools: new Map(), logprobs: null, finish: null, stop: undefined,
          text: [] };
        choices.set(index, acc);
      }
      if (c.finish_reason != null) acc.finish = c.finish_reason;
      if (c.stop_reason != null) acc.stop = c.stop_reason;
      if (chat) addDelta(acc, c.delta);
      else if (typeof c.text === "string") acc.text.push(c.text);
      if (c.logprobs != null) addLogprobs(acc, c.logprobs, chat);
    }
  }
  const out = [...choices.values()].sort((a, b) => a.index - b.index).map((acc) => (chat ? chatChoice(acc) : textChoice(acc)));
  /** @type {Record<string, any>} */
  const answer = { ...top, object: chat ? "chat.completion" : "text_completion" };
  // The order vLLM writes: id, object, created, model, choices, ..., usage.
  const ordered = { id: answer.id, object: answer.object, created: answer.created, model: answer.model, choices: out };
  for (const k in answer) if (!(k in ordered)) ordered[k] = answer[k];
  if (usage !== undefined) ordered.usage = usage.prompt_tokens_details === undefined ? { ...usage, prompt_tokens_details: null } : usage;
  // What vLLM writes in a non-streamed answer and a stream cannot carry: null when not asked
  // (a request that asks prompt_logprobs is not streamed, forward.js `streamable`).
  if (chat) ordered.prompt_logprobs = null;
  ordered.kv_transfer_params = null;
  return { answer: ordered, error: null };
}

function addDelta(acc, d) {
  if (d === null || typeof d !== "object") return;
  if (typeof d.role === "string") acc.role = d.role;
  if (typeof d.content === "string") acc.content.push(d.content);
  if (typeof d.reasoning_content === "string") (acc.reasoning ??= []).push(d.reasoning_content);
  if (Array.isArray(d.tool_calls)) {
    for (const t of d.tool_calls) {
      if (t === null || typeof t !== "object") continue;
      const i = Number.isInteger(t.index) ? t.index : acc.tools.size;
      let call = acc.tools.get(i);
      if (call === undefined) {
        call = { id: null, type: "function", name: null, args: [] };
        acc.tools.set(i, call);
      }
      if (typeof t.id === "string") call.id = t.id;
      if (typeof t.type === "string") call.type = t.type;
      const f = t.function;
      if (f && typeof f === "object") {
        if (typeof f.name === "string") call.name = call.name === null ? f.name : call.name + f.name;
        if (typeof f.arguments === "string") call.args.push(f.arguments);
      }
    }
  }
}

function addLogprobs(acc, lp, chat) {
  if (chat) {
    const content = Array.isArray(lp.content) ? lp.content : [];
    if (acc.logprobs === null) acc.logprobs = { content: [] };
    for (const x of content) acc.logprobs.content.push(x);
    return;
  }
  if (acc.logprobs === null) acc.logprobs = { text_offset: [], token_logprobs: [], tokens: [], top_logprobs: [] };
  for (const k of ["text_offset", "token_logprobs", "tokens", "top_logprobs"]) {
    const v = lp[k];
    if (Array.isArray(v)) for (const x of v) acc.logprobs[k].push(x);
  }
}

function chatChoice(acc) {
  const tools = [...acc.tools.entries()].sort((a, b) => a[0] - b[0])
    .map(([, t]) => ({ id: t.id, type: t.type, function: { name: t.name, arguments: t.args.join("") } }));
  const text = acc.content.join("");
  // vLLM's message: content null when the answer is only tool calls; tool_calls [] when none.
  const message = { role: acc.role ?? "assistant", reasoning_content: acc.reasoning === null ? null : acc.reasoning.join(""),
    content: text === "" && tools.length ? null : text, tool_calls: tools };
  return { index: acc.index, message, logprobs: acc.logprobs, finish_reason: acc.finish, stop_reason: acc.stop ?? null };
}

function textChoice(acc) {
  return { index: acc.index, text: acc.text.join(""), logprobs: acc.logprobs, finish_reason: acc.finish, stop_reason: acc.stop ?? null,
    prompt_logprobs: null };
}

/**
 * The JSON answer's bytes from a whole stream's bytes, or `{error}` when the stream ended
 * with an error event; `chat` as in `assemble`.
 * @param {Uint8Array} bytes
 * @param {boolean} chat
 * @returns {{bytes: Uint8Array | null, answer: any, error: any}}
 */
export function assembleBytes(bytes, chat) {
  const { answer, error } = assemble(parseEvents(ssePayloads(decoder.decode(bytes))), chat);
  if (error) return { bytes: null, answer: null, error };
  return { bytes: encoder.encode(JSON.stringify(answer)), answer, error: null };
}

const encoder = new TextEncoder();
