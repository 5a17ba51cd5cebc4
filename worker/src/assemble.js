// @ts-check
// A non-streamed answer assembled from the pod's stream, as the pod would have written it.
//
// The router asks a pod for every answer as a stream (docs/worker.md, "Routing"), so it
// sees the first token and the pace of the rest, and judges the pod by those, never by
// the whole answer's length. A client that did not ask for a stream gets the JSON answer
// vLLM writes for a non-streamed request, rebuilt field by field from the chunks, with
// LiteLLM's `stream_chunk_builder` (litellm/litellm_core_utils/streaming_chunk_builder_utils.py)
// as the checklist: id, created and model from the first chunk; per choice (by `index`, so
// n > 1 works) the role, the content, the reasoning (`delta.reasoning`, or
// `reasoning_content` as older vLLMs spell it), tool calls assembled by their own `index`
// (id, type, function name once, arguments concatenated), logprobs and token ids
// concatenated, the last `finish_reason` and `stop_reason`; the usage event's `usage`,
// `system_fingerprint` and `metrics`. Legacy completions (`/v1/completions`) concatenate
// `text` and the logprobs' `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`
// (vLLM streams absolute offsets, so joining them is the whole answer's list). The shape,
// keys, order and nulls, is vLLM 0.32's (ChatCompletionResponse, CompletionResponse), which
// tests/engine_contract checks against a live vLLM for the same request.
//
// Cost: the events that differ from a template event only in their content string are
// not parsed (parseStream); the rest are parsed in ONE JSON.parse, as the elements of an
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

// The common stream (vLLM's, one choice, no tools or logprobs) is mostly events that
// differ only in their content string. parseStream parses one of them as a template and
// each other event of the same bytes around a string without quotes, escapes or control
// characters is kept as that string alone: the same event, not parsed again.
const CLEAN = /["\\\x00-\x1f]/;

/**
 * The stream's events for `assemble`, as `parseEvents` gives them, except that an event
 * whose bytes are the template's around another plain content string is that string (the
 * template, its content replaced): `{events, template}`, template null when none was used.
 * The template is the middle event's bytes split at its only `"content":"` (`"text":"`
 * for legacy completions), used only when parsing it with "\u0000" at the split shows
 * that the split is the choice's content and the event carries nothing else: one choice,
 * no role, finish, logprobs, token ids, tool calls or usage. Whatever is not plain is parsed as
 * parseEvents does, in one JSON.parse with the template's probe.
 * @param {string[]} payloads
 * @param {boolean} chat
 * @returns {{events: any[], template: any}}
 */
export function parseStream(payloads, chat) {
  const n = payloads.length;
  if (n < 4) return { events: parseEvents(payloads), template: null };
  const key = chat ? '"content":"' : '"text":"';
  // A pod's events carry their usage so far (continuous usage, podstream.js), which changes
  // with every event: the template is compared without it (`usageAt`); the answer's usage is
  // the last usage event's, parsed with the rest.
  let mid = payloads[n >> 1];
  const cut = usageAt(mid);
  if (cut >= 0) mid = mid.slice(0, cut) + "}";
  const at = mid.indexOf(key);
  // No backslash anywhere: every quote is a string's edge, so the one `"content":"` is a key.
  if (at < 0 || mid.indexOf(key, at + 1) >= 0 || mid.indexOf("\\") >= 0) return { events: parseEvents(payloads), template: null };
  const from = at + key.length;
  const pre = mid.slice(0, from);
  const post = mid.slice(mid.indexOf('"', from));
  const body = post.slice(0, -1); // without the event's closing brace
  const a = pre.length;
  /** @type {any[]} */
  const events = new Array(n);
  const rest = []; // positions of the events parsed
  // The last event with a usage object is parsed, whatever its shape: its usage is the answer's.
  let last = n;
  if (cut >= 0) for (last = n - 1; last > 0 && payloads[last].indexOf('"usage":{') < 0; last--);
  for (let i = 0; i < n; i++) {
    const p = payloads[i];
    if (i === last) {
      rest.push(i);
      continue;
    }
    const u = cut >= 0 ? usageAt(p) : -1;
    const b = u >= 0 ? u - body.length : p.length - post.length;
    // slice and ===, not startsWith/endsWith: ten times fewer instructions on sliced strings
    if (b >= a && p.slice(0, a) === pre && (u >= 0 ? p.slice(b, u) === body : p.slice(b) === post)) {
      const s = p.slice(a, b);
      if (!CLEAN.test(s)) {
        events[i] = s;
        continue;
      }
    }
    rest.push(i);
  }
  if (rest.length === n) return { events: parseEvents(payloads), template: null };
  // The probe: the template with "\u0000" at the split. The middle event has no escape,
  // so no content of its own can read "\u0000": a choice whose content does is the split's.
  const parsed = parseEvents([...rest.map((i) => payloads[i]), pre + "\\u0000" + post]);
  const template = parsed.length === rest.length + 1 ? parsed[rest.length] : null;
  if (template === null || !plain(template, chat) || text(template, chat) !== "\u0000") return { events: parseEvents(payloads), template: null };
  for (let k = 0; k < rest.length; k++) events[rest[k]] = parsed[k];
  return { events, template };
}

/**
 * Where an event's trailing usage object begins (its `,"usage":{`), when it is the event's last
 * field and holds no object (vLLM's continuous usage); else -1.
 * @param {string} p
 */
function usageAt(p) {
  const i = p.lastIndexOf(',"usage":{');
  return i >= 0 && p.indexOf("}", i) === p.length - 2 && p.charCodeAt(p.length - 1) === 125 ? i : -1;
}

/** Whether a parsed event is one choice's content and nothing else an answer takes from it. */
function plain(ev, chat) {
  if (ev.error !== undefined || ev.object === "error" || (ev.usage && typeof ev.usage === "object")) return false;
  const list = ev.choices;
  if (!Array.isArray(list) || list.length !== 1) return false;
  const c = list[0];
  if (c === null || typeof c !== "object" || c.finish_reason != null || c.stop_reason != null || c.logprobs != null
    || c.token_ids != null || c.prompt_token_ids != null) return false;
  if (!chat) return typeof c.text === "string";
  const d = c.delta;
  if (d === null || typeof d !== "object") return false;
  for (const k in d) if (k !== "content") return false;
  return typeof d.content === "string";
}

/** The one choice's content (chat) or text of a `plain` event. */
function text(ev, chat) {
  const c = ev.choices[0];
  return chat ? c.delta.content : c.text;
}

/**
 * The answer the pod would have written for the same request without `stream`, from the
 * stream's parsed events; `chat`: /v1/chat/completions (else /v1/completions); `request`:
 * the client's body (its `tool_choice` and `return_token_ids` shape the answer as they
 * shape vLLM's). An `error` event (vLLM ends a failed stream with one) is returned as
 * `{error}`. A string among `events` is `template` with that content (parseStream).
 * @param {any[]} events
 * @param {boolean} chat
 * @param {any} [template]
 * @param {any} [request]
 * @returns {{answer: any, error: any}}
 */
export function assemble(events, chat, template = null, request = null) {
  /** @type {any} */
  let first = null; // the first chunk: id, created, model, and (chat) prompt_token_ids, prompt_text
  let usage;
  let fingerprint = null;
  let metrics = null;
  /** @type {Map<number, any>} */
  const choices = new Map();
  const choice = (index) => {
    let acc = choices.get(index);
    if (acc === undefined) {
      acc = { index, role: null, content: [], said: false, reasoning: null, tools: null, logprobs: null, finish: null, stop: null,
        text: [], tokenIds: null, promptIds: null };
      choices.set(index, acc);
    }
    return acc;
  };
  for (const ev of events) {
    if (typeof ev === "string") {
      // The template's event with this content: one choice's text, nothing else (parseStream).
      if (first === null && typeof template.id === "string") first = template;
      const c = template.choices[0];
      const acc = choice(Number.isInteger(c.index) ? c.index : 0);
      if (chat) {
        acc.content.push(ev);
        acc.said = true;
      } else acc.text.push(ev);
      continue;
    }
    if (ev.error !== undefined || ev.object === "error") return { answer: null, error: ev.error ?? ev };
    if (first === null && typeof ev.id === "string") first = ev;
    if (ev.usage && typeof ev.usage === "object") usage = ev.usage;
    if (typeof ev.system_fingerprint === "string") fingerprint = ev.system_fingerprint;
    if (ev.metrics && typeof ev.metrics === "object") metrics = ev.metrics;
    const list = Array.isArray(ev.choices) ? ev.choices : null;
    if (list === null) continue;
    for (const c of list) {
      if (c === null || typeof c !== "object") continue;
      const acc = choice(Number.isInteger(c.index) ? c.index : 0);
      if (c.finish_reason != null) acc.finish = c.finish_reason;
      if (c.stop_reason != null) acc.stop = c.stop_reason;
      if (chat) addDelta(acc, c.delta);
      else if (typeof c.text === "string") acc.text.push(c.text);
      if (c.logprobs != null) addLogprobs(acc, c.logprobs, chat);
      if (Array.isArray(c.token_ids)) (acc.tokenIds ??= []).push(...c.token_ids);
      if (Array.isArray(c.prompt_token_ids) && acc.promptIds === null) acc.promptIds = c.prompt_token_ids;
    }
  }
  const accs = [...choices.values()];
  if (accs.length > 1) accs.sort((a, b) => a.index - b.index);
  const req = request !== null && typeof request === "object" ? request : {};
  const tc = req.tool_choice;
  // vLLM's message for a named or required tool choice has content "" where it made none.
  const forced = tc === "required" || (tc !== null && typeof tc === "object");
  const ids = req.return_token_ids === true;
  const out = accs.map((acc) => (chat ? chatChoice(acc, forced) : textChoice(acc, ids)));
  const head = first ?? {};
  // vLLM's non-streamed answer, in its order (vllm/entrypoints/openai/chat_completion/protocol.py
  // ChatCompletionResponse, completion/protocol.py CompletionResponse, v0.32): what a stream
  // cannot carry is null, as vLLM writes it when not asked.
  /** @type {Record<string, any>} */
  const answer = { id: head.id, object: chat ? "chat.completion" : "text_completion", created: head.created, model: head.model,
    choices: out, service_tier: null, system_fingerprint: fingerprint };
  if (usage !== undefined) answer.usage = usageInfo(usage);
  if (chat) {
    answer.prompt_logprobs = null; // a request that asks prompt_logprobs is not streamed (forward.js `streamable`)
    answer.prompt_token_ids = head.prompt_token_ids ?? null;
    answer.prompt_text = head.prompt_text ?? null;
  }
  answer.kv_transfer_params = null;
  answer.ec_transfer_params = null;
  answer.metrics = metrics;
  return { answer, error: null };
}

/** vLLM's UsageInfo as its non-streamed answer writes it (the stream's drops what is null). */
function usageInfo(u) {
  const p = u.prompt_tokens_details;
  const c = u.completion_tokens_details;
  return { prompt_tokens: u.prompt_tokens, total_tokens: u.total_tokens, completion_tokens: u.completion_tokens,
    prompt_tokens_details: p && typeof p === "object"
      ? { cached_tokens: p.cached_tokens ?? null, created_cache_tokens: p.created_cache_tokens ?? null, multimodal_tokens: p.multimodal_tokens ?? null }
      : null,
    completion_tokens_details: c && typeof c === "object" ? { reasoning_tokens: c.reasoning_tokens ?? 0 } : null };
}

function addDelta(acc, d) {
  if (d === null || typeof d !== "object") return;
  if (typeof d.role === "string") acc.role = d.role;
  // vLLM opens each choice with its role and content "", which says nothing: content is null
  // unless another event carries some (a reasoning or tool parser may send none).
  if (typeof d.content === "string") {
    acc.content.push(d.content);
    if (d.content !== "" || d.role === undefined) acc.said = true;
  }
  // vLLM 0.32 streams `reasoning`; older versions `reasoning_content`.
  const r = typeof d.reasoning === "string" ? d.reasoning : d.reasoning_content;
  if (typeof r === "string") (acc.reasoning ??= []).push(r);
  if (Array.isArray(d.tool_calls)) {
    for (const t of d.tool_calls) {
      if (t === null || typeof t !== "object") continue;
      acc.tools ??= new Map();
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

function chatChoice(acc, forced) {
  const text = acc.content.join("");
  // vLLM's ChatMessage: null for what it did not make; tool_calls only when there are some.
  /** @type {Record<string, any>} */
  const message = { role: acc.role ?? "assistant", content: acc.said ? text : forced ? "" : null, refusal: null, annotations: null,
    audio: null, function_call: null };
  if (acc.tools !== null) {
    message.tool_calls = [...acc.tools.entries()].sort((a, b) => a[0] - b[0])
      .map(([, t]) => ({ id: t.id, type: t.type, function: { name: t.name, arguments: t.args.join("") } }));
  }
  message.reasoning = acc.reasoning === null ? null : acc.reasoning.join("");
  return { index: acc.index, message, logprobs: acc.logprobs, finish_reason: acc.finish, stop_reason: acc.stop, token_ids: acc.tokenIds,
    routed_experts: null };
}

function textChoice(acc, ids) {
  return { index: acc.index, text: acc.text.join(""), logprobs: acc.logprobs, finish_reason: acc.finish, stop_reason: acc.stop,
    token_ids: acc.tokenIds, prompt_logprobs: null, prompt_token_ids: ids ? acc.promptIds : null, routed_experts: null };
}

/**
 * The JSON answer's bytes from a whole stream's bytes, or `{error}` when the stream ended
 * with an error event; `chat` and `request` as in `assemble`.
 * @param {Uint8Array} bytes
 * @param {boolean} chat
 * @param {any} [request]
 * @returns {{bytes: Uint8Array | null, answer: any, error: any}}
 */
export function assembleBytes(bytes, chat, request = null) {
  const { events, template } = parseStream(ssePayloads(decoder.decode(bytes)), chat);
  const { answer, error } = assemble(events, chat, template, request);
  if (error) return { bytes: null, answer: null, error };
  return { bytes: encoder.encode(JSON.stringify(answer)), answer, error: null };
}

const encoder = new TextEncoder();
