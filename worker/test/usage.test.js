import { test } from "node:test";
import assert from "node:assert/strict";
import { tapStream, usageOfJson, usageOfSseTail } from "../src/usage.js";

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
