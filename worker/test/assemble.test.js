// The JSON answer assembled from a pod's stream (assemble.js) against the answer vLLM writes
// for the same request without `stream`. Fixtures (test/fixtures/answers/): each NAME.sse is
// a live vLLM 0.32's stream of one request and NAME.json its non-streamed answer to the same
// request, greedy or seeded so that both make the same tokens (tests/engine_contract/
// capture_answers.py records them; docs/testing.md says how). chat-tools is written by hand
// in the shape vLLM streams a tool call (a tool parser's deltas, as captured with hermes), as
// no engine here can finish one.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { assemble, assembleBytes, parseEvents, parseStream, ssePayloads } from "../src/assemble.js";

const dir = new URL("./fixtures/answers/", import.meta.url);
const names = readdirSync(dir).filter((f) => f.endsWith(".sse")).map((f) => f.slice(0, -4));

test("there are fixtures of both endpoints, n > 1, tool calls, reasoning, logprobs, stop strings and echo", () => {
  for (const n of ["chat-plain", "chat-n2-logprobs", "chat-reasoning", "chat-tools", "chat-stop", "text-n2-logprobs", "text-echo"]) {
    assert.ok(names.includes(n), n);
  }
});

/** The fixture's request (what shapes the answer besides the stream: tool_choice, return_token_ids). */
const REQUESTS = { "chat-tools": { tool_choice: "required" } };

for (const name of names) {
  test(`${name}: the assembled answer is vLLM's non-streamed answer, field by field, in its order`, () => {
    const sse = readFileSync(new URL(`${name}.sse`, dir));
    const whole = JSON.parse(readFileSync(new URL(`${name}.json`, dir), "utf8"));
    const { bytes, answer, error } = assembleBytes(new Uint8Array(sse), name.startsWith("chat-"), REQUESTS[name] ?? {});
    assert.equal(error, null);
    // Two requests: their ids and times differ, and so do the ids vLLM gives tool calls.
    const expected = { ...whole, id: answer.id, created: answer.created };
    expected.choices.forEach((c, i) => (c.message?.tool_calls ?? []).forEach((t, k) => (t.id = answer.choices[i].message.tool_calls[k].id)));
    assert.deepEqual(answer, expected);
    assert.deepEqual(Object.keys(answer), Object.keys(whole));
    // The same bytes but for number spelling: Python writes -2.0 where JavaScript writes -2.
    assert.equal(new TextDecoder().decode(bytes), JSON.stringify(expected));
  });
}

test("events split over CRLF lines, comments and other fields are read as SSE says", () => {
  const text = ": keep-alive\r\nevent: message\r\ndata: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\r\n\r\n"
    + "data:{\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
  const p = ssePayloads(text);
  assert.equal(p.length, 2);
  const { answer } = assemble(parseEvents(p), true);
  assert.equal(answer.choices[0].message.content, "ab");
  assert.equal(answer.choices[0].finish_reason, "stop");
});

test("a malformed event is skipped, the others still make the answer", () => {
  const events = parseEvents(['{"id":"x","choices":[{"index":0,"text":"a"}]}', '{"id":', '[1]', '{"id":"x","choices":[{"index":0,"text":"c"}]}']);
  assert.equal(events.length, 2);
  assert.equal(assemble(events, false).answer.choices[0].text, "ac");
});

test("an error event ends the assembly with that error", () => {
  const events = parseEvents(['{"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}',
    '{"error":{"message":"engine dead","type":"InternalServerError","code":500}}']);
  const r = assemble(events, true);
  assert.equal(r.answer, null);
  assert.equal(r.error.message, "engine dead");
});

test("a stream without a usage event gives an answer without usage (the router estimates it)", () => {
  const { answer } = assemble(parseEvents(['{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}']), true);
  assert.equal(answer.usage, undefined);
  assert.equal(answer.object, "chat.completion");
  assert.equal(answer.choices[0].message.content, "hi");
});

// parseStream keeps the events that differ from a template event only in their plain
// content as strings; the answer must be the same, byte for byte, as from every event parsed.
function both(payloads, chat) {
  const { events, template } = parseStream(payloads, chat);
  const fast = assemble(events, chat, template);
  const slow = assemble(parseEvents(payloads), chat);
  return { fast, slow, template, strings: events.filter((e) => typeof e === "string").length };
}

for (const name of names) {
  test(`${name}: the template path gives the bytes of every event parsed`, () => {
    const text = readFileSync(new URL(`${name}.sse`, dir), "utf8");
    const { fast, slow } = both(ssePayloads(text), name.startsWith("chat-"));
    assert.equal(JSON.stringify(fast.answer), JSON.stringify(slow.answer));
  });
}

const chunk = (content, extra = {}) => JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 7, model: "m",
  choices: [{ index: 0, delta: { content }, logprobs: null, finish_reason: null }], ...extra });

test("a plain stream is mostly strings, and the answer is the same bytes", () => {
  const payloads = [JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 7, model: "m",
    choices: [{ index: 0, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null }] }),
  chunk("Hello"), chunk(", wörld"), chunk(" é 😀"), chunk("x"),
  JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 7, model: "m",
    choices: [{ index: 0, delta: { content: "" }, logprobs: null, finish_reason: "stop", stop_reason: null }] }),
  JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 7, model: "m", choices: [],
    usage: { prompt_tokens: 3, completion_tokens: 5, total_tokens: 8 } })];
  const { fast, slow, template, strings } = both(payloads, true);
  assert.ok(template !== null);
  assert.equal(strings, 4);
  assert.equal(JSON.stringify(fast.answer), JSON.stringify(slow.answer));
  assert.equal(fast.answer.choices[0].message.content, "Hello, wörld é 😀x");
  assert.equal(fast.answer.choices[0].finish_reason, "stop");
});

test("content with escapes, quotes or control characters is parsed, not taken as written", () => {
  const payloads = [chunk("a"), chunk('say "hi"'), chunk("line\nnext"), chunk("tab\there"), chunk("b"), chunk("back\\slash"),
    chunk("\u00e9"), chunk("c")];
  // JSON.stringify writes é raw; an escaped one (as Python's ensure_ascii does) must be decoded.
  payloads[6] = payloads[6].replace("é", "\\u00e9");
  const { fast, slow, strings } = both(payloads, true);
  assert.equal(JSON.stringify(fast.answer), JSON.stringify(slow.answer));
  assert.equal(fast.answer.choices[0].message.content, 'asay "hi"line\nnexttab\therebback\\slashéc');
  assert.equal(strings, 3);
});

test("the template is used only when the split is the choice's content and the event carries nothing else", () => {
  const cases = [
    // the only `"content":"` is another object's; the choice's content is spelt with a blank
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","x":{"content":"v${i}"},"choices":[{"index":0,"delta":{"content": "t${i}"}}]}`),
    // the same, where the middle event's other content is "" (only the probe tells)
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","x":{"content":"${i === 2 ? "" : "v" + i}"},"choices":[{"index":0,"delta":{"content": ""}}]}`),
    // every event carries a role, a finish reason, logprobs, usage, or two choices
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"t${i}"}}]}`),
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","choices":[{"index":0,"delta":{"content":"t${i}"},"finish_reason":"length"}]}`),
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","choices":[{"index":0,"delta":{"content":"t${i}"},"logprobs":{"content":[]}}]}`),
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","choices":[{"index":0,"delta":{"content":"t${i}"}}],"usage":{"prompt_tokens":1,"completion_tokens":${i},"total_tokens":${i + 1}}}`),
    Array.from({ length: 5 }, (_, i) => `{"id":"c1","choices":[{"index":0,"delta":{"content":"t${i}"}},{"index":1,"delta":{"content":"u"}}]}`),
    // a malformed event among them, an error event, a non-object
    [chunk("a"), chunk("b"), '{"id":', chunk("c"), chunk("d")],
    [chunk("a"), chunk("b"), chunk("c"), '{"error":{"message":"engine dead","code":500}}', chunk("d")],
    [chunk("a"), chunk("b"), "[1]", chunk("c"), chunk("d")],
  ];
  for (const payloads of cases) {
    const { fast, slow } = both(payloads, true);
    assert.equal(JSON.stringify(fast), JSON.stringify(slow), payloads[2]);
  }
  // the first two: all parsed (no template), and the choice's own content kept
  const first = both(cases[0], true);
  assert.equal(first.template, null);
  assert.equal(first.fast.answer.choices[0].message.content, "t0t1t2t3t4");
  assert.equal(both(cases[1], true).template, null);
});

test("legacy completions: text events of one shape are strings too", () => {
  const ev = (text, finish = null) => JSON.stringify({ id: "cmpl-1", object: "text_completion", created: 7, model: "m",
    choices: [{ index: 0, text, logprobs: null, finish_reason: finish, stop_reason: null }] });
  const payloads = [ev("a"), ev("b"), ev("c"), ev("d"), ev("", "stop")];
  const { fast, slow, strings } = both(payloads, false);
  assert.equal(strings, 4);
  assert.equal(JSON.stringify(fast.answer), JSON.stringify(slow.answer));
  assert.equal(fast.answer.choices[0].text, "abcd");
});

test("reasoning is kept whether the stream spells it `reasoning` (vLLM 0.32) or `reasoning_content` (older)", () => {
  for (const key of ["reasoning", "reasoning_content"]) {
    const ev = (delta, finish = null) => JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 7, model: "m",
      choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] });
    const payloads = [ev({ role: "assistant", content: "" }), ev({ [key]: "Let me " }), ev({ [key]: "think." }), ev({ content: "Hi" }),
      ev({ content: "!" }, "stop")];
    const { answer } = assemble(parseEvents(payloads), true);
    assert.equal(answer.choices[0].message.reasoning, "Let me think.", key);
    assert.equal(answer.choices[0].message.content, "Hi!");
    assert.ok(!("reasoning_content" in answer.choices[0].message));
  }
});

test("token ids asked for (return_token_ids) are joined per choice, and the template path keeps them", () => {
  const ev = (text, ids, finish = null) => JSON.stringify({ id: "cmpl-1", object: "text_completion", created: 7, model: "m",
    choices: [{ index: 0, text, logprobs: null, finish_reason: finish, stop_reason: null, prompt_token_ids: text === "a" ? [9, 8] : null,
      token_ids: ids }] });
  const payloads = [ev("a", [1]), ev("b", [2]), ev("c", [3]), ev("d", [4]), ev("e", [5], "length")];
  const { fast, slow } = both(payloads, false);
  assert.equal(JSON.stringify(fast.answer), JSON.stringify(slow.answer));
  assert.deepEqual(slow.answer.choices[0].token_ids, [1, 2, 3, 4, 5]);
  assert.equal(slow.answer.choices[0].prompt_token_ids, null); // not asked: null, as vLLM writes it
  const asked = assemble(parseEvents(payloads), false, null, { return_token_ids: true }).answer;
  assert.deepEqual(asked.choices[0].prompt_token_ids, [9, 8]);
});
