// @ts-check
// What a pod is sent of a client's body: an allowlist of request fields and of chat
// content parts, as validate.js `fallbackFields` is the fallback's. vLLM accepts many
// fields a gateway must not pass from its clients (chat templates, grammars, engine
// request ids and priorities, media fetched by the server, `prompt_embeds`, a torch
// deserialisation: CVE-2025-62164; docs/worker.md, "What the pods are sent").
//
// Three kinds of field, decided here once:
// - served: OpenAI's request fields the pods serve, and the vLLM sampling extras the kit
//   documents (each bounded by validate.js, each costing no more than the request's ceiling);
// - OpenAI's own fields the pods do not serve (`store`, `metadata`, `service_tier`, ...):
//   dropped and logged, so a client written for OpenAI keeps working (the SDK sends only
//   what its caller sets, but frameworks set these);
// - anything else: 400 `unsupported_parameter` naming the field. OpenAI answers an unknown
//   field with a 400 too, so a client meets this only by asking for engine behaviour on
//   purpose (the SDK's `extra_body`), and gets told rather than a different answer.

import { HttpError } from "./errors.js";

// OpenAI's fields of each endpoint that the pods serve (the fallback's allowlist, validate.js).
const OPENAI_COMMON = ["model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "presence_penalty",
  "frequency_penalty", "stop", "seed", "logit_bias", "logprobs", "user"];
// vLLM's sampling extras the kit documents (docs/worker.md): numbers validate.js bounds,
// each within the request's ceiling (`min_tokens` and `ignore_eos` make at most max_tokens).
// `cache_salt` is the router's own: replaced by the key's (forward.js upstreamBody).
const VLLM_EXTRAS = ["top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "cache_salt"];
const SERVED = {
  "/v1/chat/completions": new Set([...OPENAI_COMMON, ...VLLM_EXTRAS, "messages", "max_completion_tokens", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls"]),
  "/v1/completions": new Set([...OPENAI_COMMON, ...VLLM_EXTRAS, "prompt", "best_of", "echo", "suffix"]),
};
// OpenAI's chat fields that no pod serves (openai-python 3.57.0, chat.completions.create's body).
const OPENAI_ONLY = new Set(["store", "metadata", "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
  "web_search_options", "functions", "function_call", "moderation", "prompt_cache_key", "prompt_cache_options",
  "prompt_cache_retention", "safety_identifier", "verbosity"]);

// Content parts: their keys, and the URL the part carries (fetched by the pod). `text` and
// `refusal` (an assistant's, as the SDK sends history back) always; the media types only when
// the operator lists them (colocate:worker.contentParts). Never `*_embeds`, `image_pil` or
// `prompt_embeds` parts (torch or pickle payloads), nor a part's `uuid` (with one, vLLM reads
// any media key of the part whatever its type).
export const MEDIA_PARTS = ["image_url", "input_audio", "audio_url", "video_url"];
const PART_KEYS = {
  text: ["text", null],
  refusal: ["refusal", null],
  image_url: ["image_url", "url"],
  input_audio: ["input_audio", null],
  audio_url: ["audio_url", "url"],
  video_url: ["video_url", "url"],
};

function refuse(param, message) {
  return new HttpError(400, "unsupported_parameter", message, {}, undefined, param);
}

/**
 * The body a pod may be sent of `json` (validated by validate.js) at `pathname`: `json`
 * itself when every field is served, else a copy without OpenAI's own fields (`dropped`
 * names them); throws 400 naming a field or content part the pods are never sent. `media`:
 * the content part types beyond text the operator allows (a Set, colocate:worker.contentParts).
 * @returns {{json: Record<string, any>, dropped: string[]}}
 */
export function podFields(pathname, json, media) {
  const served = SERVED[pathname];
  let dropped = null;
  for (const k in json) {
    if (served.has(k)) continue;
    if (!OPENAI_ONLY.has(k)) {
      throw refuse(k, `${k} is not sent to the pods: they are asked only OpenAI's request fields and top_k, min_p, `
        + "repetition_penalty, min_tokens and ignore_eos (vLLM's engine fields, such as chat_template, guided_regex or "
        + "prompt_embeds, are not served here): remove it");
    }
    (dropped ??= []).push(k);
  }
  if (pathname === "/v1/chat/completions") checkParts(json.messages, media);
  if (dropped === null) return { json, dropped: [] };
  const out = {};
  for (const k in json) if (!OPENAI_ONLY.has(k)) out[k] = json[k];
  return { json: out, dropped: dropped.sort() };
}

/** Every content part of `messages`: a type the cell serves, its own keys only, a URL the pod may fetch. */
function checkParts(messages, media) {
  for (let i = 0; i < messages.length; i++) {
    const c = messages[i].content;
    if (!Array.isArray(c)) continue;
    for (let j = 0; j < c.length; j++) {
      const part = c[j];
      const at = `messages[${i}].content[${j}]`;
      const spec = typeof part.type === "string" && Object.hasOwn(PART_KEYS, part.type) ? PART_KEYS[part.type] : undefined;
      if (spec === undefined || (MEDIA_PARTS.includes(part.type) && !media.has(part.type))) {
        const allowed = ["text", "refusal", ...media].join(", ");
        throw refuse(`${at}.type`, `${at}.type ${JSON.stringify(String(part.type).slice(0, 40))} is not served here: `
          + `send content parts of type ${allowed}`
          + (MEDIA_PARTS.includes(part.type) ? ` (the operator allows ${part.type} with colocate:worker.contentParts)` : ""));
      }
      const [field, urlKey] = spec;
      for (const k in part) {
        if (k !== "type" && k !== field) throw refuse(`${at}.${k}`, `${at} of type ${part.type} takes only "type" and "${field}": remove "${k}"`);
      }
      const value = part[field];
      if (part.type === "text" || part.type === "refusal") {
        if (typeof value !== "string") throw refuse(`${at}.${field}`, `${at}.${field} must be a string`);
      } else if (value === null || typeof value !== "object" || Array.isArray(value)) {
        throw refuse(`${at}.${field}`, `${at}.${field} must be an object`);
      } else if (urlKey !== null && !fetchable(value[urlKey])) {
        throw refuse(`${at}.${field}.url`, `${at}.${field}.url must be a data: URL, or an https:// URL whose host is a `
          + "name (not an address, not localhost): the pod fetches it");
      }
    }
  }
}

/** A media URL a pod may fetch: data:, or https:// to a host name (no IP literal, no localhost). */
function fetchable(url) {
  if (typeof url !== "string") return false;
  if (url.startsWith("data:")) return true;
  let u;
  try {
    u = new URL(url);
  } catch {
    return false;
  }
  const host = u.hostname.toLowerCase();
  if (u.protocol !== "https:" || u.username || u.password || host === "" || host.startsWith("[")) return false;
  if (host === "localhost" || host.endsWith(".localhost") || !host.includes(".")) return false;
  return !/^[0-9.]+$/.test(host) && !/^0x/i.test(host); // dotted, decimal or hex IPv4 forms
}
