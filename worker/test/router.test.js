// Routing decisions end to end in Node, with a fake namespace and a fake fetch. The
// real runtime and object are covered by tests/test_worker_*.py (workerd).
import { test } from "node:test";
import assert from "node:assert/strict";
import { handle } from "../src/router.js";
import { initial, record, grantTrial } from "../src/machine.js";
import { parseServerTiming } from "../src/timing.js";

function fakeNamespace() {
  const objects = new Map();
  const calls = [];
  const objectFor = (name) => {
    if (!objects.has(name)) objects.set(name, { snap: initial() });
    const o = objects.get(name);
    return {
      async snapshot() { calls.push(["snapshot", name]); return { ...o.snap }; },
      async report(ok, info) { calls.push(["report", name, ok]); o.snap = record(o.snap, ok, Date.now(), info); return { ...o.snap }; },
      async tryTrial(info) { const r = grantTrial(o.snap, Date.now(), info); o.snap = r.snap; return { granted: r.granted, snap: { ...o.snap } }; },
    };
  };
  return {
    objects, calls,
    idFromName: (name) => ({ name }),
    get: (id, opts) => { calls.push(["get", id.name, opts?.locationHint]); return objectFor(id.name); },
  };
}

function envFor(gen, over = {}) {
  return {
    BREAKER: fakeNamespace(), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "200", MAX_BODY_BYTES: "1000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb",
    ...over,
  };
}

function ctx() {
  const pending = [];
  return { pending, waitUntil: (p) => pending.push(p), settle: () => Promise.all(pending.splice(0)) };
}

function fakeFetch(podBehaviour) {
  const seen = [];
  const f = async (url, init = {}) => {
    seen.push({ url, auth: new Headers(init.headers).get("authorization"), body: init.body });
    if (url.startsWith("http://pod.test")) return podBehaviour(init);
    return new Response(JSON.stringify({ served: "fallback" }), { headers: { "content-type": "application/json" } });
  };
  return { f, seen };
}

const chat = () => new Request("https://w.test/v1/chat/completions?x=1", {
  method: "POST", body: JSON.stringify({ model: "m", messages: [] }), headers: { authorization: "Bearer client" },
});

test("closed: the pod serves with its token; the second request waits on nothing", async () => {
  const env = envFor("router-a");
  const c = ctx();
  const { f, seen } = fakeFetch(() => new Response("{}", { headers: { "content-type": "application/json" } }));
  const r1 = await handle(chat(), env, c, { fetch: f });
  assert.equal(r1.headers.get("x-colocate-backend"), "pod");
  assert.equal(seen[0].url, "http://pod.test/v1/chat/completions?x=1");
  assert.equal(seen[0].auth, "Bearer pt");
  assert.deepEqual(env.BREAKER.calls[0], ["get", "router-a", "enam"]);
  const before = env.BREAKER.calls.length;
  const r2 = await handle(chat(), env, c, { fetch: f });
  assert.equal(parseServerTiming(r2.headers.get("server-timing")).state, 0);
  assert.equal(env.BREAKER.calls.length, before); // fresh cache, healthy: no object call at all
  assert.equal(c.pending.length, 0); // nothing to report
});

test("pod failures fall back, are reported in the background, and open the breaker", async () => {
  const env = envFor("router-b");
  const c = ctx();
  const { f, seen } = fakeFetch(() => new Response("boom", { status: 503 }));
  for (let i = 0; i < 2; i++) {
    const r = await handle(chat(), env, c, { fetch: f });
    assert.equal(r.headers.get("x-colocate-backend"), "fallback");
    assert.equal(r.status, 200);
  }
  assert.equal(c.pending.length, 2);
  await c.settle();
  assert.equal(env.BREAKER.objects.get("router-b").snap.state, "open");
  const podCalls = seen.filter((s) => s.url.startsWith("http://pod.test")).length;
  const r = await handle(chat(), env, c, { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.equal(seen.filter((s) => s.url.startsWith("http://pod.test")).length, podCalls); // open: pod not tried
  assert.equal(seen.at(-1).auth, "Bearer fk");
});

test("a pod that misses the deadline is a failure served by the fallback", async () => {
  const env = envFor("router-c", { DEADLINE_MS: "50" });
  const c = ctx();
  const hang = (init) => new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new Error("aborted"))));
  const { f } = fakeFetch(hang);
  const r = await handle(chat(), env, c, { fetch: f });
  assert.equal(r.headers.get("x-colocate-backend"), "fallback");
  assert.ok(parseServerTiming(r.headers.get("server-timing")).upstream >= 40);
  await c.settle();
  assert.equal(env.BREAKER.objects.get("router-c").snap.failures, 1);
});

test("a broken namespace and no upstream: a JSON 502, no stack, no secret", async () => {
  const env = envFor("router-d");
  const boom = () => { throw new TypeError("secret pt leaked?"); };
  const r = await handle(chat(), { ...env, BREAKER: { idFromName: boom, get: boom } }, ctx(), { fetch: boom });
  const body = await r.text();
  assert.equal(r.status, 502);
  assert.equal(JSON.parse(body).error.code, "upstream_unavailable");
  assert.ok(!body.includes("    at ") && !body.includes("pt leaked"));
});
