// A key's refusals, counted by reason: carried by the sync, kept in the generation (and moved
// with it), exposed in GET /_colocate/metrics with bounded labels.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { REASONS, REFUSAL_KEYS, reasonOf } from "../src/refusals.js";
import { REFUSAL, USAGE } from "../src/payloads.js";
import { exposition } from "../src/metrics.js";
import { dayOf } from "../src/limits.js";

const { Breaker } = await import("../src/generation.js");

test("each refusal of limits.js and the router has its reason; anything else is other", () => {
  assert.equal(reasonOf({ type: "requests", code: "rate_limit_exceeded" }), "rpm");
  assert.equal(reasonOf({ type: "tokens", code: "rate_limit_exceeded" }), "tpm");
  assert.equal(reasonOf({ type: "insufficient_quota", code: "insufficient_quota" }), "monthly_tokens");
  assert.equal(reasonOf({ type: "tokens", code: "tokens_reserved" }), "tokens_reserved");
  assert.equal(reasonOf({ type: "requests", code: "too_many_parallel_requests" }), "max_parallel");
  assert.equal(reasonOf({ type: "requests", code: "rate_limit_exceeded", byLease: true }), "lease");
  assert.equal(reasonOf({ code: "fallback_spend_cap" }), "fallback_cap");
  assert.equal(reasonOf({ code: "something_new" }), "other");
  assert.ok(REASONS.includes("other"));
});

const info = (gen, over = {}) => ({ generation: gen, isolate: "iso_a", keys: [], ttlMs: 2000, haveRev: -1, ...over });
const id = (i) => `key_${String(i).padStart(12, "0")}`;

test("the metrics name the keys refused most, the rest as other, and a reason outside the set as other", async () => {
  const ns = objectNamespace(Breaker);
  const gen = "r-top";
  const rows = [];
  for (let i = 0; i < REFUSAL_KEYS + 5; i++) rows.push([id(i), i % 2 ? "rpm" : "max_parallel", 100 - i]);
  rows.push([id(0), "hacked-label", 7]);
  await ns.get(ns.idFromName(gen)).sync(info(gen), { refusals: rows });
  const m = await (await ns.instance(gen)).metrics(info(gen));
  const named = new Set(m.refusals.map((r) => r[0]).filter((k) => k !== "other"));
  assert.equal(named.size, REFUSAL_KEYS);
  assert.ok(named.has(id(0)) && !named.has(id(REFUSAL_KEYS + 4)));
  const other = m.refusals.filter((r) => r[0] === "other");
  assert.equal(other.reduce((a, r) => a + r[2], 0), [20, 21, 22, 23, 24].reduce((a, i) => a + 100 - i, 0));
  assert.deepEqual(m.refusals.find((r) => r[0] === id(0) && r[1] === "other"), [id(0), "other", 7]);
  const text = exposition(m, { podUrls: [], activeGeneration: gen, drainingGeneration: null, region: "us-east" });
  assert.match(text, new RegExp(`colocate_refusals_total\\{key="${id(0)}",reason="max_parallel"\\} 100`));
  assert.ok(!text.includes("hacked-label"));
});

test("refusals are kept in the generation and move with it in a migration", async () => {
  const ns = objectNamespace(Breaker);
  const day = dayOf(Date.now());
  const usage = USAGE.zero(day, id(1));
  usage[USAGE.refused] = 3;
  const refusal = REFUSAL.zero(id(1), "tpm");
  refusal[REFUSAL.n] = 3;
  await ns.get(ns.idFromName("r-old")).sync(info("r-old"), { usage: [usage], refusals: [refusal] });
  const next = await ns.instance("r-new");
  await next.sync(info("r-new", { draining: "r-old" }), null);
  assert.deepEqual((await next.metrics(info("r-new"))).refusals, [[id(1), "tpm", 3]]);
  const rows = await next.usage({ from: day, to: day }, info("r-new"));
  assert.equal(rows[0].refused, 3);
});
