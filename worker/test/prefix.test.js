// Prefix affinity through the router (BALANCE=prefix): the real handler, the real generation
// object (SQLite in memory) and a fake fetch for the pods, as router.test.js.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { withKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { counts } from "../src/affinity.js";

const { Breaker } = await import("../src/generation.js");

const PODS = ["http://pod-a.test", "http://pod-b.test", "http://pod-c.test", "http://pod-d.test"];


function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "500", MAX_BODY_BYTES: "100000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: JSON.stringify(PODS), POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
    BALANCE: "prefix", ...over,
  };
  env.BREAKER.env = env;
  return env;
}

const ctx = () => ({ waitUntil: () => {} });
const ok = () => new Response("{}", { headers: { "content-type": "application/json" } });
const fetchOk = async (url) => (url.startsWith("http://pod") ? ok() : new Response("{}", { headers: { "content-type": "application/json" } }));

const chat = (key, messages) => new Request("https://w.test/v1/chat/completions", {
  method: "POST", body: JSON.stringify({ model: "m", messages, max_tokens: 20 }), headers: { authorization: `Bearer ${key}` },
});

test("BALANCE=prefix: each conversation's turns stay on one pod, and the conversations spread over the pods", async () => {
  const env = envFor("prefix-a");
  const key = await withKey(env.BREAKER, "prefix-a");
  const used = new Set();
  for (let c = 0; c < 24; c++) {
    const messages = [{ role: "system", content: "You are terse." }, { role: "user", content: `conversation ${c}` }];
    let pod = null;
    for (let turn = 0; turn < 4; turn++) {
      const res = await handle(chat(key, messages), env, ctx(), { fetch: fetchOk });
      assert.equal(res.status, 200);
      const backend = res.headers.get("x-colocate-backend");
      if (pod === null) pod = backend;
      assert.equal(backend, pod, `conversation ${c} turn ${turn}`);
      messages.push({ role: "assistant", content: `answer ${turn}` }, { role: "user", content: `more ${turn}` });
    }
    used.add(pod);
  }
  assert.equal(used.size, 4); // 24 conversations on 4 pods: all used (chance of fewer: 4 x (3/4)^24 < 0.4 %)
});

test("BALANCE=prefix: a pod that fails passes its request to the point's next pod; the others keep theirs", async () => {
  const env = envFor("prefix-b");
  const key = await withKey(env.BREAKER, "prefix-b");
  const messages = [{ role: "user", content: "the failing one" }];
  const first = (await handle(chat(key, messages), env, ctx(), { fetch: fetchOk })).headers.get("x-colocate-backend");
  const down = PODS[Number(first.slice(4))];
  const seen = [];
  const f = async (url) => {
    seen.push(url);
    return url.startsWith(down) ? new Response("busy", { status: 503 }) : ok();
  };
  const res = await handle(chat(key, messages), env, ctx(), { fetch: f });
  assert.equal(res.status, 200);
  assert.notEqual(res.headers.get("x-colocate-backend"), first);
  assert.equal(seen.filter((u) => u.startsWith("http://pod")).length, 2);
});

test("BALANCE=prefix counts what affinity sent and what the load bound shed", async () => {
  const env = envFor("prefix-c");
  const key = await withKey(env.BREAKER, "prefix-c");
  const before = counts.affinity + counts.shed;
  await handle(chat(key, [{ role: "user", content: "x" }]), env, ctx(), { fetch: fetchOk });
  assert.equal(counts.affinity + counts.shed, before + 1);
});

test("a bad BALANCE or PREFIX_BOUND is a 500 naming the binding", async () => {
  for (const [over, name] of [[{ BALANCE: "fastest" }, "BALANCE"], [{ PREFIX_BOUND: "1" }, "PREFIX_BOUND"], [{ PREFIX_BOUND: "x" }, "PREFIX_BOUND"]]) {
    const env = envFor("prefix-d", over);
    const res = await handle(chat("clc_x", [{ role: "user", content: "x" }]), env, ctx(), { fetch: fetchOk });
    assert.equal(res.status, 500);
    assert.match((await res.json()).error.message, new RegExp(name));
  }
});

test("a streamed answer records its ttft and itl, and a prefix pick its kind, for the live view", async () => {
  const { recorder } = await import("../src/histogram.js");
  const env = envFor("prefix-e");
  const key = await withKey(env.BREAKER, "prefix-e");
  recorder.take("X"); // what earlier tests left
  // Every row the recorder hands out from now on: a sync of any isolate state may carry them (state.js PARTS.hist).
  const taken = [];
  const take = recorder.take;
  recorder.take = function (colo) {
    const rows = take.call(this, colo);
    taken.push(...rows);
    return rows;
  };
  const events = [
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', 'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
    'data: {"choices":[{"index":0,"delta":{"content":"c"}}]}\n\n',
    'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n', "data: [DONE]\n\n",
  ];
  const sse = () => new Response(new ReadableStream({
    async pull(c) {
      const e = events[c.i = (c.i ?? -1) + 1];
      if (e === undefined) return c.close();
      await new Promise((r) => setTimeout(r, 5));
      c.enqueue(new TextEncoder().encode(e));
    },
  }), { headers: { "content-type": "text/event-stream" } });
  const pending = [];
  const c = { waitUntil: (p) => pending.push(p) };
  const req = new Request("https://w.test/v1/chat/completions", {
    method: "POST", body: JSON.stringify({ model: "m", messages: [{ role: "user", content: "stream" }], stream: true }),
    headers: { authorization: `Bearer ${key}` },
  });
  const res = await handle(req, env, c, { fetch: async (url) => (url.startsWith("http://pod") ? sse() : new Response("{}")) });
  assert.equal(res.status, 200);
  assert.match(await res.text(), /"content":"c"/);
  await Promise.all(pending);
  recorder.take("X");
  recorder.take = take;
  const rows = taken;
  const pod = res.headers.get("x-colocate-backend").slice(4);
  const segs = rows.filter((r) => r[2] === pod).map((r) => r[3]).sort();
  assert.deepEqual(segs, ["affinity", "fallback", "itl", "queue", "state", "total", "ttft", "upstream"]);
  const { decode, percentile } = await import("../src/histogram.js");
  const ttft = percentile(decode(rows.find((r) => r[2] === pod && r[3] === "ttft")[4]), 50);
  const upstream = percentile(decode(rows.find((r) => r[2] === pod && r[3] === "upstream")[4]), 50);
  // the first event comes after the pod was asked: ttft holds the upstream's wait (within a bucket's 1.08 %)
  assert.ok(ttft >= upstream * 0.98 && ttft > 0, `ttft ${ttft} >= upstream ${upstream}`);
});
