// The router with real answers (docs/worker.md, "Routing" and "Pace"): a non-streamed answer
// assembled from the pod's stream, the deadline on the first token only, stalls after it, a
// pod marked slow by its token rate, and the balancing policies. In Node, against the real
// generation object (test/support/objects.js) and fake pods that stream on a timer.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { withKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { leastBusy, leastLoaded, parseMetrics, unhurried, paceVerdict } from "../src/pods.js";
import { initialPace, recordPace } from "../src/machine.js";

const { Breaker } = await import("../src/generation.js");


function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "300", STALL_MS: "300", MAX_BODY_BYTES: "10000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
    ...over,
  };
  env.BREAKER.env = env;
  return env;
}

function ctx() {
  const pending = [];
  return { pending, waitUntil: (p) => pending.push(p), settle: async () => { while (pending.length) await Promise.all(pending.splice(0)); } };
}

const enc = new TextEncoder();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const chunk = (i, content, extra = "") => `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{${i === 0 ? '"role":"assistant",' : ""}"content":${JSON.stringify(content)}},"logprobs":null,"finish_reason":${extra ? '"stop"' : "null"}}]}\n\n`;
const usageEvent = (p, c) => `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":${p},"total_tokens":${p + c},"completion_tokens":${c}}}\n\n`;

/** A pod stream: `firstMs` before the first event, then `tokens` events `gapMs` apart (0: at once), `stallAfter` events then silence. */
function podStream({ firstMs = 0, tokens = 3, gapMs = 0, stallAfter = Infinity } = {}) {
  let i = 0;
  let silence = null; // a stalled pod's timer: cleared when the router cancels the stream, so no test waits it out
  return new Response(new ReadableStream({
    async pull(c) {
      if (i === 0 && firstMs) await sleep(firstMs);
      else if (i > 0 && gapMs) await sleep(gapMs);
      if (i >= stallAfter) {
        await new Promise((r) => { silence = setTimeout(r, 60_000); }); // a pod that stops sending
        return;
      }
      if (i < tokens) c.enqueue(enc.encode(chunk(i, i === 0 ? "" : `t${i} `, i === tokens - 1 ? "stop" : "")));
      else {
        c.enqueue(enc.encode(usageEvent(5, tokens - 1) + "data: [DONE]\n\n"));
        c.close();
      }
      i++;
    },
    cancel() {
      clearTimeout(silence);
    },
  }), { headers: { "content-type": "text/event-stream" } });
}

function fakeFetch(pod) {
  const seen = [];
  const f = async (url, init = {}) => {
    if (url.endsWith("/metrics")) return new Response("", { status: 404 });
    seen.push({ url, body: init.body ? JSON.parse(new TextDecoder().decode(init.body)) : null });
    if (url.startsWith("http://pod")) return pod(url, init);
    return new Response(JSON.stringify({ served: "fallback" }), { headers: { "content-type": "application/json" } });
  };
  return { f, seen };
}

const post = (key, body) => new Request("https://w.test/v1/chat/completions", {
  method: "POST", body: JSON.stringify(body), headers: { authorization: `Bearer ${key}` },
});
const msg = [{ role: "user", content: "hi" }];

test("a client that asked for no stream is served from the pod's stream, the answer assembled as vLLM writes it", async () => {
  const env = envFor("pace-assemble");
  const key = await withKey(env.BREAKER, "pace-assemble");
  const { f, seen } = fakeFetch(() => podStream({ tokens: 4 }));
  const r = await handle(post(key, { model: "m", messages: msg, stream: false, max_tokens: 50 }), env, ctx(), { fetch: f });
  assert.equal(r.status, 200);
  assert.equal(r.headers.get("content-type"), "application/json");
  assert.equal(seen[0].body.stream, true); // the client's "stream": false replaced
  // usage on every event as well: a client that hangs up is charged what the pod made (podstream.js)
  assert.deepEqual(seen[0].body.stream_options, { include_usage: true, continuous_usage_stats: true });
  const a = await r.json();
  assert.equal(a.object, "chat.completion");
  assert.equal(a.choices[0].message.content, "t1 t2 t3 ");
  assert.equal(a.choices[0].finish_reason, "stop");
  assert.deepEqual(a.usage, { prompt_tokens: 5, total_tokens: 8, completion_tokens: 3, prompt_tokens_details: null,
    completion_tokens_details: null });
});

test("the deadline is the first token's: a long answer past it is the pod's; a first token past it goes to the fallback", async () => {
  // Margins a busy machine keeps: the first event comes at once (well within the deadline),
  // each gap is a tenth of STALL_MS, and the whole answer is 1.5 x the deadline (its pace,
  // 13 tokens a second, is not what this test judges: MIN_TOKENS_PER_S under it).
  const env = envFor("pace-deadline", { STATE_TTL_MS: "50", DEADLINE_MS: "1000", STALL_MS: "1000", MIN_TOKENS_PER_S: "5" });
  const key = await withKey(env.BREAKER, "pace-deadline");
  // 20 events 75 ms apart: ~1.5 s, past DEADLINE_MS, but each token well within STALL_MS.
  const long = fakeFetch(() => podStream({ tokens: 20, gapMs: 75 }));
  const c = ctx();
  for (const stream of [false, true]) {
    const r = await handle(post(key, { model: "m", messages: msg, stream }), env, c, { fetch: long.f });
    assert.equal(r.headers.get("x-colocate-backend"), "pod-0");
    const text = await r.text();
    assert.ok(text.includes("t19 "), text.slice(0, 200));
    assert.ok(!text.includes("error"));
  }
  await c.settle();
  assert.deepEqual((await env.BREAKER.instance("pace-deadline")).view().pods, {}); // no failure counted
  // Headers at once, the first event after the deadline: a miss, served by the fallback.
  const late = fakeFetch(() => podStream({ firstMs: 1600 }));
  const r = await handle(post(key, { model: "m", messages: msg }), env, c, { fetch: late.f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
});

test("a stall after the first token: a streaming client gets an OpenAI-shaped error event, a non-streaming one a 502; both count", async () => {
  const env = envFor("pace-stall", { STALL_MS: "150" });
  const key = await withKey(env.BREAKER, "pace-stall");
  const { f, seen } = fakeFetch(() => podStream({ tokens: 10, stallAfter: 3 }));
  const c = ctx();
  const s = await handle(post(key, { model: "m", messages: msg, stream: true }), env, c, { fetch: f });
  assert.equal(s.status, 200);
  const text = await s.text();
  assert.ok(text.includes("t2 "));
  const last = JSON.parse(text.trim().split("\n\n").at(-1).slice(5));
  assert.equal(last.error.code, "upstream_stalled");
  const j = await handle(post(key, { model: "m", messages: msg }), env, c, { fetch: f });
  assert.equal(j.status, 502);
  assert.equal((await j.json()).error.code, "upstream_stalled");
  assert.equal(seen.filter((x) => x.url.startsWith("https://fb")).length, 0); // never bought again
  await c.settle();
  const row = (await env.BREAKER.instance("pace-stall")).podRow("http://pod.test");
  assert.equal(row.failures, 2); // both stalls are the pod's
  assert.equal(row.state, "closed"); // one key: a health check must agree before it opens
});

test("a pod making tokens below minTokensPerS is marked slow by two keys, and new requests go to the other pod", async () => {
  const env = envFor("pace-slow", { POD_URLS: '["http://pod-a.test", "http://pod-b.test"]', MIN_TOKENS_PER_S: "100", STALL_MS: "1000" });
  const keys = [await withKey(env.BREAKER, "pace-slow"), await withKey(env.BREAKER, "pace-slow")];
  // pod-a: 40 tokens 15 ms apart (< 67 a second); pod-b: 40 tokens at once.
  const { f, seen } = fakeFetch((url) => podStream(url.startsWith("http://pod-a") ? { tokens: 41, gapMs: 15 } : { tokens: 41 }));
  const c = ctx();
  const toA = () => seen.filter((x) => x.url.startsWith("http://pod-a")).length;
  const slowUntil = async () => (await env.BREAKER.instance("pace-slow")).view().slow?.["http://pod-a.test"] ?? 0;
  // Until pod-a is marked slow: FAILURE_THRESHOLD (2) slow answers in a row from both keys
  // (ties are random, so bounded; each round's settle waits for the once-a-second sync).
  for (let i = 0; i < 40 && (await slowUntil()) <= Date.now(); i++) {
    const r = await handle(post(keys[i % 2], { model: "m", messages: msg }), env, c, { fetch: f });
    assert.equal(r.status, 200);
    await r.text();
    await c.settle();
  }
  const view = (await env.BREAKER.instance("pace-slow")).view();
  assert.ok(view.slow && view.slow["http://pod-a.test"] > Date.now(), JSON.stringify(view.slow));
  assert.ok(toA() >= 2, `pod-a served ${toA()}`); // marked by its own answers, not before it served any
  const before = toA();
  for (let i = 0; i < 10; i++) await (await handle(post(keys[i % 2], { model: "m", messages: msg }), env, c, { fetch: f })).text();
  assert.equal(toA(), before); // all ten went to pod-b
  assert.deepEqual(view.pods, {}); // a slow pod's breaker is untouched: it still serves if it is the only one
});

test("pace: one key alone, short answers, or a long answer at a healthy rate never mark a pod slow", () => {
  const cfg = { failureThreshold: 2, openMs: 1000 };
  let p = initialPace();
  for (let i = 0; i < 10; i++) p = recordPace(p, true, 1, cfg, { key: "k1" });
  assert.equal(p.until, 0); // one key
  p = recordPace(p, true, 1, cfg, { key: "k2" });
  assert.equal(p.until, 1001);
  // Too short to judge, however slow; a 10,000-token answer at its rate is "ok".
  assert.equal(paceVerdict({ events: 10, waitMs: 60_000 }, 1, 20), null);
  assert.equal(paceVerdict({ events: 10_001, waitMs: 250_000 }, 1, 20), "ok");
  assert.equal(paceVerdict({ events: 101, waitMs: 10_000 }, 1, 20), "slow");
  assert.equal(paceVerdict({ events: 201, waitMs: 10_000 }, 2, 20), "slow"); // n = 2: 100 tokens a choice
});

test("policies: least_busy counts this isolate; load adds the other isolates and what the pod reports", () => {
  const urls = ["a", "b", "c"];
  const loads = (here, others, pods) => ({ here: (i) => here[i], others: (i) => others[i], pod: (i) => pods[i] });
  const l = loads([1, 2, 3], [5, 0, 0], [null, null, null]);
  assert.equal(leastBusy(urls, [0, 1, 2], l), 0);
  assert.equal(leastLoaded(urls, [0, 1, 2], l), 1);
  // The pod's queue counts even when the cell has sent it nothing: another client's load.
  const m = loads([0, 0, 0], [0, 0, 0], [{ running: 8, waiting: 4, kv: 0.5 }, { running: 2, waiting: 0, kv: 0.3 }, { running: 0, waiting: 0, kv: 0.95 }]);
  assert.equal(leastLoaded(urls, [0, 1, 2], m), 1); // c is idle but its KV cache is full
  assert.equal(leastLoaded(urls, [0, 2], m), 0);
  assert.deepEqual(unhurried(urls, [0, 1, 2], { slow: { b: Date.now() + 1000, c: 0 } }, Date.now()), [0, 2]);
  assert.deepEqual(unhurried(urls, [1], { slow: { b: Date.now() + 1000 } }, Date.now()), [1]); // all slow: still served
});

test("vLLM's /metrics text gives running, waiting and KV-cache use, summed over engines", () => {
  const text = [
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
    'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
    'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0',
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42',
    "vllm:num_preemptions_total 12.0",
  ].join("\n");
  assert.deepEqual(parseMetrics(text), { running: 5, waiting: 7, kv: 0.42 });
  assert.equal(parseMetrics("python_gc_objects_collected_total 1"), null);
});

test("an unknown BALANCE is a configuration error naming the binding", async () => {
  const env = envFor("pace-config", { BALANCE: "fastest" });
  const r = await handle(post("clc_x", { model: "m", messages: msg }), env, ctx(), { fetch: fakeFetch(() => podStream()).f });
  assert.equal(r.status, 500);
  assert.match((await r.json()).error.message, /BALANCE/);
});
