import { test } from "node:test";
import assert from "node:assert/strict";
import {
  capUsage, contentChars, estimateUsage, streamCap, streamCut, stripStream, tapStream, usageCeiling, usageOfAnswer, usageOfJson, usageOfSseTail,
} from "../src/usage.js";

const enc = (s) => new TextEncoder().encode(s);

test("usage of a complete JSON answer", () => {
  assert.deepEqual(usageOfJson(enc('{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}')), { prompt: 3, completion: 4 });
  assert.equal(usageOfJson(enc('{"choices":[]}')), null);
  assert.equal(usageOfJson(enc("not json")), null);
  assert.equal(usageOfJson(enc('{"usage":{"prompt_tokens":-1,"completion_tokens":"x"}}')), null);
});

test("usage of a stream is its last data event with a usage object", () => {
  const sse = 'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    + 'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\ndata: [DONE]\n\n';
  assert.deepEqual(usageOfSseTail(sse), { prompt: 9, completion: 2 });
  assert.equal(usageOfSseTail('data: {"choices":[]}\n\ndata: [DONE]\n\n'), null);
  assert.deepEqual(usageOfSseTail('ompt_tokens":1}}\n\ndata: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n'), { prompt: 1, completion: 1 });
});

test("the tap passes every byte through and reports the usage once at the end", async () => {
  const filler = 'data: {"choices":[{"delta":{"content":"' + "x".repeat(1000) + '"}}]}\n\n';
  const parts = [...Array(40).fill(filler), 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":6}}\n\n', "data: [DONE]\n\n"];
  const body = new ReadableStream({ start(c) { for (const p of parts) c.enqueue(enc(p)); c.close(); } });
  const seen = [];
  const tap = tapStream(body, true, (u) => seen.push(u));
  const text = await new Response(tap.body).text();
  await tap.piped;
  assert.equal(text, parts.join(""));
  assert.deepEqual(seen, [{ prompt: 5, completion: 6 }]);
  const quiet = tapStream(new Response("data: [DONE]\n\n").body, false, (u) => seen.push(u));
  await new Response(quiet.body).text();
  await quiet.piped;
  assert.deepEqual(seen.at(-1), null);
});

test("only the usage object is parsed, wherever it sits, and junk around it is harmless", () => {
  const body = (u) => enc(`{"id":"x","choices":[{"message":{"content":"usage { } is here"}}],"usage":${u}}`);
  assert.deepEqual(usageOfJson(body('{"prompt_tokens":2,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}')),
    { prompt: 2, completion: 3 });
  assert.equal(usageOfJson(body("null")), null);
  assert.equal(usageOfJson(body('"n/a"')), null);
  assert.deepEqual(usageOfJson(enc('{"usage": {"completion_tokens": 4}, "id": "y"}').buffer), { prompt: 0, completion: 4 });
});

test("the usage object is found after blanks and non-ASCII text, and a cut-off one is not parsed", () => {
  assert.deepEqual(usageOfJson(enc('{"content":"naïve ✓ 東京","usage" :\n\t{"prompt_tokens":1,"completion_tokens":2}}')),
    { prompt: 1, completion: 2 });
  assert.equal(usageOfJson(enc('{"usage":{"prompt_tokens":1,"completion_tokens":{"x":2}')), null);
  assert.equal(usageOfJson(enc('{"usage":[{"prompt_tokens":1}]}')), null);
  assert.equal(usageOfJson(new Uint8Array(0)), null);
});

test("a long answer's usage is found in its tail, or further up when it is not there", () => {
  const content = "é".repeat(20000); // 40,000 bytes of two-byte characters: the tail cuts one in half
  const usage = '"usage":{"prompt_tokens":7,"completion_tokens":8}';
  assert.deepEqual(usageOfJson(enc(`{"choices":[{"message":{"content":"${content}"}}],${usage}}`)), { prompt: 7, completion: 8 });
  assert.deepEqual(usageOfJson(enc(`{${usage},"choices":[{"message":{"content":"${content}"}}]}`)), { prompt: 7, completion: 8 });
  assert.equal(usageOfJson(enc(`{"choices":[{"message":{"content":"${content}"}}],"usage":null}`)), null);
  assert.equal(usageOfJson(enc(`{"choices":[{"message":{"content":"${content}"}}]}`)), null);
});

test("a usage event split over chunks, after more than the tail's worth of stream, is found", async () => {
  const event = 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}\n\n';
  const filler = "data: " + JSON.stringify({ choices: [{ delta: { content: "y".repeat(30000) } }] }) + "\n\n";
  const parts = [filler, event.slice(0, 20), event.slice(20, 41), event.slice(41), "data: [DONE]\n\n"];
  const body = new ReadableStream({ start(c) { for (const p of parts) c.enqueue(enc(p)); c.close(); } });
  const seen = [];
  const tap = tapStream(body, true, (u) => seen.push(u));
  assert.equal(await new Response(tap.body).text(), parts.join(""));
  await tap.piped;
  assert.deepEqual(seen, [{ prompt: 3, completion: 9 }]);
});

for (const wantUsage of [false, true]) {
  test(`a client that cancels stops the source and reports no usage, once (wantUsage ${wantUsage})`, async () => {
    let cancelled = null;
    let pulls = 0;
    const body = new ReadableStream({
      pull(c) {
        pulls++;
        c.enqueue(enc(`data: {"n":${pulls}}\n\n`));
      },
      cancel(reason) {
        cancelled = reason ?? "cancelled";
      },
    });
    const seen = [];
    const tap = tapStream(body, wantUsage, (u) => seen.push(u));
    const reader = tap.body.getReader();
    assert.match(new TextDecoder().decode((await reader.read()).value), /^data: /);
    await reader.cancel("client left");
    await tap.piped;
    assert.notEqual(cancelled, null);
    assert.deepEqual(seen, [null]);
  });

  test(`a source that breaks errors the client's side and reports no usage (wantUsage ${wantUsage})`, async () => {
    let n = 0;
    const body = new ReadableStream({
      pull(c) {
        if (++n > 2) c.error(new Error("pod connection reset"));
        else c.enqueue(enc("data: {}\n\n"));
      },
    });
    const seen = [];
    const tap = tapStream(body, wantUsage, (u) => seen.push(u));
    await assert.rejects(new Response(tap.body).text());
    await tap.piped;
    assert.deepEqual(seen, [null]);
  });
}

const sse = (o) => `data: ${JSON.stringify(o)}\n\n`;
const streamOf = (parts) => new ReadableStream({ start(c) { for (const p of parts) c.enqueue(enc(p)); c.close(); } });
const guess = (chars) => ({ guessed: chars });

test("strip: the client gets every event but the usage event, in any chunking; the usage is counted", async () => {
  const content = [0, 1, 2].map((i) => sse({ choices: [{ index: 0, delta: { content: `tok${i}` } }], usage: null }));
  const usage = sse({ choices: [], usage: { prompt_tokens: 4, completion_tokens: 3, total_tokens: 7 } });
  const whole = content.join("") + usage + "data: [DONE]\n\n";
  const expected = content.join("") + "data: [DONE]\n\n";
  // one event per chunk; events cut anywhere; everything in one chunk; CRLF line ends
  const chunkings = [
    [...content, usage, "data: [DONE]\n\n"],
    Array.from({ length: Math.ceil(whole.length / 7) }, (_, i) => whole.slice(i * 7, i * 7 + 7)),
    [whole],
  ];
  for (const parts of chunkings) {
    const seen = [];
    const s = stripStream(streamOf(parts), (u) => seen.push(u), guess);
    assert.equal(await new Response(s.body).text(), expected);
    await s.piped;
    assert.deepEqual(seen, [{ prompt: 4, completion: 3 }]);
  }
  const crlf = whole.replaceAll("\n", "\r\n");
  const seen = [];
  const s = stripStream(streamOf([crlf]), (u) => seen.push(u), guess);
  assert.equal(await new Response(s.body).text(), expected.replaceAll("\n", "\r\n"));
  await s.piped;
  assert.deepEqual(seen, [{ prompt: 4, completion: 3 }]);
});

test("strip: a chunk of whole events without a usage object leaves as the very same bytes", async () => {
  const chunk = enc(sse({ choices: [{ delta: { content: "a" } }], usage: null }));
  const s = stripStream(new ReadableStream({ start(c) { c.enqueue(chunk); c.close(); } }), () => {}, guess);
  const { value } = await s.body.getReader().read();
  assert.equal(value, chunk);
});

test("strip: no usage event, or a client that leaves, is estimated from the content streamed", async () => {
  const parts = ["a".repeat(40), "b".repeat(10)].map((t) => sse({ choices: [{ delta: { content: t } }] }));
  const seen = [];
  const s = stripStream(streamOf([...parts, "data: [DONE]\n\n"]), (u) => seen.push(u), guess);
  assert.equal(await new Response(s.body).text(), parts.join("") + "data: [DONE]\n\n");
  await s.piped;
  assert.deepEqual(seen, [{ guessed: 50 }]);
  let cancelled = false;
  const endless = new ReadableStream({
    pull(c) { c.enqueue(enc(sse({ choices: [{ delta: { content: "abcd" } }] }))); },
    cancel() { cancelled = true; },
  });
  const cut = [];
  const t = stripStream(endless, (u) => cut.push(u), guess);
  const reader = t.body.getReader();
  await reader.read();
  await reader.read();
  await reader.cancel("client left");
  await t.piped;
  assert.equal(cancelled, true); // the pod's stream is cut too
  assert.equal(cut.length, 1);
  assert.ok(cut[0].guessed >= 8, JSON.stringify(cut)); // what the client was sent is counted
});

test("tap: a stream without usage, or cut, is estimated from its tail scaled to its length", async () => {
  const part = sse({ choices: [{ delta: { content: "x".repeat(100) } }] });
  const parts = Array(400).fill(part); // about 28 KB, more than the 16 KiB tail
  const seen = [];
  const tap = tapStream(streamOf(parts), true, (u) => seen.push(u), guess);
  await new Response(tap.body).text();
  await tap.piped;
  assert.ok(Math.abs(seen[0].guessed - 40000) <= 400, JSON.stringify(seen)); // 400 events of 100 characters
});

test("the estimate: four characters a token, of the prompt as JSON and of the streamed text", () => {
  const json = { messages: [{ role: "user", content: "x".repeat(100) }] };
  const u = estimateUsage(json, 41);
  assert.equal(u.prompt, Math.ceil(JSON.stringify(json.messages).length / 4));
  assert.equal(u.completion, 11);
  assert.equal(u.estimated, true);
  assert.equal(estimateUsage({ prompt: "abcd" }, 0).prompt, 2); // '"abcd"' is six characters
  assert.equal(contentChars(sse({ choices: [{ delta: { content: "ab\"c", tool_calls: [{ function: { arguments: "{}" } }] } }] })), 7);
  // a reasoning model's text: vLLM 0.32 streams `reasoning`, older versions `reasoning_content`
  assert.equal(contentChars(sse({ choices: [{ delta: { reasoning: "hmm" } }] }) + sse({ choices: [{ delta: { reasoning_content: "ok" } }] })), 5);
  const answer = { choices: [{ message: { content: null, reasoning: "x".repeat(40) } }] };
  assert.equal(usageOfAnswer(new TextEncoder().encode(JSON.stringify(answer)), (chars) => ({ completion: chars })).completion, 40);
});

test("a usage string inside the answer cannot hide or replace the top-level usage", () => {
  // vLLM writes prompt_logprobs after usage; a prompt token that decodes to "usage" put the
  // last "usage" of the text inside them.
  const hidden = '{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":5},'
    + '"prompt_logprobs":[null,{"42":{"logprob":-0.1,"rank":1,"decoded_token":"usage"}},{"7":{"decoded_token":"\\"usage\\":{\\"prompt_tokens\\":0}"}}]}';
  assert.deepEqual(usageOfJson(enc(hidden)), { prompt: 12, completion: 5 });
  const nested = '{"choices":[{"message":{"content":"x"},"usage":{"prompt_tokens":1,"completion_tokens":1}}]}';
  assert.equal(usageOfJson(enc(nested)), null);
});

test("an answer without usage is estimated from its generated text", () => {
  const guess = (chars) => ({ prompt: 1, completion: Math.ceil(chars / 4), estimated: true });
  const answer = '{"choices":[{"message":{"content":"abcdefgh","tool_calls":[{"function":{"arguments":"1234"}}]}},{"text":"abcd"}]}';
  assert.deepEqual(usageOfAnswer(enc(answer), guess), { prompt: 1, completion: 4, estimated: true });
  assert.deepEqual(usageOfAnswer(enc("not json"), guess), { prompt: 1, completion: 0, estimated: true });
  assert.deepEqual(usageOfAnswer(enc('{"usage":{"prompt_tokens":2,"completion_tokens":3}}'), guess), { prompt: 2, completion: 3 });
});

test("usage is capped by what the request allows, and huge counts stay safe integers", () => {
  const inflated = usageOfJson(enc('{"usage":{"prompt_tokens":1e300,"completion_tokens":1e309}}'));
  assert.deepEqual(inflated, { prompt: Number.MAX_SAFE_INTEGER, completion: Number.MAX_SAFE_INTEGER });
  const ceiling = usageCeiling({ max_tokens: 8, n: 2 }, 300);
  assert.deepEqual(ceiling, { prompt: 300, completion: 16 });
  assert.deepEqual(capUsage(inflated, ceiling), { prompt: 300, completion: 16, capped: true });
  const fair = { prompt: 20, completion: 16 };
  assert.equal(capUsage(fair, ceiling), fair);
  assert.equal(capUsage(null, ceiling), null);
  const chat = { messages: [{ role: "user", content: "hi" }] };
  assert.deepEqual(usageCeiling({ ...chat, max_completion_tokens: 4, best_of: 3, n: 1 }, 10), { prompt: 10, completion: 12 });
  // /v1/completions honours max_tokens only (vLLM ignores max_completion_tokens there)
  assert.deepEqual(usageCeiling({ prompt: "hi", max_tokens: 9, max_completion_tokens: 1 }, 10, 8192), { prompt: 10, completion: 9 });
  // a prompt list is a generation per prompt, each n times; none is past what fits beside its
  // prompt in the served context (vLLM cuts max_tokens there): the shortest prompt bounds them all
  assert.deepEqual(usageCeiling({ prompt: ["a", "b", "c"], max_tokens: 3, n: 2 }, 1000, 8192), { prompt: 1000, completion: 18 });
  assert.deepEqual(usageCeiling({ prompt: [[1, 2], [3]], n: 2 }, 100_000, 8192), { prompt: 16_384, completion: 2 * 2 * (8192 - 1) });
  assert.deepEqual(usageCeiling({ prompt: [1, 2, 3] }, 10, 8192), { prompt: 10, completion: 8192 - 3 }); // one prompt of token ids
  assert.deepEqual(usageCeiling({ prompt: [1, 2, 3], max_tokens: 8192 }, 10, 8192), { prompt: 10, completion: 8192 - 3 });
  assert.deepEqual(usageCeiling({ ...chat, max_tokens: 8192 }, 10, 8192), { prompt: 10, completion: 8191 }); // "hi": at least 1 token
  const long = { messages: [{ role: "user", content: "x".repeat(16 * 8000) }], max_tokens: 8192 };
  assert.deepEqual(usageCeiling(long, 200_000, 8192).completion, 192); // 8,000 tokens at least: 192 fit beside them
  assert.deepEqual(usageCeiling({}, 10), { prompt: 10, completion: 131072 });
});

test("a stream past its cap is cut: the router's pump ends it with an error event at the cap, the tap cancels it", async () => {
  assert.equal(streamCap({ max_tokens: 4, n: 2 }, 100), 65_536 + 8 * 4096);
  assert.equal(streamCap({}, 100), 256 * 1024 * 1024); // 131,072 tokens at 4 KiB is past the ceiling
  // echo: each choice's first event carries its prompts back, a size the client chose (once
  // 64 prompts of 15 KB with max_tokens 1 passed a cap of 64 KiB + 64 x 4 KiB)
  const body = 64 * 15_000;
  const echoed = { prompt: Array(64).fill("p"), echo: true, max_tokens: 1 };
  assert.ok(streamCap(echoed, body, 8192) >= 65_536 + 64 * 4096 + body, String(streamCap(echoed, body, 8192)));
  assert.equal(streamCap({ ...echoed, n: 2 }, 1000, 8192) - streamCap({ ...echoed, n: 2, echo: false }, 1000, 8192), 2 * 1000 * 48);
  // Events past FULL_READ (4 KiB): the counting branch reads on at once instead of once a
  // second, so the cap is reached in a few reads, not seconds (the test's time, not its outcome).
  const event = enc(sse({ choices: [{ delta: { content: "x".repeat(5000) } }] }));
  const endless = () => {
    const src = { cancelled: false };
    // a pod that streams on and on, an event a millisecond
    src.stream = new ReadableStream({
      async pull(c) {
        await new Promise((resolve) => setTimeout(resolve, 1));
        c.enqueue(event);
      },
      cancel() { src.cancelled = true; },
    });
    return src;
  };
  const a = endless();
  const seen = [];
  const s = stripStream(a.stream, (u) => seen.push(u), guess, 10_000);
  const out = new Uint8Array(await new Response(s.body).arrayBuffer());
  await s.piped;
  const cutEvent = streamCut(10_000);
  assert.ok(out.length <= 10_000 + cutEvent.length, String(out.length));
  assert.deepEqual(out.subarray(out.length - cutEvent.length), cutEvent);
  assert.deepEqual(JSON.parse(new TextDecoder().decode(cutEvent).slice(6)).error.code, "stream_too_large");
  assert.equal(a.cancelled, true);
  assert.equal(seen.length, 1);
  const b = endless();
  const tapped = [];
  const tap = tapStream(b.stream, true, (u) => tapped.push(u), guess, 10_000);
  await new Response(tap.body).arrayBuffer().catch(() => null); // cut: the client's stream errors
  await tap.piped;
  assert.equal(b.cancelled, true);
  assert.equal(tapped.length, 1);
});
