// The JSON answer assembled from a pod's stream (assemble.js) against the answer vLLM writes
// for the same request without `stream`. Fixtures (test/fixtures/answers/): each NAME.sse is a
// stream in vLLM 0.10's shape (chunks serialised with exclude_unset, the usage event last,
// `[DONE]`), and NAME.json the non-streamed answer of the same generation, in its field order
// (vllm/entrypoints/openai/protocol.py ChatCompletionResponse, CompletionResponse).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { assemble, assembleBytes, parseEvents, parseStream, ssePayloads } from "../src/assemble.js";

const dir = new URL("./fixtures/answers/", import.meta.url);
const names = readdirSync(dir).filter((f) => f.endsWith(".sse")).map((f) => f.slice(0, -4));

test("there are fixtures of both endpoints, n > 1, tool calls, reasoning and logprobs", () => {
  assert.ok(names.some((n) => n.startsWith("chat-")) && names.some((n) => n.startsWith("text-")));
  assert.ok(names.length >= 5);
});

for (const name of names) {
  test(`${name}: the assembled answer is the pod's non-streamed answer, field by field, in its order`, () => {
    const sse = readFileSync(new URL(`${name}.sse`, dir));
    const expected = readFileSync(new URL(`${name}.json`, dir), "utf8").trim();
    const { bytes, answer, error } = assembleBytes(new Uint8Array(sse), name.startsWith("chat-"));
    assert.equal(error, null);
    assert.deepEqual(answer, JSON.parse(expected));
    // The same bytes but for number spelling: Python writes -2.0 where JavaScript writes -2.
    assert.equal(new TextDecoder().decode(bytes), JSON.stringify(JSON.parse(expected)));
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
