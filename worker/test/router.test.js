// Routing decisions end to end in Node, against the real generation object (generation.js,
// its SQL on SQLite in memory: test/support/objects.js) and a fake fetch. The real runtime
// is covered by tests/test_worker_*.py in workerd.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { withKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { newKey } from "../src/keys.js";
import { parseServerTiming } from "../src/timing.js";
import { blameOf } from "../src/pods.js";

const { Breaker } = await import("../src/generation.js"); // after objects.js registered "cloudflare:workers"

/** A key of generation `gen`, made by the object itself (its createKey, as admin.js calls it). */

/** Pod `url`'s breaker row in the object's storage (absent: closed, no failures). */
async function podRow(env, gen, url) {
  return (await env.BREAKER.instance(gen)).podRow(url);
}

/** Every pod row the object holds, by URL. */
async function podRows(env, gen) {
  return (await env.BREAKER.instance(gen)).view().pods;
}

/** The batches the isolate's syncs carried to the object. */
const synced = (env) => env.BREAKER.calls.filter((c) => c[0] === "sync" && c[3]).map((c) => c[3]);

function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "60000", MAX_BODY_BYTES: "1000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
    ...over,
  };
  env.BREAKER.env = env; // the objects see the Worker's bindings, as in workerd
  return env;
}

function ctx() {
  const pending = [];
  return { pending, waitUntil: (p) => pending.push(p), settle: () => Promise.all(pending.splice(0)) };
}

function fakeFetch(podBehaviour) {
  const seen = [];
  const f = async (url, init = {}) => {
    // The router asks pods for their load now and then (pods.js metricsDue): these pods have no /metrics.
    if (url.endsWith("/metrics")) return new Response("not found", { status: 404 });
    seen.push({ url, auth: new Headers(init.headers).get("authorization"), body: init.body });
    if (url.startsWith("http://pod")) return podBehaviour(init, url);
    return new Response(JSON.stringify({ served: "fallback" }), { headers: { "content-type": "application/json" } });
  };
  return { f, seen };
}

const json = (body = "{}") => new Response(body, { headers: { "content-type": "application/json" } });
const chat = (key) => new Request("https://w.test/v1/chat/completions?x=1", {
  method: "POST", body: JSON.stringify({ model: "m", messages: [{ role: "user", content: "hi" }] }), headers: { authorization: `Bearer ${key}` },
});
const podCalls = (seen) => seen.filter((s) => s.url.startsWith("http://pod")).length;

test("closed: the pod serves with its token; the second request waits on nothing", async () => {
  const env = envFor("router-a");
  const key = await withKey(env.BREAKER, "router-a");
  const c = ctx();
  const { f, seen } = fakeFetch(() => json());
  const r1 = await handle(chat(key), env, c, { fetch: f });
  assert.equal(r1.status, 200);
  assert.equal(r1.headers.get("x-colocate-backend"), "pod-0");
  assert.equal(seen[0].url, "http://pod.test/v1/chat/completions"); // the client's query string stays in the Worker
  assert.equal(seen[0].auth, "Bearer pt"); // the client's key never travels upstream
  assert.deepEqual(env.BREAKER.calls[0], ["get", "router-a", "enam"]);
  const before = env.BREAKER.calls.length;
  const r2 = await handle(chat(key), env, c, { fetch: f });
  assert.equal(parseServerTiming(r2.headers.get("server-timing")).state, 0);
  assert.equal(env.BREAKER.calls.length, before); // fresh cache, healthy pod: no object call at all
});

test("no key, a malformed key, an unknown key: 401 in OpenAI's shape, and the pod is never tried", async () => {
  const env = envFor("router-auth");
  await withKey(env.BREAKER, "router-auth");
  const { f, seen } = fakeFetch(() => json());
  for (const auth of [null, "Bearer prb", "Basic abc", `Bearer ${newKey()}`]) {
    const req = new Request("https://w.test/v1/models", { headers: auth ? { authorization: auth } : {} });
    const r = await handle(req, env, ctx(), { fetch: f });
    assert.equal(r.status, 401, auth);
    const err = (await r.json()).error;
    assert.deepEqual(Object.keys(err).sort(), ["code", "message", "type"]);
    assert.ok(["missing_api_key", "invalid_api_key"].includes(err.code));
  }
  assert.equal(podCalls(seen), 0);
});

test("pod failures fall back, are reported in the background, and open that pod's breaker", async () => {
  const env = envFor("router-b");
  const key = await withKey(env.BREAKER, "router-b");
  const c = ctx();
  const { f, seen } = fakeFetch(() => new Response("boom", { status: 503 }));
  for (let i = 0; i < 2; i++) {
    const r = await handle(chat(key), env, c, { fetch: f });
    assert.equal(r.headers.get("x-colocate-backend"), "fallback");
    assert.equal(r.status, 200);
  }
  await c.settle();
  assert.equal((await podRow(env, "router-b", "http://pod.test")).state, "open");
  const before = podCalls(seen);
  const r = await handle(chat(key), env, c, { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.equal(podCalls(seen), before); // open: pod not tried
  assert.equal(seen.at(-1).auth, "Bearer fk");
});

test("a failing pod is retried once on another healthy pod before the fallback", async () => {
  const env = envFor("router-retry", { STATE_TTL_MS: "100", POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-retry");
  const c = ctx();
  const { f, seen } = fakeFetch((init, url) => (url.startsWith("http://pod-a") ? Promise.reject(new TypeError("refused")) : json()));
  const triedA = () => seen.filter((s) => s.url.startsWith("http://pod-a") && !s.url.endsWith("/health")).length;
  // Ties are broken at random: go on until pod A was picked FAILURE_THRESHOLD (2) times (bounded).
  for (let i = 0; i < 200 && triedA() < 2; i++) {
    const r = await handle(chat(key), env, c, { fetch: f });
    assert.equal(r.headers.get("x-colocate-backend"), "pod-1");
    await c.settle(); // the report of a failure reaches the object before the next pick
  }
  assert.equal(triedA(), 2);
  // One key's failures alone open nothing: the health check that agreed did.
  assert.equal(seen.filter((s) => s.url === "http://pod-a.test/health").length, 1);
  assert.equal((await podRow(env, "router-retry", "http://pod-a.test")).state, "open");
  assert.equal(seen.filter((s) => s.url.startsWith("https://fb")).length, 0);
});

test("requests spread over healthy pods by fewest in flight", async () => {
  const env = envFor("router-spread", { POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-spread");
  await handle(chat(key), env, ctx(), { fetch: fakeFetch(() => json()).f }); // warm the view
  let release;
  const gate = new Promise((r) => { release = r; });
  const { f, seen } = fakeFetch(() => gate.then(() => json()));
  const inflight = [0, 1, 2, 3].map(() => handle(chat(key), env, ctx(), { fetch: f }));
  for (let i = 0; i < 500 && seen.length < 4; i++) await new Promise((r) => setTimeout(r, 5));
  const a = seen.filter((s) => s.url.startsWith("http://pod-a")).length;
  assert.equal(a, 2); // two each: the second request saw pod A busy
  release();
  const backends = (await Promise.all(inflight)).map((r) => r.headers.get("x-colocate-backend")).sort();
  assert.deepEqual(backends, ["pod-0", "pod-0", "pod-1", "pod-1"]);
});

test("a pod that misses the deadline is served by the fallback, with no second pod; a hung pod's health check fails", async () => {
  const env = envFor("router-c", { DEADLINE_MS: "50", POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-c");
  const c = ctx();
  const hang = (init) => new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new Error("aborted"))));
  const { f, seen } = fakeFetch(hang);
  const r = await handle(chat(key), env, c, { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.ok(parseServerTiming(r.headers.get("server-timing")).upstream >= 40);
  assert.equal(podCalls(seen.filter((s) => !s.url.endsWith("/health"))), 1);
  await c.settle();
  // the miss is judged by the pod's health check (busy.js): it hangs too, a failure of no key
  const pods = await podRows(env, "router-c");
  assert.equal(Object.values(pods).reduce((n, p) => n + p.failures, 0), 1);
});

test("usage is counted per key and reaches the object in batched syncs", async () => {
  const env = envFor("router-usage");
  const key = await withKey(env.BREAKER, "router-usage");
  const c = ctx();
  const body = JSON.stringify({ usage: { prompt_tokens: 7, completion_tokens: 5 } });
  const { f } = fakeFetch(() => json(body));
  for (let i = 0; i < 3; i++) await handle(chat(key), env, c, { fetch: f });
  await c.settle(); // one planned flush carries all three
  const batches = synced(env);
  assert.equal(batches.length, 1);
  const rows = batches[0].usage;
  const total = rows.reduce((a, u) => [a[0] + u[2], a[1] + u[3], a[2] + u[4], a[3] + u[5], a[4] + u[6]], [0, 0, 0, 0, 0]);
  assert.deepEqual(total, [3, 21, 15, 3, 0]); // requests, prompt, completion, pod-served, fallback-served
  const win = batches[0].windows.reduce((a, w) => [a[0] + w[2], a[1] + w[3]], [0, 0]);
  assert.deepEqual(win, [3, 36]); // the limit counters: 3 requests, 36 tokens
});

test("a broken namespace and no upstream: a JSON 503, no stack, no secret", async () => {
  const env = envFor("router-d");
  const boom = () => { throw new TypeError("secret pt leaked?"); };
  const r = await handle(chat(newKey()), { ...env, BREAKER: { idFromName: boom, get: boom } }, ctx(), { fetch: boom });
  const body = await r.text();
  assert.equal(r.status, 503);
  assert.equal(r.headers.get("retry-after"), "1");
  assert.equal(JSON.parse(body).error.code, "state_unavailable");
  assert.ok(!body.includes("    at ") && !body.includes("pt leaked"));
});

test("once a stream has started, a pod failure is not retried elsewhere: the client's stream ends with an error event", async () => {
  // (an event stream answering a request that asked for none is read whole, as any answer: forward.js tryPod)
  const env = envFor("router-stream", { POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-stream");
  const enc = new TextEncoder();
  const broken = () => new Response(new ReadableStream({
    start(c) { c.enqueue(enc.encode('data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n')); },
    pull(c) { c.error(new Error("pod died mid-stream")); },
  }), { headers: { "content-type": "text/event-stream" } });
  const { f, seen } = fakeFetch(broken);
  const c = ctx();
  const r = await handle(post(key, { model: "m", messages: [{ role: "user", content: "hi" }], stream: true }), env, c, { fetch: f });
  assert.match(r.headers.get("x-colocate-backend"), /^pod-[01]$/);
  // the stream closes cleanly after what the pod sent and an error in OpenAI's shape (the SDK raises it)
  const events = (await r.text()).trim().split("\n\n");
  assert.match(events[0], /"content":"ab"/);
  assert.deepEqual(JSON.parse(events.at(-1).slice("data: ".length)).error.code, "upstream_broken");
  assert.equal(podCalls(seen), 1);
  await c.settle();
  const rows = await podRows(env, "router-stream");
  assert.equal(Object.values(rows).reduce((a, p) => a + p.failures, 0), 1); // the pod's failure, reported
  // counted: a `cut` row for that pod in the next sync's live histograms
  const cut = synced(env).flatMap((b) => b.hist || []).filter((h) => h[3] === "cut");
  assert.equal(cut.length, 1);
});

test("a client that asked for no stream: a pod stream broken after its first event has sent the client nothing: retried", async () => {
  const env = envFor("router-unasked", { POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-unasked");
  const enc = new TextEncoder();
  const broken = () => new Response(new ReadableStream({
    start(c) { c.enqueue(enc.encode('data: {"id":"x","choices":[{"index":0,"delta":{"content":"abcd"}}]}\n\n')); },
    pull(c) { c.error(new Error("pod died mid-stream")); },
  }), { headers: { "content-type": "text/event-stream" } });
  const { f, seen } = fakeFetch((init, url) => (url.startsWith("http://pod-a") ? broken() : json(JSON.stringify({
    id: "y", object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: "whole" }, finish_reason: "stop" }],
    usage: { prompt_tokens: 3, completion_tokens: 1 } }))));
  const c = ctx();
  let r;
  for (let i = 0; i < 8; i++) { // until the broken pod was asked first (the policy picks either)
    seen.length = 0;
    r = await handle(chat(key), env, c, { fetch: f });
    if (seen[0].url.startsWith("http://pod-a")) break;
  }
  assert.equal(r.status, 200);
  assert.equal(r.headers.get("x-colocate-backend"), "pod-1");
  assert.equal((await r.json()).choices[0].message.content, "whole");
  assert.deepEqual(seen.filter((x) => x.url.includes("/v1/")).map((x) => x.url.slice(0, 12)), ["http://pod-a", "http://pod-b"]);
  assert.equal(seen.filter((x) => x.url.startsWith("https://fb")).length, 0);
  await c.settle();
  const rows = await podRows(env, "router-unasked");
  assert.ok(Object.values(rows).some((p) => p.failures >= 1)); // the broken pod's failure, reported
});

test("a client that asked for no stream: a pod stream that ends before any event is a failure, retried, then the fallback", async () => {
  const env = envFor("router-empty", { POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-empty");
  const { f, seen } = fakeFetch(() => new Response(": keep-alive\n\n", { headers: { "content-type": "text/event-stream" } }));
  const r = await handle(chat(key), env, ctx(), { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.deepEqual(await r.json(), { served: "fallback" });
  assert.equal(seen.filter((x) => x.url.startsWith("http://pod") && x.url.includes("/v1/")).length, 2); // both pods tried
});

// --- hostile clients: streams counted, bad bodies refused, breaker blame ---

const post = (key, body, path = "/v1/chat/completions") => new Request(`https://w.test${path}`, {
  method: "POST", body: typeof body === "string" ? body : JSON.stringify(body), headers: { authorization: `Bearer ${key}` },
});
const msg = [{ role: "user", content: "hi" }];
const sseRes = (text) => new Response(text, { headers: { "content-type": "text/event-stream" } });
const flushed = (env) => synced(env).flatMap((b) => b.usage)
  .reduce((a, u) => [a[0] + u[2], a[1] + u[3] + u[4]], [0, 0]);

test("a stream without include_usage: the pod is asked for usage, the client does not see it, the tokens count", async () => {
  const env = envFor("router-strip");
  const key = await withKey(env.BREAKER, "router-strip");
  const c = ctx();
  const events = 'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n';
  const usage = 'data: {"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":1}}\n\n';
  let sent;
  const { f } = fakeFetch((init) => {
    sent = JSON.parse(new TextDecoder().decode(init.body));
    return sseRes(events + usage + "data: [DONE]\n\n");
  });
  const r = await handle(post(key, { model: "m", messages: msg, stream: true }), env, c, { fetch: f });
  assert.equal(await r.text(), events + "data: [DONE]\n\n");
  assert.deepEqual(sent.stream_options, { include_usage: true, continuous_usage_stats: true });
  await c.settle();
  assert.deepEqual(flushed(env), [1, 7]);
  // A client that asked gets the usage event, as sent
  const asked = await handle(post(key, { model: "m", messages: msg, stream: true, stream_options: { include_usage: true } }), env, c, { fetch: f });
  assert.equal(await asked.text(), events + usage + "data: [DONE]\n\n");
});

test("bad bodies get a 400 naming the field and never reach a pod or the fallback", async () => {
  const env = envFor("router-bad", { MAX_BODY_BYTES: "100000" });
  const key = await withKey(env.BREAKER, "router-bad");
  const { f, seen } = fakeFetch(() => json());
  const deep = `{"model":"m","messages":[{"role":"user","content":"hi"}],"x":${"[".repeat(10000)}${"]".repeat(10000)}}`;
  for (const [body, param] of [[deep, "x"], ['{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e309}', "max_tokens"],
    [{ messages: msg }, "model"], [{ model: "m", prompt: "p", n: 1000000 }, "n"]]) {
    const path = typeof body === "object" && body.prompt ? "/v1/completions" : "/v1/chat/completions";
    const r = await handle(post(key, body, path), env, ctx(), { fetch: f });
    assert.equal(r.status, 400);
    const err = (await r.json()).error;
    assert.deepEqual(Object.keys(err).sort(), ["code", "message", "param", "type"]);
    assert.equal(err.param, param);
    assert.equal(err.type, "invalid_request_error");
  }
  assert.equal(seen.length, 0);
});

test("one key whose requests fail on a pod that is healthy otherwise never opens its breaker", async () => {
  const env = envFor("router-blame", { STATE_TTL_MS: "100" });
  const bad = await withKey(env.BREAKER, "router-blame");
  const good = await withKey(env.BREAKER, "router-blame");
  const c = ctx();
  // The pod fails this one body (a bug it has), answers health checks and everyone else.
  const { f, seen } = fakeFetch((init, url) => (url.endsWith("/health") || !String(new TextDecoder().decode(init.body)).includes("poison")
    ? json() : new Response("crash", { status: 500 })));
  for (let i = 0; i < 6; i++) {
    const r = await handle(post(bad, { model: "m", messages: [{ role: "user", content: "poison" }] }), env, c, { fetch: f });
    assert.equal(r.headers.get("x-colocate-backend"), "fallback"); // the fallback served it: the pod's failure, one key's
    await c.settle();
  }
  const row = await podRow(env, "router-blame", "http://pod.test");
  assert.equal(row.state, "closed");
  assert.equal(row.failures, 6);
  // The witness was asked, with the pod token: the pod's guard opens /health to it alone.
  assert.ok(seen.some((s) => s.url === "http://pod.test/health"));
  assert.ok(seen.filter((s) => s.url.endsWith("/health")).every((s) => s.auth === "Bearer pt"));
  const fallbackBefore = seen.filter((s) => s.url.startsWith("https://fb")).length;
  for (let i = 0; i < 5; i++) assert.equal((await handle(chat(good), env, c, { fetch: f })).headers.get("x-colocate-backend"), "pod-0");
  assert.equal(seen.filter((s) => s.url.startsWith("https://fb")).length, fallbackBefore);
});

test("a request that fails on two pods, or that the fallback refuses too, is not held against a pod", async () => {
  const env = envFor("router-two", { STATE_TTL_MS: "100", POD_URLS: '["http://pod-a.test", "http://pod-b.test"]' });
  const key = await withKey(env.BREAKER, "router-two");
  const key2 = await withKey(env.BREAKER, "router-two");
  const c = ctx();
  const f = async (url) => {
    if (url.endsWith("/health")) return json();
    if (url.startsWith("http://pod")) return new Response("crash", { status: 500 });
    return new Response('{"error":{"message":"bad"}}', { status: 400, headers: { "content-type": "application/json" } });
  };
  for (const k of [key, key2, key, key2]) {
    const r = await handle(chat(k), env, c, { fetch: f });
    assert.equal(r.status, 400); // the fallback's refusal reaches the client
    await c.settle();
  }
  const pods = await podRows(env, "router-two");
  assert.deepEqual(pods, {}); // no failure counted on either pod
  assert.equal(blameOf(2, 200), "request");
  assert.equal(blameOf(1, 200), "pod");
  assert.equal(blameOf(1, 422), "request");
  assert.equal(blameOf(1, 503), "request");
  assert.equal(blameOf(1, 429), "pod");
  assert.equal(blameOf(1, null), "pod");
});

test("max_parallel: a key's requests in flight here are capped with OpenAI's 429; a slot frees when its answer is done", async () => {
  const env = envFor("router-parallel", { FAILURE_THRESHOLD: "100" });
  const key = await withKey(env.BREAKER, "router-parallel", { max_parallel: 2 });
  // Each request's pod answer waits for its own gate, opened by the request's name: the
  // requests reach the pod in whatever order the key's look-up and the schedule give them.
  const gates = new Map();
  const { f } = fakeFetch((init) => new Promise((resolve) => {
    gates.set(JSON.parse(new TextDecoder().decode(init.body)).messages[0].content, () => resolve(json()));
  }));
  const named = (name) => post(key, { model: "m", messages: [{ role: "user", content: name }] });
  const atPod = async (...names) => {
    for (let i = 0; i < 2000 && !names.every((n) => gates.has(n)); i++) await new Promise((r) => setTimeout(r, 5));
    assert.deepEqual(names.filter((n) => !gates.has(n)), []); // every one reached the pod
  };
  const open = (name) => {
    gates.get(name)();
    gates.delete(name);
  };
  const c = ctx();
  const first = handle(named("first"), env, c, { fetch: f });
  const second = handle(named("second"), env, c, { fetch: f });
  await atPod("first", "second");
  const third = await handle(named("third"), env, c, { fetch: f });
  assert.equal(third.status, 429);
  assert.equal(third.headers.get("retry-after"), "1");
  assert.deepEqual((await third.json()).error, { message: "too many requests in flight: 2 at a time for this key",
    type: "requests", code: "too_many_parallel_requests" });
  open("first");
  assert.equal((await first).status, 200);
  const fourth = handle(named("fourth"), env, c, { fetch: f });
  await atPod("fourth");
  open("second");
  open("fourth");
  assert.equal((await second).status, 200);
  assert.equal((await fourth).status, 200);
  // A failure after admission gives the slot back too (pod and fallback both unreachable).
  const broken = () => Promise.reject(new Error("down"));
  for (let i = 0; i < 3; i++) assert.ok((await handle(named("broken"), env, c, { fetch: broken })).status >= 500);
  const again = handle(named("again"), env, c, { fetch: f });
  const again2 = handle(named("again2"), env, c, { fetch: f });
  await atPod("again", "again2");
  open("again");
  open("again2");
  assert.deepEqual([(await again).status, (await again2).status], [200, 200]);
  await c.settle();
});

test("unknown keys arriving together share look-up calls (the cold isolate's syncs carry no key rows)", async () => {
  const env = envFor("router-lookup");
  const keys = [];
  for (let i = 0; i < 30; i++) keys.push(await withKey(env.BREAKER, "router-lookup"));
  const { f } = fakeFetch(() => json());
  const c = ctx();
  const junk = Array.from({ length: 30 }, () => newKey());
  const all = await Promise.all([...keys, ...junk].map((k) => handle(chat(k), env, c, { fetch: f })));
  assert.deepEqual(all.map((r) => r.status), [...keys.map(() => 200), ...junk.map(() => 401)]);
  const lookups = env.BREAKER.calls.filter((x) => x[0] === "lookupKeys");
  assert.ok(lookups.length <= 3, JSON.stringify(lookups)); // a burst of 2, then one per 250 ms
  // Every digest asked once: by a look-up, or riding on a sync (the object answers it as `found`).
  const riding = env.BREAKER.calls.filter((x) => x[0] === "sync").flatMap((x) => x[2].lookup || []);
  assert.equal(lookups.reduce((n, x) => n + x[2].length, 0) + riding.length, 60);
  assert.equal(new Set([...lookups.flatMap((x) => x[2]), ...riding]).size, 60);
  const before = env.BREAKER.calls.length;
  assert.equal((await handle(chat(keys[7]), env, c, { fetch: f })).status, 200); // held now: not asked again
  assert.equal((await handle(chat(junk[7]), env, c, { fetch: f })).status, 401); // remembered: not asked again
  // The burst's usage flushes may sync meanwhile (later under load); no call asks after a key.
  const asked = env.BREAKER.calls.slice(before).filter((x) => x[0] === "lookupKeys" || (x[0] === "sync" && (x[2] || {}).lookup?.length));
  assert.deepEqual(asked, []);
  await c.settle();
});

test("a key refused again within a second has its 429 held back, so re-sending at once cannot spin the isolate", async (t) => {
  const env = envFor("router-hold");
  const key = await withKey(env.BREAKER, "router-hold", { rpm: 1 });
  const { f } = fakeFetch(() => json());
  const c = ctx();
  assert.equal((await handle(chat(key), env, c, { fetch: f })).status, 200);
  // The first refusal is answered at once: a client that honours Retry-After waits no longer.
  assert.equal((await handle(chat(key), env, c, { fetch: f })).status, 429);
  t.mock.timers.enable({ apis: ["setTimeout"] });
  let answered = null;
  const held = handle(chat(key), env, c, { fetch: f }).then((r) => { answered = r; });
  for (let i = 0; i < 20; i++) await new Promise((resolve) => setImmediate(resolve));
  assert.equal(answered, null); // the second refusal within a second waits for its timer
  t.mock.timers.tick(250);
  await held;
  assert.equal(answered.status, 429);
  assert.equal(answered.headers.get("retry-after") !== null, true);
  t.mock.timers.reset();
  await c.settle();
});

/** A cell of a fleet of two with a key of rpm 10 in it: {object, key, id}. */
async function fleetKey(env, gen) {
  const object = await env.BREAKER.instance(gen);
  await object.setPeers([], { generation: gen, haveRev: -1, isolate: "ledger", keys: [] }, [], 2); // a fleet of two cells
  const key = await withKey(env.BREAKER, gen, { rpm: 10 });
  const id = (await object.listKeys({ generation: gen })).find((k) => k.rpm === 10).id;
  return { object, key, id };
}

test("an isolate asks for a key's counters and lease for SERVED_KEEP_MS after serving it, then forgets them", async (t) => {
  const { cache, sync } = await import("../src/state.js");
  const { readConfig } = await import("../src/config.js");
  const asked = (env) => env.BREAKER.calls.filter((x) => x[0] === "sync").at(-1)[2].keys;
  t.mock.timers.enable({ apis: ["Date"], now: Date.now() }); // the clock moves only when told (timers stay real)
  try {
    for (const [keep, gone] of [[undefined, false], ["5000", true]]) { // absent: 120 s, the default
      const gen = `router-served-keep-${keep}`;
      const env = envFor(gen, keep === undefined ? {} : { SERVED_KEEP_MS: keep });
      const { key, id } = await fleetKey(env, gen);
      const c = ctx();
      const { f } = fakeFetch(() => json());
      assert.equal((await handle(chat(key), env, c, { fetch: f })).status, 200);
      await c.settle();
      t.mock.timers.tick(4999);
      await sync(env, readConfig(env));
      assert.deepEqual(asked(env), [id], keep);
      assert.equal(cache.lease(gen, id).req, 5); // the default share of rpm 10's cap 11 over two cells
      t.mock.timers.tick(1); // idle 5 s: past 5000 ms, well within 120 s
      await sync(env, readConfig(env));
      assert.deepEqual(asked(env), gone ? [] : [id], keep);
      assert.equal(cache.lease(gen, id) === undefined, gone, keep);
    }
  } finally {
    t.mock.timers.reset();
  }
});

test("in a fleet, a held key whose lease this isolate dropped gets its floor share until a sync, started at once, brings the lease back", async () => {
  const gen = "router-fleet-idle-key";
  const env = envFor(gen);
  const { object, key, id } = await fleetKey(env, gen);
  const c = ctx();
  const { f } = fakeFetch(() => json());
  assert.equal((await handle(chat(key), env, c, { fetch: f })).status, 200); // found by a look-up, which carries its lease
  await c.settle();
  // Idle for SERVED_KEEP_MS (2 min), the isolate forgets the key's counters and lease and keeps
  // its row (state.js servedKeys): the next request finds the key held and no lease.
  const { cache } = await import("../src/state.js");
  cache.dropCounts(gen, [id]);
  assert.equal(cache.lease(gen, id), undefined);
  // rpm 10 over two cells: the cap is 11; the ledger may have cut this cell's lease while the
  // isolate did not ask for it, never below the floor share, 1 (fleetexchange.js floorShare),
  // so the isolate admits that much, and asks for the lease at once.
  const syncs = env.BREAKER.calls.filter((x) => x[0] === "sync").length;
  assert.equal((await handle(chat(key), env, c, { fetch: f })).status, 200);
  assert.equal(env.BREAKER.calls.filter((x) => x[0] === "sync").length, syncs + 1); // not the flush a second later
  await c.settle();
  // The lease back (here the default share floor(11 / 2) = 5, no ledger row yet): 5 in all, then refused.
  assert.equal(cache.lease(gen, id).req, 5);
  const statuses = [];
  for (let i = 0; i < 6; i++) statuses.push((await handle(chat(key), env, c, { fetch: f })).status);
  assert.deepEqual(statuses, [200, 200, 200, 429, 429, 429]);
  await c.settle();
});
