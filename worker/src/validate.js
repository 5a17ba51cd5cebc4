// @ts-check
// Routed request bodies checked against the OpenAI request shapes the pods (vLLM) serve:
// what a pod would refuse, or could not survive, is answered here with a 400 naming the
// field (`param`), the value and the fix, and never reaches a pod.
//
// Hand-written rather than a JSON Schema validator: @cfworker/json-schema (the one built
// for Workers, no eval) costs about 55 KB of modules and 38 times the CPU per request for
// the same rules (docs/worker.md, "Bad requests stop at the edge"), and it would not
// refuse what matters most here anyway: nesting depth, and non-finite numbers in fields a
// schema does not name, which one iterative walk checks below.
//
// Fields the shapes do not name pass (vLLM takes extra sampling parameters), but every
// value in the body is within MAX_DEPTH and finite.

import { HttpError } from "./errors.js";

export const MAX_DEPTH = 64; // containers nested in one field (tool schemas need a few dozen at most)
export const MAX_TOKENS = 131072; // a sane cap on max_tokens: beyond any context the pods serve
export const MAX_N = 16; // choices per request: each is a full generation on the pod
const MAX_MESSAGES = 4096;
const MAX_STOP = 4; // OpenAI's limit
const MAX_LOGIT_BIAS = 300; // OpenAI's limit
const MAX_TOOLS = 128; // OpenAI's limit
const ROLES = new Set(["system", "developer", "user", "assistant", "tool", "function"]);

/** A 400 in OpenAI's shape for one field. */
function bad(param, code, message) {
  return new HttpError(400, code, message, {}, undefined, param);
}

function shown(v) {
  if (typeof v === "number") return String(v); // JSON.stringify(Infinity) is "null"
  let s;
  try {
    s = JSON.stringify(v);
  } catch {
    s = typeof v;
  }
  return s.length > 40 ? s.slice(0, 37) + "..." : s;
}

// --- one rule per kind of value: (value) => true when acceptable ---
const isInt = (lo, hi) => (v) => Number.isInteger(v) && v >= lo && v <= hi;
const isNum = (lo, hi) => (v) => typeof v === "number" && v >= lo && v <= hi;
const isBool = (v) => typeof v === "boolean";
const isStr = (max) => (v) => typeof v === "string" && v.length <= max;
const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isStop = (v) => typeof v === "string"
  || (Array.isArray(v) && v.length <= MAX_STOP && v.every((s) => typeof s === "string"));

// field -> [rule, what it must be]; null is accepted for every optional field (OpenAI's
// SDKs and vLLM treat it as absent).
const COMMON = {
  model: [isStr(256), "a string (the model's name)"],
  stream: [isBool, "true or false"],
  stream_options: [isObj, 'an object such as {"include_usage": true}'],
  max_tokens: [isInt(1, MAX_TOKENS), `an integer from 1 to ${MAX_TOKENS}`],
  n: [isInt(1, MAX_N), `an integer from 1 to ${MAX_N}`],
  temperature: [isNum(0, 2), "a number from 0 to 2"],
  top_p: [isNum(0, 1), "a number from 0 to 1"],
  presence_penalty: [isNum(-2, 2), "a number from -2 to 2"],
  frequency_penalty: [isNum(-2, 2), "a number from -2 to 2"],
  stop: [isStop, `a string or an array of at most ${MAX_STOP} strings`],
  seed: [isInt(Number.MIN_SAFE_INTEGER, Number.MAX_SAFE_INTEGER), "an integer"],
  logit_bias: [(v) => isObj(v) && Object.keys(v).length <= MAX_LOGIT_BIAS && Object.values(v).every(isNum(-100, 100)),
    `an object of at most ${MAX_LOGIT_BIAS} token ids, each mapped to a number from -100 to 100`],
  user: [isStr(256), "a string of at most 256 characters"],
  top_k: [isInt(-1, 1_000_000), "an integer, -1 (all) or more"],
  min_p: [isNum(0, 1), "a number from 0 to 1"],
  repetition_penalty: [isNum(Number.MIN_VALUE, 2), "a number above 0, at most 2"],
  response_format: [(v) => isObj(v) && typeof v.type === "string", 'an object with a "type", such as {"type": "json_object"}'],
};

const CHAT = {
  ...COMMON,
  max_completion_tokens: [isInt(1, MAX_TOKENS), `an integer from 1 to ${MAX_TOKENS}`],
  logprobs: [isBool, "true or false"],
  top_logprobs: [isInt(0, 20), "an integer from 0 to 20"],
  tools: [(v) => Array.isArray(v) && v.length <= MAX_TOOLS && v.every(isObj), `an array of at most ${MAX_TOOLS} tool objects`],
  tool_choice: [(v) => typeof v === "string" || isObj(v), 'a string ("auto", "none", "required") or an object'],
  parallel_tool_calls: [isBool, "true or false"],
};

const COMPLETIONS = {
  ...COMMON,
  logprobs: [isInt(0, 20), "an integer from 0 to 20"],
  best_of: [isInt(1, MAX_N), `an integer from 1 to ${MAX_N}`],
  echo: [isBool, "true or false"],
  suffix: [(v) => typeof v === "string", "a string"],
};

export const MAX_PROMPTS = 64; // prompts in one /v1/completions list: each is n generations on the pod
// A token of the pods' tokenizers spells at most this many characters (the longest are runs
// of blanks or punctuation): a prompt longer than context x this cannot fit whatever it says.
export const MAX_CHARS_PER_TOKEN = 16;
export const MAX_SCHEMA_CHARS = 32_768; // a guided-decoding schema (or grammar) the pod compiles, as JSON
// vLLM's guided-decoding fields (and OpenAI's response_format json_schema): the pod compiles each into a grammar.
const GUIDED = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"];

/**
 * Refuse a body that is not a chat completion (`/v1/chat/completions`) or a completion
 * request: throws HttpError 400 with `param`. `json` is a parsed JSON object;
 * `maxModelLen` the context the pods serve (MAX_MODEL_LEN): what could never fit in it is
 * refused here, as the pod would refuse it after tokenising it (docs/worker.md, "What a
 * request may cost").
 */
export function validateBody(pathname, json, maxModelLen = MAX_TOKENS + 1) {
  // Depth and finiteness first: the rules below may print a value, and must not walk a deep one.
  for (const k in json) walk(json[k], k);
  const chat = pathname === "/v1/chat/completions";
  const rules = chat ? CHAT : COMPLETIONS;
  if (json.model === undefined || json.model === null) throw bad("model", "missing_field", 'model is required: send "model": "<name>" (GET /v1/models lists them)');
  for (const k in json) {
    const rule = rules[k];
    const v = json[k];
    if (rule === undefined || v === null) continue;
    if (!rule[0](v)) throw bad(k, "invalid_value", `${k} must be ${rule[1]} (got ${shown(v)})`);
  }
  if (json.stream_options != null && json.stream !== true) {
    throw bad("stream_options", "invalid_value",
      `stream_options is only allowed with "stream": true (got "stream": ${shown(json.stream ?? null)}): remove it, or stream`);
  }
  const so = json.stream_options;
  if (so != null) {
    for (const k of ["include_usage", "continuous_usage_stats"]) {
      if (so[k] != null && typeof so[k] !== "boolean") throw bad(`stream_options.${k}`, "invalid_value", `stream_options.${k} must be true or false (got ${shown(so[k])})`);
    }
  }
  if (chat) checkMessages(json.messages);
  else checkPrompt(json.prompt);
  checkCost(json, chat, maxModelLen);
}

/**
 * What the pod would refuse once it had done the work (a prompt that cannot fit its
 * context, a limit the endpoint ignores, work no counted token pays for), refused first.
 */
function checkCost(json, chat, maxModelLen) {
  if (!chat && json.max_completion_tokens != null) {
    throw bad("max_completion_tokens", "unsupported_parameter",
      "max_completion_tokens is not read by /v1/completions (vLLM ignores it there, and would generate up to max_tokens): "
      + "send max_tokens instead");
  }
  if (!chat && Array.isArray(json.prompt) && (typeof json.prompt[0] === "string" || Array.isArray(json.prompt[0]))
      && json.prompt.length > MAX_PROMPTS) {
    throw bad("prompt", "invalid_value",
      `prompt lists at most ${MAX_PROMPTS} prompts (got ${json.prompt.length}): send the rest in further requests`);
  }
  // vLLM refuses a limit past the context, and a prompt that fills it; anything else it
  // clamps to what fits beside the prompt and answers (vllm/renderers/params.py,
  // entrypoints/serve/utils/api_utils.py get_max_tokens, v0.32). The edge refuses exactly those.
  const limit = chat ? (json.max_completion_tokens != null ? "max_completion_tokens" : "max_tokens") : "max_tokens";
  const max = json[limit] ?? 0;
  if (max > maxModelLen) {
    throw bad(limit, "context_length_exceeded",
      `${limit} is ${max}, but the pods serve a context of ${maxModelLen} tokens, prompt included: send at most ${maxModelLen}`
      + " (a smaller one is cut to what fits beside the prompt)");
  }
  // The fewest tokens the longest prompt can be: its characters / MAX_CHARS_PER_TOKEN.
  const least = leastPromptTokens(json, chat);
  if (least >= maxModelLen) {
    const what = chat ? "messages" : "prompt";
    throw bad(what, "context_length_exceeded",
      `${what} is at least ${least} tokens, which fills the pods' context of ${maxModelLen} tokens with no room for an answer: shorten it`);
  }
  if (json.prompt_logprobs != null) {
    throw bad("prompt_logprobs", "unsupported_parameter",
      "prompt_logprobs is not served here (a logprob for every prompt token is work no counted token pays for): remove it");
  }
  if (!chat && json.echo === true && json.logprobs != null) {
    throw bad("logprobs", "unsupported_parameter",
      "logprobs with echo asks for a logprob of every prompt token, which is not served here: remove one of them");
  }
  const rf = json.response_format;
  const schemas = rf && rf.type === "json_schema" ? [["response_format", rf.json_schema]] : [];
  for (const k of GUIDED) if (json[k] != null) schemas.push([k, json[k]]);
  for (const [k, v] of schemas) {
    const size = typeof v === "string" ? v.length : JSON.stringify(v ?? null).length;
    if (size > MAX_SCHEMA_CHARS) {
      throw bad(k, "invalid_value", `${k} is ${size} characters of JSON; the pods compile at most ${MAX_SCHEMA_CHARS}: send a smaller schema`);
    }
  }
}

/** The fewest tokens the request's longest prompt can be (at most MAX_CHARS_PER_TOKEN characters a token). */
function leastPromptTokens(json, chat) {
  return Math.ceil(longestPrompt(json, chat) / MAX_CHARS_PER_TOKEN);
}

/**
 * The fewest tokens the request's shortest prompt can be (a chat has one): 0 when the
 * body is not a chat or completion request validateBody accepts.
 */
export function shortestPromptTokens(json, chat) {
  if (chat) return Array.isArray(json.messages) ? leastPromptTokens(json, true) : 0;
  const p = json.prompt;
  if (typeof p === "string") return Math.ceil(p.length / MAX_CHARS_PER_TOKEN);
  if (!Array.isArray(p) || p.length === 0) return 0;
  if (isTokens(p)) return p.length; // token ids: one token each
  let n = Infinity;
  for (const one of p) n = Math.min(n, typeof one === "string" ? Math.ceil(one.length / MAX_CHARS_PER_TOKEN) : Array.isArray(one) ? one.length : 0);
  return n;
}

/** Characters of the request's longest prompt: a chat's message texts together, or the longest of a prompt list. */
function longestPrompt(json, chat) {
  if (chat) {
    let n = 0;
    for (const m of json.messages) {
      const c = m !== null && typeof m === "object" ? m.content : undefined;
      if (typeof c === "string") n += c.length;
      else if (Array.isArray(c)) for (const part of c) if (typeof part.text === "string") n += part.text.length;
    }
    return n;
  }
  const p = json.prompt;
  if (typeof p === "string") return p.length;
  let n = 0;
  // token ids: one token each, so a list counts MAX_CHARS_PER_TOKEN "characters" an id
  if (isTokens(p)) return p.length * MAX_CHARS_PER_TOKEN;
  for (const one of p) n = Math.max(n, typeof one === "string" ? one.length : one.length * MAX_CHARS_PER_TOKEN);
  return n;
}

// The fields each endpoint sends to the fallback API (OpenAI's documented request fields the
// pods serve too); any other field is dropped, unless colocate:fallbackFields allows it
// (`store`, `metadata` and `service_tier` keep prompts in, or bill above, the owner's account).
const FALLBACK_FIELDS = {
  "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "presence_penalty",
    "frequency_penalty", "stop", "seed", "logit_bias", "logprobs", "top_logprobs", "user", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "stream", "stream_options"],
  "/v1/completions": ["model", "prompt", "max_tokens", "n", "best_of", "temperature", "top_p", "presence_penalty", "frequency_penalty",
    "stop", "seed", "logit_bias", "logprobs", "echo", "suffix", "user", "stream", "stream_options"],
};

/**
 * The body the fallback may see: `json` itself when every field is allowed for `pathname`
 * (or in `extra`, colocate:fallbackFields), else a copy without the others; `dropped`
 * names them (sorted).
 * @returns {{json: Record<string, unknown>, dropped: string[]}}
 */
export function fallbackFields(pathname, json, extra = []) {
  const allowed = FALLBACK_FIELDS[pathname];
  if (!allowed) return { json, dropped: [] };
  const dropped = [];
  for (const k in json) if (!allowed.includes(k) && !extra.includes(k)) dropped.push(k);
  if (dropped.length === 0) return { json, dropped };
  const out = {};
  for (const k in json) if (!dropped.includes(k)) out[k] = json[k];
  return { json: out, dropped: dropped.sort() };
}

function checkMessages(m) {
  if (m === undefined || m === null) throw bad("messages", "missing_field", 'messages is required: send "messages": [{"role": "user", "content": "..."}]');
  if (!Array.isArray(m) || m.length === 0 || m.length > MAX_MESSAGES) {
    throw bad("messages", "invalid_value", `messages must be an array of 1 to ${MAX_MESSAGES} messages (got ${Array.isArray(m) ? `${m.length} messages` : shown(m)})`);
  }
  for (let i = 0; i < m.length; i++) {
    const msg = m[i];
    const at = `messages[${i}]`;
    if (!isObj(msg)) throw bad(at, "invalid_value", `${at} must be an object with "role" and "content" (got ${shown(msg)})`);
    if (!ROLES.has(msg.role)) throw bad(`${at}.role`, "invalid_value", `${at}.role must be one of ${[...ROLES].join(", ")} (got ${shown(msg.role)})`);
    const c = msg.content;
    if (c === undefined || c === null || typeof c === "string") continue;
    if (!Array.isArray(c) || !c.every((p) => isObj(p) && typeof p.type === "string")) {
      throw bad(`${at}.content`, "invalid_value",
        `${at}.content must be a string or an array of parts such as {"type": "text", "text": "..."} (got ${shown(c)})`);
    }
  }
}

const isTokens = (a) => Array.isArray(a) && a.length > 0 && a.every((t) => Number.isInteger(t) && t >= 0);

function checkPrompt(p) {
  if (p === undefined || p === null) throw bad("prompt", "missing_field", 'prompt is required: send "prompt": "..."');
  if (typeof p === "string") return;
  if (Array.isArray(p) && p.length > 0
      && (p.every((s) => typeof s === "string") || isTokens(p) || p.every(isTokens))) return;
  throw bad("prompt", "invalid_value",
    `prompt must be a string, an array of strings, or token ids (an array of integers, or of such arrays) (got ${shown(p)})`);
}

/**
 * Every value of the body within MAX_DEPTH and every number finite (JSON.parse turns 1e309
 * into Infinity, which a pod's JSON decoder takes as inf). Iterative: a 10,000-deep array
 * costs one pass, not a stack overflow.
 */
function walk(root, param) {
  const stack = [root, 1];
  while (stack.length) {
    const depth = stack.pop();
    const v = stack.pop();
    if (typeof v === "number") {
      if (!Number.isFinite(v)) throw bad(param, "invalid_value", `${param} holds a number out of range (${v}): send finite numbers`);
      continue;
    }
    if (v === null || typeof v !== "object") continue;
    if (depth > MAX_DEPTH) throw bad(param, "too_deep", `${param} nests more than ${MAX_DEPTH} levels of arrays and objects: flatten it`);
    if (Array.isArray(v)) for (let i = 0; i < v.length; i++) stack.push(v[i], depth + 1);
    else for (const k in v) stack.push(v[k], depth + 1);
  }
}
