import { test } from "node:test";
import assert from "node:assert/strict";
import { podFields } from "../src/podfields.js";
import { validateBody } from "../src/validate.js";
import { HttpError } from "../src/errors.js";

const CHAT = "/v1/chat/completions";
const COMPLETIONS = "/v1/completions";
const ok = { model: "m", messages: [{ role: "user", content: "hi" }] };
const TEXT_ONLY = new Set();

/** The 400 a body gets from the pod's allowlist ({param, code}), or null when it passes. */
function refusal(path, body, media = TEXT_ONLY) {
  try {
    podFields(path, body, media);
  } catch (err) {
    assert.ok(err instanceof HttpError);
    assert.equal(err.status, 400);
    return { param: err.param, code: err.code, message: err.message };
  }
  return null;
}

// vLLM's request fields a client could once send the pod, each refused by name.
const ENGINE_FIELDS = {
  chat_template: "{{ 'x' }}", chat_template_kwargs: { enable_thinking: true }, mm_processor_kwargs: { fps: 1 },
  media_io_kwargs: { video: { num_frames: 1 } }, guided_regex: "a+", guided_grammar: "root ::= \"a\"",
  structured_outputs: { regex: "a+" }, guided_decoding_backend: "xgrammar", kv_transfer_params: { do_remote_decode: true },
  priority: -100, logits_processors: ["x.y"], vllm_xargs: { a: 1 }, request_id: "victim", allowed_token_ids: [1],
  bad_words: ["no"], truncate_prompt_tokens: 1, documents: [{ title: "t", text: "x" }], prompt_embeds: "UEsDBA==",
};

test("the fields the pods serve pass as they came: OpenAI's and the documented vLLM extras", () => {
  const chat = { ...ok, stream: true, stream_options: { include_usage: true }, max_tokens: 16, max_completion_tokens: 16, n: 2,
    temperature: 0, top_p: 1, presence_penalty: 0, frequency_penalty: 0, stop: ["\n"], seed: 7, logit_bias: { 5: 1 },
    logprobs: true, top_logprobs: 2, user: "u", response_format: { type: "json_object" }, tools: [], tool_choice: "auto",
    parallel_tool_calls: false, top_k: 40, min_p: 0.1, repetition_penalty: 1.1, min_tokens: 4, ignore_eos: true, cache_salt: "s" };
  const got = podFields(CHAT, chat, TEXT_ONLY);
  assert.equal(got.json, chat); // the same object: the client's bytes can be sent
  assert.deepEqual(got.dropped, []);
  const legacy = { model: "m", prompt: "p", best_of: 2, echo: true, suffix: "s", max_tokens: 4, min_tokens: 4, ignore_eos: true };
  assert.equal(podFields(COMPLETIONS, legacy, TEXT_ONLY).json, legacy);
});

test("every vLLM engine field is refused with a 400 naming it, on both endpoints", () => {
  for (const [field, value] of Object.entries(ENGINE_FIELDS)) {
    for (const [path, body] of [[CHAT, ok], [COMPLETIONS, { model: "m", prompt: "p" }]]) {
      const no = refusal(path, { ...body, [field]: value });
      assert.deepEqual([no && no.param, no && no.code], [field, "unsupported_parameter"], `${path} ${field}`);
      assert.match(no.message, new RegExp(`^${field} is not sent to the pods`));
    }
  }
  assert.equal(refusal(CHAT, { ...ok, echo: true }).param, "echo"); // vLLM's chat echo is not OpenAI's
});

test("OpenAI's own fields the pods do not serve are dropped, not refused: a client written for OpenAI keeps working", () => {
  const body = { ...ok, store: true, metadata: { a: "b" }, service_tier: "flex", reasoning_effort: "low", temperature: 0 };
  const got = podFields(CHAT, body, TEXT_ONLY);
  assert.deepEqual(got.dropped, ["metadata", "reasoning_effort", "service_tier", "store"]);
  assert.deepEqual(got.json, { ...ok, temperature: 0 });
  assert.ok("store" in body, "the client's body is not changed (the fallback's allowlist reads it)");
});

test("content parts: text and refusal by default; media only as the operator allows, never embeddings or a uuid", () => {
  const parts = (...p) => ({ ...ok, messages: [{ role: "user", content: p }] });
  assert.equal(refusal(CHAT, parts({ type: "text", text: "a" }, { type: "refusal", refusal: "no" })), null);
  const image = { type: "image_url", image_url: { url: "http://169.254.169.254/latest/meta-data/" } };
  for (const [part, param] of [
    [image, "messages[0].content[0].type"],
    [{ type: "input_audio", input_audio: { data: "AAAA", format: "wav" } }, "messages[0].content[0].type"],
    [{ type: "audio_url", audio_url: { url: "https://example.com/a.wav" } }, "messages[0].content[0].type"],
    [{ type: "video_url", video_url: { url: "https://example.com/v.mp4" } }, "messages[0].content[0].type"],
    [{ type: "image_embeds", image_embeds: "UEsDBA==" }, "messages[0].content[0].type"],
    [{ type: "prompt_embeds", data: "UEsDBA==" }, "messages[0].content[0].type"],
    [{ type: "image_pil", image_pil: "x" }, "messages[0].content[0].type"],
    [{ type: "constructor" }, "messages[0].content[0].type"],
    // with a uuid, vLLM reads any media key of a part whatever its type
    [{ type: "text", text: "a", uuid: "u", image_url: "http://169.254.169.254/" }, "messages[0].content[0].uuid"],
    [{ type: "text", text: 5 }, "messages[0].content[0].text"],
  ]) {
    const no = refusal(CHAT, parts(part));
    assert.deepEqual([no && no.param, no && no.code], [param, "unsupported_parameter"], JSON.stringify(part));
  }
  const images = new Set(["image_url"]);
  assert.equal(refusal(CHAT, parts({ type: "image_url", image_url: { url: "https://example.com/cat.png", detail: "auto" } }), images), null);
  assert.equal(refusal(CHAT, parts({ type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } }), images), null);
  for (const url of ["http://169.254.169.254/latest/meta-data/", "https://169.254.169.254/", "https://[fd00::1]/x", "https://localhost/x",
    "https://metadata/x", "https://2852039166/", "https://0xa9fea9fe/", "https://u:p@example.com/", "file:///etc/passwd", 5]) {
    const no = refusal(CHAT, parts({ type: "image_url", image_url: { url } }), images);
    assert.equal(no && no.param, "messages[0].content[0].image_url.url", String(url));
  }
  assert.equal(refusal(CHAT, parts({ type: "input_audio", input_audio: { data: "AAAA", format: "wav" } }), images).param,
    "messages[0].content[0].type"); // image_url allowed, not audio
});

test("the allowlist runs after validate.js: a body both accept reaches the pod unchanged", () => {
  const body = { ...ok, max_tokens: 8, top_k: 5 };
  validateBody(CHAT, body, 8192);
  assert.equal(podFields(CHAT, body, TEXT_ONLY).json, body);
});
