// Prefix affinity (affinity.js): the same point reaches the same pod in every isolate, a
// conversation's later turns keep its first turn's point, loads stay within the bound, a pod
// that leaves moves only its own conversations, and each key's points are its own.
import { test } from "node:test";
import assert from "node:assert/strict";
import { DEFAULT_BOUND, MIN_CAP, capOf, counts, order, pickPrefix, prefixHash } from "../src/affinity.js";

const URLS = ["https://pod-a.test:8000", "https://pod-b.test:8000", "https://pod-c.test:8000", "https://pod-d.test:8000"];
const ALL = [0, 1, 2, 3];
const IDLE = [0, 0, 0, 0];

// A deterministic generator, so a failure can be replayed (xorshift32).
function rng(seed) {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 2 ** 32;
  };
}

const SYSTEMS = ["You are a support agent for Acme. ".repeat(120), "You write SQL for analysts. ".repeat(200), "Translate to French. ".repeat(60)];

/** A conversation: its app's system prompt, an opening, and turns that append to the history. */
function conversation(r, id) {
  const messages = [{ role: "system", content: SYSTEMS[id % SYSTEMS.length] }, { role: "user", content: `question ${id}: ${r()}` }];
  return {
    messages,
    body: () => ({ model: "m", messages: messages.slice(), max_tokens: 200, stream: true }),
    next(k) {
      messages.push({ role: "assistant", content: `answer ${k} `.repeat(40) }, { role: "user", content: `follow-up ${k} ${r()}` });
    },
  };
}

test("a later turn of a conversation has its first turn's point; another opening, another key or another app has another", () => {
  const r = rng(7);
  const c = conversation(r, 1);
  const first = prefixHash("key_a", c.body());
  for (let k = 0; k < 5; k++) {
    c.next(k);
    assert.equal(prefixHash("key_a", c.body()), first);
  }
  assert.notEqual(prefixHash("key_b", c.body()), first);
  assert.notEqual(prefixHash("key_a", conversation(r, 2).body()), first);
  const other = conversation(r, 1);
  other.messages[0] = { role: "system", content: SYSTEMS[1] };
  assert.notEqual(prefixHash("key_a", other.body()), first);
  // parts content hashes its text; a prompt_cache_key names the conversation outright
  const parts = { messages: [{ role: "user", content: [{ type: "text", text: "hello" }] }] };
  assert.equal(prefixHash("k", parts), prefixHash("k", { messages: [{ role: "user", content: [{ type: "text", text: "hello" }] }, { role: "assistant", content: "x" }] }));
  assert.equal(prefixHash("k", { ...c.body(), prompt_cache_key: "conv-9" }), prefixHash("k", { messages: [{ role: "user", content: "other" }], prompt_cache_key: "conv-9" }));
  assert.notEqual(prefixHash("k", { prompt_cache_key: "conv-9" }), prefixHash("k", { prompt_cache_key: "conv-10" }));
  // a legacy completion's prompt: its head; bad shapes never throw
  assert.equal(prefixHash("k", { prompt: "p".repeat(5000) }), prefixHash("k", { prompt: "p".repeat(5000) + " and more" }));
  for (const odd of [null, {}, { messages: [null, 3, { role: 5 }] }, { prompt: [1, 2, 3] }, { prompt: [] }]) {
    assert.equal(typeof prefixHash("k", odd), "number");
  }
});

test("every isolate picks the same pod for the same point: independent module instances agree", async () => {
  const other = await import(new URL("../src/affinity.js?isolate=2", import.meta.url).href);
  const third = await import(new URL("../src/affinity.js?isolate=3", import.meta.url).href);
  assert.notEqual(other.counts, counts); // truly separate instances
  const r = rng(11);
  for (let n = 0; n < 2000; n++) {
    const body = conversation(r, n).body();
    const h = prefixHash(`key_${n % 7}`, body);
    assert.equal(other.prefixHash(`key_${n % 7}`, body), h);
    const i = pickPrefix(URLS, ALL, IDLE, h);
    // a copy of the list (another isolate's config) and another index order give the same pod
    assert.equal(other.pickPrefix([...URLS], ALL, IDLE, h), i);
    const reversed = [...URLS].reverse();
    assert.equal(reversed[third.pickPrefix(reversed, ALL, IDLE, h)], URLS[i]);
  }
});

test("points spread evenly over the pods (each within 10 % of its share over 20,000)", () => {
  const r = rng(3);
  const per = [0, 0, 0, 0];
  for (let n = 0; n < 20000; n++) per[pickPrefix(URLS, ALL, IDLE, prefixHash("key_a", conversation(r, n).body()))]++;
  for (const c of per) assert.ok(Math.abs(c - 5000) < 500, `shares ${per}`);
});

test("removing 1 of 4 pods moves only its own conversations (at most 30 %); they spread over the other three", () => {
  const r = rng(5);
  const points = Array.from({ length: 10000 }, (_, n) => prefixHash(`key_${n % 13}`, conversation(r, n).body()));
  for (let gone = 0; gone < 4; gone++) {
    const left = ALL.filter((i) => i !== gone);
    let moved = 0;
    const to = [0, 0, 0, 0];
    for (const h of points) {
      const before = pickPrefix(URLS, ALL, IDLE, h);
      const after = pickPrefix(URLS, left, IDLE, h);
      if (before !== after) {
        moved++;
        assert.equal(before, gone, "a conversation moved from a pod that stayed");
        to[after]++;
      }
    }
    assert.ok(moved / points.length <= 0.3, `moved ${moved}`);
    for (const i of left) assert.ok(to[i] > moved / 3 - moved * 0.1 && to[i] < moved / 3 + moved * 0.1, `to ${to}`);
  }
});

test("bounded loads: however many requests share one point, no pod passes ceil(c x mean) (or MIN_CAP)", () => {
  for (const bound of [1.25, 1.1, DEFAULT_BOUND, 2]) {
    const loads = [0, 0, 0, 0];
    const h = prefixHash("hot", { messages: [{ role: "user", content: "the same opening" }] });
    for (let n = 1; n <= 400; n++) {
      const i = pickPrefix(URLS, ALL, loads, h, bound);
      loads[i]++;
      const cap = Math.max(MIN_CAP, Math.ceil((bound * n) / 4));
      assert.equal(capOf(n, 4, bound), cap);
      assert.ok(Math.max(...loads) <= cap, `n=${n} loads ${loads} cap ${cap}`);
    }
    // the point's own pod is full: it holds the most, and the shed excess reached every pod
    assert.equal(loads[order(URLS, ALL, h)[0]], Math.max(...loads));
    if (bound < 4 / 3) assert.ok(Math.min(...loads) > 0);
  }
  // a candidate set of one takes everything; none: -1
  assert.equal(pickPrefix(URLS, [2], [0, 0, 50, 0], 123), 2);
  assert.equal(pickPrefix(URLS, [], IDLE, 123), -1);
  // fractional loads (what a pod reports) all at the bound: the least loaded
  assert.equal(pickPrefix(URLS, [0, 1], [10.5, 10.2, 0, 0], 99, 1.01), 1);
});

test("per-key salt: two keys sending the same prompts land on the same pod no more often than chance", () => {
  const r = rng(9);
  let same = 0;
  const N = 4000;
  for (let n = 0; n < N; n++) {
    const body = conversation(r, n).body();
    if (pickPrefix(URLS, ALL, IDLE, prefixHash("key_a", body)) === pickPrefix(URLS, ALL, IDLE, prefixHash("key_b", body))) same++;
  }
  assert.ok(same / N > 0.2 && same / N < 0.3, `same pod ${same} of ${N} (chance: 25 %)`);
});

/**
 * A cell of 4 pods serving `active` concurrent conversations in several independent isolates
 * (module instances), each turn in flight for a random time: how often a turn after the first
 * lands on its previous turn's pod while that pod is under its bound.
 */
async function simulate(active, isolates, seed) {
  const mods = [await import("../src/affinity.js")];
  for (let k = 1; k < isolates; k++) mods.push(await import(new URL(`../src/affinity.js?sim=${k}`, import.meta.url).href));
  const r = rng(seed);
  const loads = [0, 0, 0, 0];
  const convs = [];
  let id = 0;
  const fresh = () => ({ c: conversation(r, id++), key: `key_${id % 5}`, pod: -1, turns: 0, busyUntil: 0 });
  for (let n = 0; n < active; n++) convs.push(fresh());
  const inflight = []; // [end time, pod]
  let kept = 0;
  let eligible = 0;
  for (let t = 0; t < 20000; t++) {
    for (let j = inflight.length - 1; j >= 0; j--) {
      if (inflight[j][0] <= t) {
        loads[inflight[j][1]]--;
        inflight.splice(j, 1);
      }
    }
    const s = convs[Math.floor(r() * convs.length)];
    if (s.busyUntil > t) continue;
    const m = mods[Math.floor(r() * mods.length)]; // each turn may reach any isolate
    const h = m.prefixHash(s.key, s.c.body());
    const i = m.pickPrefix(URLS, ALL, loads, h);
    if (s.pod >= 0) {
      const total = loads.reduce((a, b) => a + b, 1);
      if (loads[s.pod] + 1 <= capOf(total, 4)) {
        eligible++;
        if (i === s.pod) kept++;
      }
    }
    loads[i]++;
    const end = t + 1 + Math.floor(r() * 20);
    inflight.push([end, i]);
    s.pod = i;
    s.busyUntil = end;
    s.c.next(s.turns++);
    if (s.turns > 8) convs[convs.indexOf(s)] = fresh();
  }
  return { kept, eligible };
}

test("across 4 isolates, at least 90 % of later turns land on the previous turn's pod while it is under its bound", async () => {
  for (const active of [8, 40, 200]) {
    const { kept, eligible } = await simulate(active, 4, 17 + active);
    assert.ok(eligible > 1000, `eligible ${eligible}`);
    assert.ok(kept / eligible >= 0.9, `${active} conversations: ${kept} of ${eligible} kept`);
  }
});

test("the share sent by affinity and shed by load is counted", () => {
  const a = counts.affinity;
  const s = counts.shed;
  const h = prefixHash("count", { messages: [{ role: "user", content: "x" }] });
  const first = order(URLS, ALL, h)[0];
  pickPrefix(URLS, ALL, IDLE, h);
  const full = [0, 0, 0, 0];
  full[first] = 10;
  assert.notEqual(pickPrefix(URLS, ALL, full, h), first);
  assert.deepEqual([counts.affinity - a, counts.shed - s], [1, 1]);
});

test("the prefix policy in pods.js's interface: the cell's in-flight counts, or what the pod reports when that is more", async () => {
  const { prefixPolicy } = await import("../src/affinity.js");
  const body = { messages: [{ role: "user", content: "policy" }] };
  const h = prefixHash("key_p", body);
  const [first, second] = order(URLS, ALL, h);
  const idle = { here: () => 0, others: () => 0, pod: () => null };
  assert.equal(prefixPolicy(URLS, ALL, idle, { keyId: "key_p", json: body }), first);
  // the other isolates' requests count: 30 there against 1 elsewhere sheds it (c 1.5: cap ceil(1.5 x 34 / 4) = 13)
  const busyElsewhere = { here: () => 0, others: (i) => (i === first ? 30 : 1), pod: () => null };
  assert.notEqual(prefixPolicy(URLS, ALL, busyElsewhere, { keyId: "key_p", json: body }), first);
  // so does what the pod reports, when it is more than the cell's counts
  const podBusy = { here: () => 0, others: () => 1, pod: (i) => (i === first ? { running: 25, waiting: 5 } : null) };
  assert.equal(prefixPolicy(URLS, ALL, podBusy, { keyId: "key_p", json: body }), second);
  // a looser bound keeps it
  assert.equal(prefixPolicy(URLS, ALL, busyElsewhere, { keyId: "key_p", json: body, prefixBound: 4 }), first);
});
