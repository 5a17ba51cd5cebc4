// A pod's stream asked for continuous usage (podstream.js): the usage of each event found from
// its end and cut out of what the client sees, the last usage event told apart, several choices
// counted by choice, and the pump that passes events on whole however the bytes are split.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Tally, clientEvents, lastUsageAt, pumpPod } from "../src/podstream.js";

const enc = new TextEncoder();
const dec = new TextDecoder();

// vLLM's events with continuous usage (0.32, seen here): the role-only first event with the
// prompt's tokens, one event per token with the count so far, the last usage event.
const head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m"';
const usage = (p, c) => `"usage":{"prompt_tokens":${p},"total_tokens":${p + c},"completion_tokens":${c}}`;
const roleEvent = (p, i = 0) => `data: ${head},"choices":[{"index":${i},"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],${usage(p, 0)}}\n\n`;
const tokenEvent = (p, c, text, i = 0) => `data: ${head},"choices":[{"index":${i},"delta":{"content":${JSON.stringify(text)}},"logprobs":null,"finish_reason":null}],${usage(p, c)}}\n\n`;
const lastEvent = (p, c) => `data: ${head},"choices":[],${usage(p, c)}}\n\n`;
const plain = (text) => `data: ${head},"choices":[{"index":0,"delta":{"content":${JSON.stringify(text)}},"logprobs":null,"finish_reason":null}]}\n\n`;

test("a continuous-usage event: its usage is found from its end, cut out, and the last usage event told apart", () => {
  const t = new Tally();
  const ev = enc.encode(roleEvent(7) + tokenEvent(7, 1, "a \"usage\":{1} b"));
  const out = clientEvents(ev, { usage: false, continuous: false }, t);
  // the client sees the events it would have without asking for usage: no usage field
  assert.equal(dec.decode(out), `data: ${head},"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n`
    + plain("a \"usage\":{1} b"));
  assert.deepEqual(t.usage(), { prompt: 7, completion: 1 }); // the text's escaped "usage" is never taken for one
  // the last usage event: kept for a client that asked include_usage, dropped otherwise
  const end = enc.encode(tokenEvent(7, 2, "c") + lastEvent(7, 2) + "data: [DONE]\n\n");
  assert.equal(dec.decode(clientEvents(end, { usage: true, continuous: false }, new Tally())), plain("c") + lastEvent(7, 2) + "data: [DONE]\n\n");
  const dropped = new Tally();
  assert.equal(dec.decode(clientEvents(end, { usage: false, continuous: false }, dropped)), plain("c") + "data: [DONE]\n\n");
  assert.deepEqual(dropped.usage(), { prompt: 7, completion: 2 });
  // a client that asked continuous usage itself gets the bytes as they came
  assert.equal(clientEvents(end, { usage: true, continuous: true }, new Tally()), end);
  // nested details (vLLM's prompt_tokens_details) balance; an object cut off at the end is not taken
  const nested = enc.encode(`{"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1},"completion_tokens":2}}`);
  assert.deepEqual(lastUsageAt(nested, 0, nested.length), [1, 9, nested.length - 1]);
  assert.equal(lastUsageAt(nested, 0, nested.length - 3), null);
});

test("several choices: every event's usage is read by choice, a prompt counted once for its choices", () => {
  const t = new Tally(2, 1);
  clientEvents(enc.encode(roleEvent(9, 0) + roleEvent(9, 1) + tokenEvent(9, 1, "a", 0) + tokenEvent(9, 1, "b", 1) + tokenEvent(9, 2, "c", 0)),
    { usage: false, continuous: false }, t);
  assert.deepEqual(t.usage(), { prompt: 9, completion: 3 });
  // completions with two prompts and n = 2: choices 0-1 are the first prompt's, 2-3 the second's
  const lists = new Tally(2, 2);
  clientEvents(enc.encode(tokenEvent(4, 3, "x", 0) + tokenEvent(4, 1, "y", 1) + tokenEvent(6, 2, "z", 2) + tokenEvent(6, 5, "w", 3)),
    { usage: false, continuous: false }, lists);
  assert.deepEqual(lists.usage(), { prompt: 10, completion: 11 });
});

test("the pump: events split anywhere reach the client whole and without usage; a cut counts the last usage read", async () => {
  const text = roleEvent(5) + tokenEvent(5, 1, "one ") + tokenEvent(5, 2, "two ") + tokenEvent(5, 3, "three ");
  const bytes = enc.encode(text);
  const parts = [bytes.subarray(0, 10), bytes.subarray(10, 200), bytes.subarray(200, 201), bytes.subarray(201)];
  let i = 0;
  let cancelled = null;
  const source = {
    read: async () => (i < parts.length ? { done: false, value: parts[i++] } : new Promise(() => {})), // then a pod that says nothing
    cancel: async (reason) => { cancelled = reason; },
  };
  const seen = [];
  const t = new Tally();
  const p = pumpPod(source, { usage: false, continuous: false }, t, Infinity, (u) => seen.push(u));
  const reader = p.body.getReader();
  let got = "";
  while (!got.endsWith(plain("three "))) got += dec.decode((await reader.read()).value);
  assert.equal(got, dec.decode(clientEvents(enc.encode(text), { usage: false, continuous: false }, new Tally())));
  await reader.cancel(new Error("client_gone")); // the client leaves; the pump's next write fails once the pod sends
  assert.deepEqual(t.usage(), { prompt: 5, completion: 3 });
});

test("a server that writes blanks in its JSON (Python's json.dumps) is read and cut the same", () => {
  const spaced = (o) => `data: ${JSON.stringify(o).replace(/":/g, '": ').replace(/,"/g, ', "')}\n\n`;
  const ev = { id: "c", choices: [{ index: 0, delta: { content: "hi" } }], usage: { prompt_tokens: 4, total_tokens: 6, completion_tokens: 2 } };
  const t = new Tally();
  const out = dec.decode(clientEvents(enc.encode(spaced(ev) + spaced({ id: "c", choices: [], usage: ev.usage })), { usage: false, continuous: false }, t));
  assert.equal(out, spaced({ id: "c", choices: [{ index: 0, delta: { content: "hi" } }] }));
  assert.deepEqual(t.usage(), { prompt: 4, completion: 2 });
});
