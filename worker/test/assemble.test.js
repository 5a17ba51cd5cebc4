// The JSON answer assembled from a pod's stream (assemble.js) against the answer vLLM writes
// for the same request without `stream`. Fixtures (test/fixtures/answers/): each NAME.sse is a
// stream in vLLM 0.10's shape (chunks serialised with exclude_unset, the usage event last,
// `[DONE]`), and NAME.json the non-streamed answer of the same generation, in its field order
// (vllm/entrypoints/openai/protocol.py ChatCompletionResponse, CompletionResponse).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { assemble, assembleBytes, parseEvents, ssePayloads } from "../src/assemble.js";

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
