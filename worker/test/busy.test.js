// Busy is not broken: a first-token deadline miss is judged by the pod's health check
// and its queue (busy.js), a key's prompts not yet begun are bounded (max_parallel_tokens), and
// a short answer behind a queue is judged by its first token. Against the real generation
// object (support/objects.js) and a fake fetch; in workerd: tests/test_busy_pods.py.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { createKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { missVerdict, podBusy } from "../src/busy.js";
import { begunAt, putMetrics, queuedAt } from "../src/pods.js";
import { NO_ASK, mostTokens, neverFits, refusal } from "../src/limits.js";

const { Breaker } = await import("../src/generation.js");

function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "100", MAX_BODY_BYTES: "100000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
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

const post = (key, body) => new Request("https://w.test/v1/chat/completions", {
  method: "POST", body: JSON.stringify(body), headers: { authorization: `Bearer ${key}` },
});
const chat = (content, max_tokens = 50) => ({ model: "m", messages: [{ role: "user", content }], max_tokens });
const fallback = () => new Response(JSON.stringify({ choices: [], usage: { prompt_tokens: 1, completion_tokens: 1 } }),
  { headers: { "content-type": "application/json" } });
const hang = (init) => new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new Error("aborted"))));
const cfg = { deadlineMs: 50, podToken: "pt" };

test("a miss is broken when the health check fails, busy behind a queue, idle otherwise", async () => {
  const up = async () => new Response("");
  assert.equal(await missVerdict(cfg, "http://v1.test", 0, async () => new Response("", { status: 503 })), "broken");
  assert.equal(await missVerdict(cfg, "http://v2.test", 2, up), "busy"); // this isolate's requests waited there first
  putMetrics("http://v3.test", "vllm:num_requests_waiting{engine=\"0\"} 3.0\nvllm:num_requests_running{engine=\"0\"} 40.0\n", Date.now());
  assert.equal(await missVerdict(cfg, "http://v3.test", 0, up), "busy"); // the pod's own word
  assert.equal(await missVerdict(cfg, "http://v4.test", 0, async (url) => (url.endsWith("/metrics")
    ? new Response("vllm:num_requests_waiting 0\n") : new Response(""))), "idle");
  // a pod that says nothing of its queue and answers its health check: idle, as before
  assert.equal(await missVerdict(cfg, "http://v5.test", 0, async (url) => new Response("", { status: url.endsWith("/metrics") ? 404 : 200 })), "idle");
});

test("the miss's health check carries the pod token: the pod's guard answers 401 without it", async () => {
  // As colocate_pod_guard.py: /health and /metrics open to the pod token only.
  const guarded = async (url, init) => (init?.headers?.authorization === "Bearer pt"
    ? new Response(url.endsWith("/metrics") ? "vllm:num_requests_waiting 4\n" : "")
    : new Response('{"error":"Unauthorized"}', { status: 401 }));
  assert.equal(await missVerdict(cfg, "http://g1.test", 0, guarded), "busy");
  assert.equal(await missVerdict(cfg, "http://g2.test", 1, guarded), "busy");
});

test("a pod is busy while this isolate's requests there wait for their first token", () => {
  const url = "http://q.test";
  assert.equal(podBusy(url, Date.now()), false);
  assert.equal(queuedAt(url), 0);
  assert.equal(queuedAt(url), 1);
  assert.equal(podBusy(url, Date.now()), true);
  begunAt(url);
  begunAt(url);
  assert.equal(podBusy(url, Date.now()), false);
});

test("two keys' deadline misses behind a queue, with the pod's health answering, are no failure of the pod", async () => {
  const env = envFor("busy-a");
  const keys = [await createKey(env.BREAKER, "busy-a", { max_parallel_tokens: 0 }), await createKey(env.BREAKER, "busy-a",
    { max_parallel_tokens: 0 })];
  const c = ctx();
  const f = async (url, init = {}) => {
    if (url.endsWith("/metrics")) return new Response("not found", { status: 404 });
    if (url.endsWith("/health")) return new Response("");
    if (url.startsWith("http://pod")) return hang(init);
    return fallback();
  };
  const answers = await Promise.all(Array.from({ length: 6 }, (_, i) => handle(post(keys[i % 2].key, chat("hi")), env, c, { fetch: f })));
  assert.deepEqual(answers.map((a) => a.headers.get("x-colocate-backend")), Array(6).fill("fallback"));
  await c.settle();
  const pod = (await env.BREAKER.instance("busy-a")).podRow("http://pod.test");
  // at most the first, sent to an idle pod, is the pod's: never two keys, never open
  assert.ok(pod === null || (pod.state === "closed" && pod.failures <= 1), JSON.stringify(pod));
});

test("a short answer behind a queue is asked as a stream and judged by its first token, not its whole time", async () => {
  const env = envFor("busy-b", { DEADLINE_MS: "300", MIN_TOKENS_PER_S: "1000" });
  const { key } = await createKey(env.BREAKER, "busy-b", { max_parallel_tokens: 0 });
  const c = ctx();
  const asked = [];
  let release;
  const slow = new Promise((resolve) => { release = resolve; });
  const sse = (tokens, gapMs) => new Response(new ReadableStream({
    async pull(ctl) {
      const i = (ctl.i = (ctl.i ?? -1) + 1);
      if (i > 0) await new Promise((r) => setTimeout(r, gapMs));
      if (i < tokens) ctl.enqueue(new TextEncoder().encode(`data: {"choices":[{"index":0,"delta":{"content":"w"}}]}\n\n`));
      else {
        ctl.enqueue(new TextEncoder().encode('data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8}}\n\ndata: [DONE]\n\n'));
        ctl.close();
      }
    },
  }), { headers: { "content-type": "text/event-stream" } });
  const f = async (url, init = {}) => {
    if (url.endsWith("/metrics") || url.endsWith("/health")) return new Response("", { status: 404 });
    if (!url.startsWith("http://pod")) return fallback();
    const body = JSON.parse(new TextDecoder().decode(init.body));
    asked.push(body.stream === true);
    if (asked.length === 1) {
      await slow; // the first request holds the pod's queue: its first token comes late
      return sse(1, 0);
    }
    return sse(8, 60); // 8 tokens a busy pod makes slowly: 480 ms, past the whole-answer budget (300 + 8 ms)
  };
  const first = handle(post(key, chat("long", 1)), env, c, { fetch: f });
  await new Promise((r) => setTimeout(r, 20));
  const second = await handle(post(key, chat("hi", 8)), env, c, { fetch: f });
  assert.equal(second.headers.get("x-colocate-backend"), "pod-0");
  assert.equal((await second.json()).choices[0].message.content, "wwwwwwww");
  assert.deepEqual(asked, [false, true]); // asked whole of an idle pod, as a stream behind a queue
  release();
  await first;
  await c.settle();
});

test("admission: this request's own most against tpm and the month; a prompt over max_parallel_tokens never fits", () => {
  const t = Date.UTC(2026, 5, 10, 12, 0, 30);
  const zero = { req: 0, tok: 0, prevReq: 0, curReq: 0, prevTok: 0, curTok: 0 };
  const key = (over) => ({ rpm: 0, tpm: 0, monthly_tokens: 0, max_parallel: 0, ...over });
  // the issue's keys: a 50-token month, a 200-token minute, asked 24,207 and 1,535
  assert.match(neverFits(key({ monthly_tokens: 50 }), { ...NO_ASK, tokens: 24_207, prompt: 16_015 }, { prompt: "x" }).message,
    /more than this key's 50 tokens a month \(its monthly_tokens\): send a shorter prompt/);
  const tpm = neverFits(key({ tpm: 200 }), { ...NO_ASK, tokens: 1_535, prompt: 100 }, { messages: [] });
  assert.deepEqual([tpm.param, /set max_tokens to at most 100/.test(tpm.message)], ["max_tokens", true]);
  // fits alone, not beside what was used this minute: 429 with when the window admits it
  const used = { ...zero, tok: 150, curTok: 150 };
  const no = refusal(key({ tpm: 200 }), used, 0, t, 0, 0, { ...NO_ASK, tokens: 100 });
  assert.deepEqual([no.type, no.code], ["tokens", "rate_limit_exceeded"]);
  assert.ok(no.retryAfterS >= 1 && no.retryAfterS <= 60);
  assert.equal(refusal(key({ tpm: 200 }), used, 0, t, 0, 0, { ...NO_ASK, tokens: 50 }), null);
  // beside what requests in flight reserved: those settle within a second or so
  assert.equal(refusal(key({ tpm: 200 }), zero, 0, t, 0, 150, { ...NO_ASK, tokens: 100 }).code, "tokens_reserved");
  // the month: what is left, named, and the month's end to wait for
  const month = refusal(key({ monthly_tokens: 1000 }), zero, 950, t, 0, 0, { ...NO_ASK, tokens: 100 });
  assert.deepEqual([month.code, /has 50 of its 1000 left this month/.test(month.message)], ["insufficient_quota", true]);
  // max_parallel_tokens: the key's prompts not yet begun, with this one's
  const mpt = { ...NO_ASK, promptLimit: 8192 };
  assert.equal(refusal(key({}), zero, 0, t, 0, 0, { ...mpt, prompt: 5000, promptInflight: 3000 }), null);
  assert.equal(refusal(key({}), zero, 0, t, 0, 0, { ...mpt, prompt: 5000, promptInflight: 3193 }).code, "too_many_parallel_tokens");
  assert.equal(refusal(key({}), zero, 0, t, 0, 0, { ...mpt, promptInflight: 8192 }).code, "too_many_parallel_tokens"); // before the body
  assert.equal(neverFits(key({}), { ...mpt, prompt: 8193 }, { messages: [] }).param, "messages");
  // a request's most is its ceiling, and never more than a context per prompt and answer
  assert.equal(mostTokens({ messages: [] }, { prompt: 300, completion: 8192 }, 8192), 8192);
  assert.equal(mostTokens({ prompt: ["a", "b"], n: 2 }, { prompt: 100, completion: 400 }, 8192), 500);
});

test("a key's prompts not yet begun reach the other isolates with the next sync, and go when they begin", async () => {
  const { COUNTER, INFLIGHT } = await import("../src/payloads.js");
  const env = envFor("busy-iso");
  const { id } = await createKey(env.BREAKER, "busy-iso", { max_parallel_tokens: 8192 });
  const object = await env.BREAKER.instance("busy-iso");
  const info = (isolate) => ({ generation: "busy-iso", isolate, keys: [id], ttlMs: 2000, haveRev: -1 });
  const row = (n, prompt) => {
    const r = INFLIGHT.zero(id);
    r[INFLIGHT.n] = n;
    r[INFLIGHT.prompt] = prompt;
    return r;
  };
  await object.sync(info("iso_a"), { inflight: [row(1, 5000)] });
  assert.equal((await object.sync(info("iso_b"), null)).counts[id][COUNTER.prompt_inflight], 5000);
  assert.equal((await object.sync(info("iso_a"), null)).counts[id]?.[COUNTER.prompt_inflight] ?? 0, 0); // its own is not added back
  await object.sync(info("iso_a"), { inflight: [row(1, 0)] });
  assert.equal((await object.sync(info("iso_b"), null)).counts[id]?.[COUNTER.prompt_inflight] ?? 0, 0);
  // an isolate of the previous version sends rows without the column: none counted
  await object.sync(info("iso_c"), { inflight: [[id, 1, 0]] });
  assert.equal((await object.sync(info("iso_b"), null)).counts[id]?.[COUNTER.prompt_inflight] ?? 0, 0);
});
