// Prefix affinity through the router (BALANCE=prefix): the real handler, the real generation
// object (SQLite in memory) and a fake fetch for the pods, as router.test.js.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { handle } from "../src/router.js";
import { keyHash, newKey } from "../src/keys.js";
import { counts } from "../src/affinity.js";

const { Breaker } = await import("../src/generation.js");

const PODS = ["http://pod-a.test", "http://pod-b.test", "http://pod-c.test", "http://pod-d.test"];

async function withKey(ns, gen) {
  const key = newKey();
  const object = await ns.instance(gen);
  const id = `key_${(await object.listKeys({ generation: gen })).length}`;
  await object.createKey({ id, hash: await keyHash(key), prefix: key.slice(0, 12), name: "t", rpm: 0, tpm: 0, monthly_tokens: 0,
    max_parallel: 0, created_at: Date.now(), expires_at: null }, { generation: gen });
  return key;
}

function envFor(gen, over = {}) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "500", MAX_BODY_BYTES: "100000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: JSON.stringify(PODS), POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb",
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
