// Guessed keys against the isolate's look-up budgets (strangers.js) and its key filter
// (keyfilter.js), through the router and the real generation object (test/support/objects.js).
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { createKey } from "./support/keys.js";
import { handle } from "../src/router.js";
import { keyHash, newKey } from "../src/keys.js";
import { BITS_PER_KEY, PROBES, addDigest, filterFor, mayHold } from "../src/keyfilter.js";
import { TOTAL_BURST } from "../src/strangers.js";

const { Breaker } = await import("../src/generation.js");

function envFor(gen) {
  const env = {
    BREAKER: objectNamespace(Breaker), CELL_REGION: "us-east", ACTIVE_GENERATION: gen, ACTIVE_HINT: "enam",
    DEADLINE_MS: "200", MAX_BODY_BYTES: "10000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000", STATE_TTL_MS: "60000",
    POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test", FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model",
  };
  env.BREAKER.env = env;
  return env;
}

const ctx = () => ({ waitUntil: () => {} });
const pod = async () => new Response("{}", { headers: { "content-type": "application/json" } });
// A new IPv6 /64 for each request: the per-address budget never applies, only the isolate's total.
const models = (key, i) => new Request("https://w.test/v1/models", {
  headers: { authorization: `Bearer ${key}`, "cf-connecting-ip": `2001:db8:${(i >> 16).toString(16)}:${(i & 0xffff).toString(16)}::1` },
});

test("the key filter: every key added is held, and about one guess in 1,700 is vouched for", async () => {
  const bytes = filterFor(10_000);
  assert.equal(bytes.length * 8 >= 10_000 * 1.25 * BITS_PER_KEY, true);
  const keys = await Promise.all(Array.from({ length: 10_000 }, () => keyHash(newKey())));
  for (const d of keys) addDigest(bytes, d);
  assert.ok(keys.every((d) => mayHold(bytes, d)));
  const guesses = await Promise.all(Array.from({ length: 20_000 }, () => keyHash(newKey())));
  const vouched = guesses.filter((d) => mayHold(bytes, d)).length;
  const rate = (1 - Math.exp(-PROBES / (bytes.length * 8 / 10_000))) ** PROBES; // the filter's rate at its fill
  assert.ok(vouched <= 20_000 * rate * 3 + 5, `${vouched} of 20,000 guesses vouched for (rate ${rate})`);
});

test("guesses from rotating /64s past the isolate's total: a real key new to the isolate is still looked up and served", async () => {
  const env = envFor("s-flood");
  const real = await createKey(env.BREAKER, "s-flood");
  // The isolate's first request starts its key list: the key filter comes with that sync.
  assert.equal((await handle(models(newKey(), 0), env, ctx(), { fetch: pod })).status, 401);
  // The real key arrives in the middle of the flood, once the guesses before it have used up the total.
  const flood = Array.from({ length: TOTAL_BURST + 1000 }, (_, i) => (i === TOTAL_BURST + 500 ? real.key : newKey()));
  const t0 = Date.now();
  const answers = await Promise.all(flood.map((key, i) => handle(models(key, i + 1), env, ctx(), { fetch: pod })));
  const codes = await Promise.all(answers.map(async (r) => (r.status === 200 ? "served" : (await r.json()).error.code)));
  const refused = codes.filter((c) => c === "too_many_unknown_keys").length;
  assert.ok(refused >= 200, `${refused} refused: the flood used up the isolate's total`);
  assert.equal(codes[TOTAL_BURST + 500], "served");
  assert.ok(codes.every((c, i) => c === "invalid_api_key" || c === "too_many_unknown_keys" || i === TOTAL_BURST + 500));
  // The object is called no more than the isolate's look-up rate allows (state.js: 2 at once, then one per 250 ms).
  const lookups = env.BREAKER.calls.filter((c) => c[0] === "lookupKeys").length;
  assert.ok(lookups <= 2 + (Date.now() - t0) / 250, `${lookups} look-up calls in ${Date.now() - t0} ms`);
});

test("a key created after the isolate's filter is vouched for once a sync brings its row", async () => {
  const env = envFor("s-late");
  const before = await createKey(env.BREAKER, "s-late");
  assert.equal((await handle(models(before.key, 0), env, ctx(), { fetch: pod })).status, 200);
  const after = await createKey(env.BREAKER, "s-late");
  const object = await env.BREAKER.instance("s-late");
  const { cache } = await import("../src/state.js");
  const digest = await keyHash(after.key);
  assert.equal(cache.mayBeKey("s-late", digest), false); // not yet: a guess as far as the isolate can tell
  const { sync } = await import("../src/state.js");
  const { readConfig } = await import("../src/config.js");
  await sync(env, readConfig(env));
  assert.equal(cache.mayBeKey("s-late", digest), true);
  assert.equal((await handle(models(after.key, 1), env, ctx(), { fetch: pod })).status, 200);
  assert.ok(object.keyFilter() instanceof Uint8Array);
});
