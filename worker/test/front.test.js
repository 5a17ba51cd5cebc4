import { test } from "node:test";
import assert from "node:assert/strict";
import { MAX_TRIES, choose, forget, isNoPod, readFleet, remember } from "../src/fleetfront.js";

const cell = () => ({ fetch: async () => new Response("") });

function env(over = {}) {
  return {
    CELLS: [{ name: "apac-jp", region: "apac-jp" }, { name: "eu-west", region: "eu-west" }, { name: "us-east", region: "us-east" }],
    CELL_RANK: { NRT: [0, 1, 2], FRA: [1, 2, 0], IAD: [2, 1, 0] },
    CELL_0: cell(),
    CELL_1: cell(),
    CELL_2: cell(),
    REMEMBER_MS: "5000",
    MAX_BODY_BYTES: "1048576",
    ...over,
  };
}

const names = (cells) => cells.map((c) => c.name);

test("the ranked order for the request's colo, two cells at most", () => {
  forget();
  const cfg = readFleet(env());
  assert.equal(MAX_TRIES, 2);
  assert.deepEqual(names(choose(cfg, "NRT")), ["apac-jp", "eu-west"]);
  assert.deepEqual(names(choose(cfg, "fra")), ["eu-west", "us-east"]);
  assert.deepEqual(names(choose(cfg, "IAD")), ["us-east", "eu-west"]);
});

test("an unknown or missing colo uses the configured order", () => {
  forget();
  const cfg = readFleet(env());
  assert.deepEqual(names(choose(cfg, "ZZZ")), ["apac-jp", "eu-west"]);
  assert.deepEqual(names(choose(cfg, undefined)), ["apac-jp", "eu-west"]);
});

test("a remembered cell moves to the end until its time is up, never out", () => {
  forget();
  const cfg = readFleet(env());
  remember(cfg, cfg.cells[0], 1000);
  assert.deepEqual(names(choose(cfg, "NRT", 1000)), ["eu-west", "us-east"]);
  assert.deepEqual(names(choose(cfg, "NRT", 5999)), ["eu-west", "us-east"]);
  assert.deepEqual(names(choose(cfg, "NRT", 6000)), ["apac-jp", "eu-west"]);
  for (const c of cfg.cells) remember(cfg, c, 0);
  assert.deepEqual(names(choose(cfg, "FRA", 1)), ["eu-west", "us-east"]); // all remembered: ranked order
  forget();
});

test("REMEMBER_MS 0 remembers nothing", () => {
  forget();
  const cfg = readFleet(env({ REMEMBER_MS: "0" }));
  remember(cfg, cfg.cells[0], 1000);
  assert.deepEqual(names(choose(cfg, "NRT", 1000)), ["apac-jp", "eu-west"]);
});

test("json bindings may arrive as text", () => {
  const e = env();
  const cfg = readFleet({ ...e, CELLS: JSON.stringify(e.CELLS), CELL_RANK: JSON.stringify(e.CELL_RANK) });
  assert.equal(cfg.cells.length, 3);
});

test("bad bindings name the binding", () => {
  const bad = [
    [{ CELLS: [] }, /CELLS/],
    [{ CELLS: "not json" }, /CELLS: is not JSON/],
    [{ CELL_2: undefined }, /CELL_2/],
    [{ CELL_RANK: { NRT: [0, 0, 1] } }, /CELL_RANK: the order for NRT/],
    [{ CELL_RANK: { NRT: [0, 1] } }, /CELL_RANK/],
    [{ CELL_RANK: [] }, /CELL_RANK/],
    [{ REMEMBER_MS: "-1" }, /REMEMBER_MS/],
    [{ MAX_BODY_BYTES: "0" }, /MAX_BODY_BYTES/],
  ];
  for (const [over, message] of bad) assert.throws(() => readFleet(env(over)), message, JSON.stringify(over));
});

test("no pod is a 503 with x-colocate-backend none, nothing else", () => {
  const r = (status, backend) => new Response("", { status, headers: backend ? { "x-colocate-backend": backend } : {} });
  assert.equal(isNoPod(r(503, "none")), true);
  assert.equal(isNoPod(r(503, "fallback")), false);
  assert.equal(isNoPod(r(503, null)), false);
  assert.equal(isNoPod(r(502, "none")), false);
});
