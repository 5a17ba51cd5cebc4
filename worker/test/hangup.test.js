// Every token, whoever hangs up (docs/worker.md): a cut stream charged what the pod made (its
// continuous usage); a client that hangs up at any moment (the request's abort signal) cancels
// the upstream's work, is metered what was made (the ceiling where nothing is known) and frees
// its slot at once (tab.js); the fallback's usage counted as it reports it. In Node, against the
// real generation object and fake pods that stream on a timer with vLLM's continuous usage and
// stop when their request is aborted, as vLLM does. The same through workerd and the stand-in
// pod: tests/test_hangups.py; what the client sees of a pod's stream: podstream.test.js.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { createKey } from "./support/keys.js";
import { handle } from "../src/router.js";

const { Breaker } = await import("../src/generation.js");

const enc = new TextEncoder();
const dec = new TextDecoder();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "2000", STALL_MS: "2000", MAX_BODY_BYTES: "400000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
    MAX_MODEL_LEN: "8192", ...over,
  };
  env.BREAKER.env = env;
  return env;
}

function ctx() {
  const pending = [];
  return { pending, waitUntil: (p) => pending.push(p), settle: async () => { while (pending.length) await Promise.all(pending.splice(0)); } };
}

/** What the object counted for a key: [requests, prompt, completion] over its usage rows. */
async function counted(env, gen, id) {
  const object = await env.BREAKER.instance(gen);
  const rows = await object.usage({ from: "2000-01-01", to: "2999-12-31", key: id }, { generation: gen });
  return rows.reduce((a, u) => [a[0] + u.requests, a[1] + u.prompt_tokens, a[2] + u.completion_tokens], [0, 0, 0]);
}

// vLLM's events with continuous usage (0.32, seen here): the role-only first event with the
// prompt's tokens, one event per token with the count so far, the last usage event.
const head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m"';
const usage = (p, c) => `"usage":{"prompt_tokens":${p},"total_tokens":${p + c},"completion_tokens":${c}}`;
const roleEvent = (p, i = 0) => `data: ${head},"choices":[{"index":${i},"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],${usage(p, 0)}}\n\n`;
const tokenEvent = (p, c, text, i = 0) => `data: ${head},"choices":[{"index":${i},"delta":{"content":${JSON.stringify(text)}},"logprobs":null,"finish_reason":null}],${usage(p, c)}}\n\n`;
const lastEvent = (p, c) => `data: ${head},"choices":[],${usage(p, c)}}\n\n`;

/** A pod that streams `tokens` events `gapMs` apart with continuous usage, and stops when its request is aborted. */
function pod({ prompt = 40, tokens = 50, gapMs = 20, firstMs = 0, made = { events: 0, aborted: false }, asked = () => {} } = {}) {
  return async (url, init) => {
    if (url.endsWith("/metrics")) return new Response("", { status: 404 });
    if (url.endsWith("/health")) return new Response("");
    if (!url.startsWith("http://pod")) return new Response("{}", { headers: { "content-type": "application/json" } });
    asked();
    const signal = init.signal;
    signal?.addEventListener("abort", () => { made.aborted = true; });
    if (firstMs) await new Promise((resolve, reject) => {
      const timer = setTimeout(resolve, firstMs);
      signal?.addEventListener("abort", () => { clearTimeout(timer); reject(new DOMException("aborted", "AbortError")); });
    });
    const body = JSON.parse(dec.decode(init.body));
    if (!body.stream) { // a short answer is asked whole (router.js WHOLE_MAX_TOKENS)
      return new Response(JSON.stringify({ choices: [{ message: { content: "ok" } }], usage: { prompt_tokens: prompt, completion_tokens: tokens } }),
        { headers: { "content-type": "application/json" } });
    }
    let i = 0;
    return new Response(new ReadableStream({
      async pull(c) {
        if (signal?.aborted) {
          c.error(new DOMException("aborted", "AbortError"));
          return;
        }
        if (i > 0) await sleep(gapMs);
        if (i === 0) c.enqueue(enc.encode(roleEvent(prompt)));
        else if (i <= tokens) c.enqueue(enc.encode(tokenEvent(prompt, i, `t${i} `)));
        else {
          c.enqueue(enc.encode(lastEvent(prompt, tokens) + "data: [DONE]\n\n"));
          c.close();
        }
        made.events = i;
        i++;
      },
      cancel() {
        made.aborted = true; // the router closed the connection: vLLM aborts the request
      },
    }), { headers: { "content-type": "text/event-stream" } });
  };
}

function post(key, body, signal = undefined, path = "/v1/chat/completions") {
  return new Request(`https://w.test${path}`, { method: "POST", body: JSON.stringify(body), signal,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" } });
}
const msg = [{ role: "user", content: "hi" }];

test("a stream cut mid-way is charged what the pod reported, not four characters a token", async () => {
  const env = envFor("h-cut");
  const { key, id } = await createKey(env.BREAKER, "h-cut");
  const c = ctx();
  // 7,000 digits: 7,034 tokens for Qwen's tokenizer, 1,758 by four characters a token
  const made = { events: 0, aborted: false };
  const r = await handle(post(key, { model: "m", messages: [{ role: "user", content: "7".repeat(7000) }], stream: true, max_tokens: 200 }),
    env, c, { fetch: pod({ prompt: 7034, tokens: 200, made }) });
  const reader = r.body.getReader();
  let text = "";
  while ((text.match(/"content":"t/g) || []).length < 10) text += dec.decode((await reader.read()).value);
  assert.ok(!text.includes('"usage"'), "no usage on the client's events");
  await reader.cancel(new Error("gone"));
  await c.settle();
  const [requests, prompt, completion] = await counted(env, "h-cut", id);
  assert.equal(requests, 1);
  assert.equal(prompt, 7034);
  assert.ok(completion >= 10 && completion <= made.events, `${completion} of ${made.events} made`);
});

test("a hang-up while the pod has not answered: the pod's request is aborted, the ceiling charged, the slot free at once", async () => {
  const env = envFor("h-first");
  const { key, id } = await createKey(env.BREAKER, "h-first", { max_parallel: 1 });
  const c = ctx();
  const made = { events: 0, aborted: false };
  const ac = new AbortController();
  const body = { model: "m", messages: msg, stream: true, max_tokens: 100 };
  let asked;
  const pending = handle(post(key, body, ac.signal), env, c, { fetch: pod({ firstMs: 1500, made, asked: () => asked() }) });
  await new Promise((resolve) => { asked = resolve; });
  await sleep(20);
  ac.abort();
  assert.equal(made.aborted, true, "the pod's request is aborted with the client's");
  // the slot is free: the next request is admitted (max_parallel 1) and served
  const next = await handle(post(key, { ...body, stream: false, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(next.status, 200);
  await pending.catch(() => {});
  await c.settle();
  const [requests, prompt, completion] = await counted(env, "h-first", id);
  // nothing was known of the first one: its ceiling (the body's bytes, and max_tokens), plus what the second reported
  assert.equal(requests, 2);
  assert.equal(prompt, JSON.stringify(body).length + 40);
  assert.equal(completion, 100 + 5);
});

test("a hang-up while a non-streamed answer is assembled: the pod stops, what it made is charged, the slot is free", async () => {
  const env = envFor("h-assemble");
  const { key, id } = await createKey(env.BREAKER, "h-assemble", { max_parallel: 1 });
  const c = ctx();
  const made = { events: 0, aborted: false };
  const ac = new AbortController();
  const pending = handle(post(key, { model: "m", messages: msg, max_tokens: 6000 }, ac.signal), env, c,
    { fetch: pod({ prompt: 30, tokens: 6000, gapMs: 5, made }) });
  while (made.events < 60) await sleep(10);
  ac.abort();
  const at = made.events;
  await pending.catch(() => {});
  await c.settle();
  assert.ok(made.aborted && made.events <= at + 2, `the pod went on to ${made.events} after ${at}`);
  const [requests, prompt, completion] = await counted(env, "h-assemble", id);
  assert.equal(requests, 1);
  assert.equal(prompt, 30);
  assert.ok(Math.abs(completion - at) <= 0.05 * at + 2, `charged ${completion}, the pod made ${at}`);
  const next = await handle(post(key, { model: "m", messages: msg, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(next.status, 200);
});

test("a hang-up mid-stream: the pod stops at once, the pod's count is charged, the slot is free", async () => {
  const env = envFor("h-stream");
  const { key, id } = await createKey(env.BREAKER, "h-stream", { max_parallel: 1 });
  const c = ctx();
  const made = { events: 0, aborted: false };
  const ac = new AbortController();
  const r = await handle(post(key, { model: "m", messages: msg, stream: true, max_tokens: 500, stream_options: { include_usage: true } }, ac.signal),
    env, c, { fetch: pod({ prompt: 12, tokens: 500, gapMs: 10, made }) });
  const reader = r.body.getReader();
  while (made.events < 30) await reader.read();
  // the client's connection is gone: the runtime errors its stream and fires the request's abort signal
  reader.cancel(new Error("client_gone")).catch(() => {});
  ac.abort();
  await sleep(20);
  const next = await handle(post(key, { model: "m", messages: msg, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(next.status, 200, "the slot was freed on the hang-up");
  await c.settle();
  assert.ok(made.aborted && made.events < 60, `the pod made ${made.events}`);
  const [requests, prompt, completion] = await counted(env, "h-stream", id);
  assert.equal(requests, 2);
  assert.equal(prompt, 12 + 40);
  assert.ok(completion - 5 >= 28 && completion - 5 <= made.events, `charged ${completion - 5}, the pod made ${made.events}`);
});

test("a hang-up while the fallback works: its request is aborted and the ceiling is charged at the fallback's price", async () => {
  const env = envFor("h-fallback", { POD_URLS: "[]", FALLBACK_PRICE: '{"input":1,"output":1}' });
  const { key, id } = await createKey(env.BREAKER, "h-fallback", { max_parallel: 1 });
  const c = ctx();
  let aborted = false;
  let asked;
  const f = async (url, init) => new Promise((resolve, reject) => {
    if (!url.startsWith("https://fb.test")) return resolve(new Response("{}", { headers: { "content-type": "application/json" } }));
    asked();
    const timer = setTimeout(() => resolve(new Response("{}", { headers: { "content-type": "application/json" } })), 2000);
    init.signal?.addEventListener("abort", () => { clearTimeout(timer); aborted = true; reject(new DOMException("aborted", "AbortError")); });
  });
  const ac = new AbortController();
  const body = { model: "m", messages: msg, max_tokens: 50 };
  const pending = handle(post(key, body, ac.signal), env, c, { fetch: f });
  await new Promise((resolve) => { asked = resolve; });
  ac.abort();
  await pending.catch(() => {});
  await c.settle();
  assert.equal(aborted, true);
  assert.deepEqual(await counted(env, "h-fallback", id), [1, JSON.stringify(body).length, 50]);
});

test("the fallback's usage is counted as it reports it, past the pods' context, within the body's bytes", async () => {
  const env = envFor("h-fbusage", { POD_URLS: "[]" });
  const { key, id } = await createKey(env.BREAKER, "h-fbusage");
  const c = ctx();
  const prompt = "word ".repeat(24_000); // 120 KB: about 24,000 tokens, where a pod serves 8,192
  const answer = (p, done = 5) => async () => new Response(JSON.stringify({ choices: [{ message: { content: "ok" } }],
    usage: { prompt_tokens: p, completion_tokens: done } }), { headers: { "content-type": "application/json" } });
  await handle(post(key, { model: "m", messages: [{ role: "user", content: prompt }], max_tokens: 10 }), env, c, { fetch: answer(24_003) });
  await c.settle();
  assert.deepEqual(await counted(env, "h-fbusage", id), [1, 24_003, 5]);
  // a hostile or broken upstream is believed up to the body's bytes and max_tokens
  const body = { model: "m", messages: msg, max_tokens: 10 };
  await handle(post(key, body), env, c, { fetch: answer(1e12, 1e12) });
  await c.settle();
  assert.deepEqual(await counted(env, "h-fbusage", id), [2, 24_003 + JSON.stringify(body).length, 15]);
});

test("a hang-up while a second pod is tried: that pod's request is aborted, the ceiling charged, the slot free", async () => {
  const env = envFor("h-retry", { POD_URLS: '["http://pod.test/a","http://pod.test/b"]' });
  const { key, id } = await createKey(env.BREAKER, "h-retry", { max_parallel: 1 });
  const c = ctx();
  const made = { events: 0, aborted: false };
  let asked;
  const slow = pod({ firstMs: 1500, made, asked: () => asked() });
  // whichever pod is picked first fails at once (a 503 before any token); the other is slow to start
  let first = null;
  const f = async (url, init) => {
    if (url.startsWith("http://pod.test/") && !url.endsWith("/metrics") && !url.endsWith("/health")) {
      first ??= url.slice(0, 17);
      if (url.startsWith(first)) return new Response("busy", { status: 503 });
    }
    return slow(url, init);
  };
  const ac = new AbortController();
  const body = { model: "m", messages: msg, stream: true, max_tokens: 100 };
  const pending = handle(post(key, body, ac.signal), env, c, { fetch: f });
  await new Promise((resolve) => { asked = resolve; });
  ac.abort();
  assert.equal(made.aborted, true, "the second pod's request is aborted with the client's");
  const next = await handle(post(key, { model: "m", messages: msg, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(next.status, 200);
  await pending.catch(() => {});
  await c.settle();
  assert.deepEqual(await counted(env, "h-retry", id), [2, JSON.stringify(body).length + 40, 100 + 5]);
});

test("a hang-up during the upload: the slot taken before the body is freed at once, and nothing is charged", async () => {
  const env = envFor("h-upload", { BODY_TIMEOUT_MS: "60000" });
  const { key, id } = await createKey(env.BREAKER, "h-upload", { max_parallel: 1 });
  const c = ctx();
  const ac = new AbortController();
  // Half a body, then nothing: the runtime holds the read open until the client's connection goes.
  const half = enc.encode(JSON.stringify({ model: "m", messages: [{ role: "user", content: "x".repeat(20_000) }] }).slice(0, 10_000));
  let uploading;
  const upload = new ReadableStream({ start(ctl) { uploading = ctl; ctl.enqueue(half); } });
  let asked = 0;
  const pending = handle(new Request("https://w.test/v1/chat/completions", { method: "POST", body: upload, duplex: "half", signal: ac.signal,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" } }), env, c,
  { fetch: pod({ asked: () => { asked++; } }) });
  pending.catch(() => {});
  await sleep(50);
  const held = await handle(post(key, { model: "m", messages: msg, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(held.status, 429, "the upload holds the key's one slot");
  ac.abort();
  const next = await handle(post(key, { model: "m", messages: msg, max_tokens: 5 }), env, c, { fetch: pod({ tokens: 5 }) });
  assert.equal(next.status, 200, "the slot was freed on the hang-up");
  await c.settle();
  assert.equal(asked, 0, "no upstream was asked for the abandoned upload");
  assert.deepEqual(await counted(env, "h-upload", id), [1, 40, 5], "only the request served is counted");
  uploading.error(new Error("client gone")); // Node keeps the read (and its body timer) open until the stream ends
  await pending.catch(() => {});
});
