import { test } from "node:test";
import assert from "node:assert/strict";
import { validateBody, MAX_DEPTH, MAX_N, MAX_TOKENS } from "../src/validate.js";
import { HttpError } from "../src/errors.js";

const CHAT = "/v1/chat/completions";
const ok = { model: "m", messages: [{ role: "user", content: "hi" }] };

/** The 400 a body gets: {param, code, message}. */
function refusal(path, body) {
  try {
    validateBody(path, body);
  } catch (err) {
    assert.ok(err instanceof HttpError);
    assert.equal(err.status, 400);
    return { param: err.param, code: err.code, message: err.message };
  }
  return null;
}

test("valid chat and completion bodies pass, with nulls for optional fields and unknown extras", () => {
  assert.equal(refusal(CHAT, ok), null);
  assert.equal(refusal(CHAT, { ...ok, stream: true, stream_options: { include_usage: true }, max_tokens: 16, n: 2,
    temperature: 0, top_p: 1, stop: ["\n", "END"], seed: 7, logit_bias: { 50256: -100 }, top_k: 40, user: null,
    max_completion_tokens: null, tools: [{ type: "function", function: { name: "f", parameters: { type: "object" } } }],
    messages: [{ role: "system", content: "s" }, { role: "user", content: [{ type: "text", text: "hi" }] },
      { role: "assistant", content: null, tool_calls: [] }] }), null);
  for (const prompt of ["p", ["a", "b"], [1, 2, 3], [[1, 2], [3]]]) assert.equal(refusal("/v1/completions", { model: "m", prompt }), null);
});

test("each refused field is named, with its value and what it must be", () => {
  const cases = [
    [{ messages: ok.messages }, "model", "missing_field"],
    [{ model: "m" }, "messages", "missing_field"],
    [{ ...ok, messages: [] }, "messages", "invalid_value"],
    [{ ...ok, messages: ["hi"] }, "messages[0]", "invalid_value"],
    [{ ...ok, messages: [{ role: "wizard", content: "x" }] }, "messages[0].role", "invalid_value"],
    [{ ...ok, messages: [{ role: "user", content: 5 }] }, "messages[0].content", "invalid_value"],
    [{ ...ok, max_tokens: -1 }, "max_tokens", "invalid_value"],
    [{ ...ok, max_tokens: 0 }, "max_tokens", "invalid_value"],
    [{ ...ok, max_tokens: 1.5 }, "max_tokens", "invalid_value"],
    [{ ...ok, max_tokens: MAX_TOKENS + 1 }, "max_tokens", "invalid_value"],
    [{ ...ok, max_tokens: JSON.parse("1e309") }, "max_tokens", "invalid_value"],
    [{ ...ok, max_completion_tokens: "10" }, "max_completion_tokens", "invalid_value"],
    [{ ...ok, n: 1000000 }, "n", "invalid_value"],
    [{ ...ok, n: 0 }, "n", "invalid_value"],
    [{ ...ok, temperature: 2.5 }, "temperature", "invalid_value"],
    [{ ...ok, top_p: -0.1 }, "top_p", "invalid_value"],
    [{ ...ok, stream: "yes" }, "stream", "invalid_value"],
    [{ ...ok, stop: ["a", "b", "c", "d", "e"] }, "stop", "invalid_value"],
    [{ ...ok, stop: [1] }, "stop", "invalid_value"],
    [{ ...ok, stream_options: { include_usage: true } }, "stream_options", "invalid_value"],
    [{ ...ok, stream: true, stream_options: { include_usage: "yes" } }, "stream_options.include_usage", "invalid_value"],
    [{ ...ok, logit_bias: { 1: 101 } }, "logit_bias", "invalid_value"],
    [{ model: "m", prompt: [] }, "prompt", "invalid_value", "/v1/completions"],
    [{ model: "m" }, "prompt", "missing_field", "/v1/completions"],
    [{ model: "m", prompt: "p", best_of: MAX_N + 1 }, "best_of", "invalid_value", "/v1/completions"],
  ];
  for (const [body, param, code, path = CHAT] of cases) {
    const r = refusal(path, body);
    assert.ok(r, `${JSON.stringify(body)} passed`);
    assert.equal(r.param, param, r.message);
    assert.equal(r.code, code, r.message);
    assert.match(r.message, new RegExp(`^${param.replace(/[[\].]/g, "\\$&")} `));
    if (code === "invalid_value") assert.match(r.message, /got |out of range/); // the value, as sent
  }
  assert.match(refusal(CHAT, { ...ok, max_tokens: JSON.parse("1e309") }).message, /^max_tokens holds a number out of range \(Infinity\)/);
  assert.match(refusal(CHAT, { ...ok, n: 1000000 }).message, /from 1 to 16 \(got 1000000\)/);
});

test("depth and non-finite numbers anywhere are refused; a 10,000-deep array costs no stack", () => {
  const deep = JSON.parse("[".repeat(10000) + "]".repeat(10000));
  const r = refusal(CHAT, { ...ok, metadata: deep });
  assert.equal(r.param, "metadata");
  assert.equal(r.code, "too_deep");
  const nested = refusal(CHAT, { ...ok, messages: [{ role: "user", content: [{ type: "text", text: "x", extra: deep }] }] });
  assert.equal(nested.param, "messages");
  let atLimit = [];
  for (let i = 1; i < MAX_DEPTH; i++) atLimit = [atLimit]; // MAX_DEPTH levels counted from the field
  assert.equal(refusal(CHAT, { ...ok, x: atLimit }), null);
  assert.equal(refusal(CHAT, { ...ok, x: [atLimit] }).code, "too_deep");
  const inf = refusal(CHAT, { ...ok, tools: [{ type: "function", function: { name: "f", parameters: { maximum: JSON.parse("-1e999") } } }] });
  assert.equal(inf.param, "tools");
  assert.match(inf.message, /-Infinity/);
});
