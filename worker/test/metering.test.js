// What a request may cost, end to end in Node: the router against the real
// generation object (SQLite in memory, test/support/objects.js) and a fake fetch. The same
// attacks through workerd and the stand-in pod: tests/test_security_metering.py.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { createKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { fallbackFields, validateBody } from "../src/validate.js";
import { addressBucket, takeLookup, takeTotal } from "../src/strangers.js";
import { Recorder, MAX_LABELS } from "../src/histogram.js";
import { tapStream } from "../src/usage.js";

const { Breaker } = await import("../src/generation.js");


function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "2000", MAX_BODY_BYTES: "100000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
    MAX_MODEL_LEN: "8192", ...over,
  };
  env.BREAKER.env = env;
  return env;
}

function ctx() {
  const pending = [];
  return { pending, waitUntil: (p) => pending.push(p), settle: () => Promise.all(pending.splice(0)) };
}

const post = (key, path, body) => new Request(`https://w.test${path}`, {
  method: "POST", body: JSON.stringify(body), headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
});
const usageOf = (prompt, completion) => new Response(JSON.stringify({ choices: [{ text: "x" }], usage: { prompt_tokens: prompt, completion_tokens: completion } }),
  { headers: { "content-type": "application/json" } });

/** What the object counted for a key: [requests, prompt, completion] over its usage rows. */
async function counted(env, gen, id) {
  const object = await env.BREAKER.instance(gen);
  const rows = await object.usage({ from: "2000-01-01", to: "2999-12-31", key: id }, { generation: gen });
  return rows.reduce((a, u) => [a[0] + u.requests, a[1] + u.prompt_tokens, a[2] + u.completion_tokens], [0, 0, 0]);
}

test("a prompt list is counted as prompts x n x max_tokens; past 64 prompts it is refused at the edge", async () => {
  const env = envFor("m-list");
  const { key, id } = await createKey(env.BREAKER, "m-list");
  const c = ctx();
  // a hostile pod claims far more than the request can make: the ceiling holds it
  const f = async () => usageOf(1e12, 1e12);
  const body = { model: "m", prompt: Array(60).fill("a"), max_tokens: 3, n: 2 };
  const r = await handle(post(key, "/v1/completions", body), env, c, { fetch: f });
  assert.equal(r.status, 200);
  await c.settle();
  const [req, , completion] = await counted(env, "m-list", id);
  assert.deepEqual([req, completion], [1, 60 * 2 * 3]);
  const no = await handle(post(key, "/v1/completions", { ...body, prompt: Array(65).fill("a") }), env, c, { fetch: f });
  assert.equal(no.status, 400);
  assert.equal((await no.json()).error.param, "prompt");
});

test("without max_tokens the ceiling is what fits beside the prompt in the pods' context, not 131,072", async () => {
  const env = envFor("m-ctx");
  const { key, id } = await createKey(env.BREAKER, "m-ctx");
  const c = ctx();
  await handle(post(key, "/v1/chat/completions", { model: "m", messages: [{ role: "user", content: "hi" }] }), env, c,
    { fetch: async () => usageOf(1, 1e12) });
  await c.settle();
  assert.equal((await counted(env, "m-ctx", id))[2], 8191); // "hi" is at least one token
});

test("a request the pod refuses is charged what the pod reports (vLLM's 400: nothing), and counts as a request", async () => {
  const env = envFor("m-4xx");
  const { key, id } = await createKey(env.BREAKER, "m-4xx");
  const c = ctx();
  const text = "y".repeat(3998); // JSON of the messages: 3,998 + 39 characters -> 1,010 tokens at four a token
  const messages = [{ role: "user", content: text }];
  const refuse = (status) => async () => new Response(JSON.stringify({ error: { message: "too long" } }), { status,
    headers: { "content-type": "application/json" } });
  const r = await handle(post(key, "/v1/chat/completions", { model: "m", messages }), env, c, { fetch: refuse(400) });
  assert.equal(r.status, 400);
  await handle(post(key, "/v1/chat/completions", { model: "m", messages }), env, c, { fetch: refuse(404) });
  // a server that reports usage with its refusal is believed (within the ceiling)
  const reported = async () => new Response(JSON.stringify({ error: { message: "no" }, usage: { prompt_tokens: 9, completion_tokens: 0 } }),
    { status: 400, headers: { "content-type": "application/json" } });
  await handle(post(key, "/v1/chat/completions", { model: "m", messages }), env, c, { fetch: reported });
  await c.settle();
  assert.deepEqual(await counted(env, "m-4xx", id), [3, 9, 0]);
});

test("a budget hit by 8 requests at once admits only what fits it whole: each request's own most is checked", async () => {
  const env = envFor("m-race");
  const body = { model: "m", prompt: ["a", "b"], max_tokens: 100, n: 4 };
  const most = JSON.stringify(body).length + 2 * 4 * 100; // the body's bytes, and 2 prompts x 4 answers x 100
  const { key, id } = await createKey(env.BREAKER, "m-race", { monthly_tokens: most + 100, max_parallel: 8 });
  const c = ctx();
  let release;
  const gate = new Promise((resolve) => { release = resolve; });
  // every pod answer waits until all 8 have been admitted or refused, then spends all it may
  const f = async () => {
    await gate;
    return usageOf(1e12, 1e12);
  };
  const pending = Array.from({ length: 8 }, () => handle(post(key, "/v1/completions", body), env, c, { fetch: f }));
  await new Promise((resolve) => setTimeout(resolve, 50));
  release();
  const answers = await Promise.all(pending);
  await c.settle();
  const ok = answers.filter((a) => a.status === 200).length;
  assert.equal(ok, 1);
  // refused while the first holds its reservation, or (on a slow machine, arriving after it was
  // metered) for what it used: either way never admitted past the budget
  for (const a of answers.filter((x) => x.status === 429)) assert.match((await a.json()).error.code, /^(tokens_reserved|insufficient_quota)$/);
  const [, prompt, completion] = await counted(env, "m-race", id);
  assert.ok(prompt + completion <= most + 100, String(prompt + completion)); // never past the budget
  // settled: the next request sees the real usage, and what is left cannot hold its most
  const after = await handle(post(key, "/v1/completions", body), env, c, { fetch: f });
  const err = (await after.json()).error;
  assert.equal(after.status, 429);
  assert.equal(err.code, "insufficient_quota");
  assert.match(err.message, new RegExp(`this request may use ${most} tokens and this key has \\d+ of its ${most + 100} left`));
});

test("a request over a limit it could never fit is a 400 naming the limit and the fix, before any pod", async () => {
  const env = envFor("m-never");
  const month = await createKey(env.BREAKER, "m-never", { monthly_tokens: 500 });
  const tpm = await createKey(env.BREAKER, "m-never", { tpm: 600 });
  const tiny = await createKey(env.BREAKER, "m-never", { monthly_tokens: 50 });
  const c = ctx();
  let asked = 0;
  const f = async () => {
    asked += 1;
    return usageOf(10, 10);
  };
  const chat = { model: "m", messages: [{ role: "user", content: "hi" }] }; // no max_tokens: up to the context
  for (const [key, limit, setting] of [[month.key, 500, "monthly_tokens"], [tpm.key, 600, "tpm"]]) {
    const res = await handle(post(key, "/v1/chat/completions", chat), env, c, { fetch: f });
    const err = (await res.json()).error;
    assert.equal(res.status, 400);
    assert.deepEqual([err.code, err.param, err.type], ["request_too_large", "max_tokens", "invalid_request_error"]);
    assert.match(err.message, new RegExp(`may use 8192 tokens .* more than this key's ${limit} .*\\(its ${setting}\\): set max_tokens to at most \\d+`));
  }
  // a budget smaller than the body itself (a prompt token is at most a byte): the prompt is at fault
  const small = await handle(post(tiny.key, "/v1/chat/completions", { ...chat, max_tokens: 1 }), env, c, { fetch: f });
  assert.deepEqual([small.status, (await small.json()).error.param], [400, "messages"]);
  // within the limit once max_tokens says so
  const fits = await handle(post(month.key, "/v1/chat/completions", { ...chat, max_tokens: 5 }), env, c, { fetch: f });
  assert.equal(fits.status, 200);
  assert.equal(asked, 1);
  await c.settle();
});

test("max_completion_tokens on /v1/completions is refused, naming the field and the fix", () => {
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: "hi", max_tokens: 9, max_completion_tokens: 1 }, 8192),
    (e) => e.param === "max_completion_tokens" && /send max_tokens instead/.test(e.message));
  // chat honours it: allowed
  validateBody("/v1/chat/completions", { model: "m", messages: [{ role: "user", content: "hi" }], max_completion_tokens: 1 }, 8192);
});

test("what could never fit the context is refused before a pod tokenises it", () => {
  const big = { model: "m", prompt: "x".repeat(900_000) };
  assert.throws(() => validateBody("/v1/completions", big, 8192), (e) => e.param === "prompt" && e.code === "context_length_exceeded");
  // vLLM refuses a limit past the context and cuts any other to what fits (its 200): so does the edge
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: "hi", max_tokens: 8193 }, 8192),
    (e) => e.param === "max_tokens" && e.status === 400);
  validateBody("/v1/completions", { model: "m", prompt: "hi", max_tokens: 8192 }, 8192);
  validateBody("/v1/completions", { model: "m", prompt: "x".repeat(16 * 8000), max_tokens: 8192 }, 8192);
  assert.throws(() => validateBody("/v1/chat/completions", { model: "m", messages: [{ role: "user", content: "hi" }], max_completion_tokens: 8193 },
    8192), (e) => e.param === "max_completion_tokens");
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: Array(8192).fill(5) }, 8192), (e) => e.param === "prompt");
  validateBody("/v1/completions", { model: "m", prompt: Array(8191).fill(5) }, 8192);
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: "hi", prompt_logprobs: 5 }, 8192), (e) => e.param === "prompt_logprobs");
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: "hi", echo: true, logprobs: 1 }, 8192), (e) => e.param === "logprobs");
  validateBody("/v1/completions", { model: "m", prompt: "hi", echo: true }, 8192);
  const schema = { type: "object", description: "z".repeat(40_000) };
  assert.throws(() => validateBody("/v1/chat/completions", { model: "m", messages: [{ role: "user", content: "hi" }],
    response_format: { type: "json_schema", json_schema: { name: "s", schema } } }, 8192), (e) => e.param === "response_format");
  assert.throws(() => validateBody("/v1/completions", { model: "m", prompt: "hi", guided_json: schema }, 8192), (e) => e.param === "guided_json");
});

test("the fallback gets only the allowlisted fields, plus those the operator allows", async () => {
  const chat = { model: "m", messages: [{ role: "user", content: "hi" }], store: true, metadata: { a: "b" }, service_tier: "priority",
    temperature: 0.5, top_k: 4 };
  const { json, dropped } = fallbackFields("/v1/chat/completions", chat);
  assert.deepEqual(dropped, ["metadata", "service_tier", "store", "top_k"]);
  assert.deepEqual(Object.keys(json).sort(), ["messages", "model", "temperature"]);
  assert.deepEqual(fallbackFields("/v1/chat/completions", chat, ["store", "metadata"]).dropped, ["service_tier", "top_k"]);
  // through the router: the pod (ours) gets the body unchanged, the fallback the allowlist
  const env = envFor("m-fb", { POD_URLS: "[]", FALLBACK_FIELDS: '["metadata"]' });
  const { key } = await createKey(env.BREAKER, "m-fb");
  const seen = [];
  const f = async (url, init) => {
    seen.push(JSON.parse(new TextDecoder().decode(init.body)));
    return usageOf(1, 1);
  };
  const r = await handle(post(key, "/v1/chat/completions", chat), env, ctx(), { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.deepEqual(Object.keys(seen[0]).sort(), ["messages", "metadata", "model", "temperature"]);
});

test("a client that leaves a usage stream is counted from what the tee holds, not its prompt alone", async () => {
  // 8 tokens arrive at once; the usage event never does (the client leaves first)
  const events = Array.from({ length: 8 }, (_, i) => `data: {"choices":[{"delta":{"content":"tok${i}"}}]}\n\n`).join("");
  const body = new ReadableStream({
    start(c) { c.enqueue(new TextEncoder().encode(events)); },
    pull() { return new Promise(() => {}); }, // then stalls
  });
  const seen = [];
  const tap = tapStream(body, true, (u) => seen.push(u), (chars) => ({ prompt: 5, completion: Math.ceil(chars / 4), estimated: true }));
  const reader = tap.body.getReader();
  await reader.read();
  await reader.cancel("client left");
  await tap.piped;
  assert.deepEqual(seen, [{ prompt: 5, completion: 8, estimated: true }]); // "tokI" x 8 = 32 characters
});

test("guessed keys: an IPv6 /64 is one budget, and the isolate has a total", () => {
  assert.equal(addressBucket("2001:db8:1:2:aaaa::1"), addressBucket("2001:db8:1:2:ffff:ffff:ffff:ffff"));
  assert.notEqual(addressBucket("2001:db8:1:3::1"), addressBucket("2001:db8:1:2::1"));
  const t = 1e12;
  let refused = null;
  for (let i = 0; i < 200 && refused === null; i++) {
    try {
      takeLookup(`2001:db8:9:9:${i.toString(16)}::1`, t); // a new address each time, one /64
    } catch (err) {
      refused = i;
    }
  }
  assert.equal(refused, 100);
  let total = null;
  for (let i = 0; i < 2000 && total === null; i++) {
    try {
      takeTotal(t); // every address together
    } catch (err) {
      total = err.message;
    }
  }
  assert.match(total, /at this edge/);
});

test("live-view labels are bounded per minute: past the bound a client colo folds into its pod", () => {
  const r = new Recorder();
  const t = 60_000 * 1000;
  const timing = { state: 0, upstream: 1, fallback: 0, total: 1 };
  for (let i = 0; i < MAX_LABELS + 100; i++) r.request(t, `0@X${i}`, timing);
  const rows = r.take("TST");
  const labels = new Set(rows.map((row) => row[2]));
  assert.equal(labels.size, MAX_LABELS + 1); // MAX_LABELS labels, and "0" for the rest
  assert.ok(labels.has("0"));
});

test("a reservation reaches the other isolates with the next sync, and goes when it settles", async () => {
  const { COUNTER, INFLIGHT } = await import("../src/payloads.js");
  const env = envFor("m-iso");
  const { id } = await createKey(env.BREAKER, "m-iso", { monthly_tokens: 50 });
  const object = await env.BREAKER.instance("m-iso");
  const info = (isolate) => ({ generation: "m-iso", isolate, keys: [id], ttlMs: 2000, haveRev: -1 });
  const row = (n, tokens) => {
    const r = INFLIGHT.zero(id);
    r[INFLIGHT.n] = n;
    r[INFLIGHT.tokens] = tokens;
    return r;
  };
  await object.sync(info("iso_a"), { inflight: [row(1, 700)] });
  assert.equal((await object.sync(info("iso_b"), null)).counts[id][COUNTER.reserved], 700);
  assert.equal((await object.sync(info("iso_a"), null)).counts[id]?.[COUNTER.reserved] ?? 0, 0); // its own is not added back
  await object.sync(info("iso_a"), { inflight: [row(0, 0)] });
  assert.equal((await object.sync(info("iso_b"), null)).counts[id]?.[COUNTER.reserved] ?? 0, 0);
});

test("a flush whose sync fails is tried again: an isolate that gets no further request still delivers its usage", async () => {
  const env = envFor("m-retry", { STATE_TTL_MS: "200" }); // flushes 100 ms after a request
  const { key, id } = await createKey(env.BREAKER, "m-retry");
  const c = ctx();
  const r = await handle(post(key, "/v1/completions", { model: "m", prompt: "a", max_tokens: 3 }), env, c, { fetch: async () => usageOf(2, 3) });
  assert.equal(r.status, 200);
  // the object is unreachable for the flush's first two tries (a reset, a failed round trip)
  const object = await env.BREAKER.instance("m-retry");
  const sync = object.sync.bind(object);
  let failures = 2;
  object.sync = async (...args) => {
    if (failures > 0) {
      failures--;
      throw new Error("Durable Object reset because its code was updated");
    }
    return sync(...args);
  };
  await c.settle(); // no other request comes
  assert.equal(failures, 0);
  assert.deepEqual(await counted(env, "m-retry", id), [1, 2, 3]);
});
