import { test } from "node:test";
import assert from "node:assert/strict";
import { MAX_TRIES, choose, conversationPoint, forget, isNoPod, readFleet, remember } from "../src/fleetfront.js";
import front from "../src/front.js";
import { forgetPoke } from "../src/fleetexchange.js";

const cell = () => ({ fetch: async () => new Response("") });

// A stand-in for the FleetLedger namespace: counts pokes; `hang` makes a poke never answer.
function ledger({ hang = false } = {}) {
  const ns = { pokes: 0, idFromName: (name) => ({ name }) };
  ns.get = () => ({ poke: () => { ns.pokes += 1; return hang ? new Promise(() => {}) : Promise.resolve({}); } });
  return ns;
}

function env(over = {}) {
  return {
    CELLS: [{ name: "apac-jp", region: "apac-jp" }, { name: "eu-west", region: "eu-west" }, { name: "us-east", region: "us-east" }],
    CELL_0: cell(),
    CELL_1: cell(),
    CELL_2: cell(),
    REMEMBER_MS: "5000",
    MAX_BODY_BYTES: "1048576",
    CELL_TOKEN_0: "t0",
    CELL_TOKEN_1: "t1",
    CELL_TOKEN_2: "t2",
    LEDGER: ledger(),
    EXCHANGE_MS: "1000",
    ...over,
  };
}

const RANK = { NRT: [0, 1, 2], FRA: [1, 2, 0], IAD: [2, 1, 0] };
const names = (cells) => cells.map((c) => c.name);

test("the ranked order for the request's colo, two cells at most", () => {
  forget();
  const cfg = readFleet(env(), RANK);
  assert.equal(MAX_TRIES, 2);
  assert.deepEqual(names(choose(cfg, "NRT")), ["apac-jp", "eu-west"]);
  assert.deepEqual(names(choose(cfg, "fra")), ["eu-west", "us-east"]);
  assert.deepEqual(names(choose(cfg, "IAD")), ["us-east", "eu-west"]);
});

test("an unknown or missing colo uses the configured order", () => {
  forget();
  const cfg = readFleet(env(), RANK);
  assert.deepEqual(names(choose(cfg, "ZZZ")), ["apac-jp", "eu-west"]);
  assert.deepEqual(names(choose(cfg, undefined)), ["apac-jp", "eu-west"]);
});

test("a remembered cell moves to the end until its time is up, never out", () => {
  forget();
  const cfg = readFleet(env(), RANK);
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
  const cfg = readFleet(env({ REMEMBER_MS: "0" }), RANK);
  remember(cfg, cfg.cells[0], 1000);
  assert.deepEqual(names(choose(cfg, "NRT", 1000)), ["apac-jp", "eu-west"]);
});

test("json bindings may arrive as text", () => {
  const e = env();
  const cfg = readFleet({ ...e, CELLS: JSON.stringify(e.CELLS) }, RANK);
  assert.equal(cfg.cells.length, 3);
});

test("a colo cut to its own cell by the budget tries that cell alone, which may fall back", () => {
  forget();
  const cfg = readFleet(env(), { NRT: [0], FRA: [1, 2], IAD: [2, 1, 0] });
  assert.deepEqual(names(choose(cfg, "NRT")), ["apac-jp"]);
  remember(cfg, cfg.cells[0], 1000); // no pod at home: still the only cell within the budget
  assert.deepEqual(names(choose(cfg, "NRT", 1001)), ["apac-jp"]);
  assert.deepEqual(names(choose(cfg, "FRA")), ["eu-west", "us-east"]);
  forget();
});

test("a bad ranking names its module", () => {
  for (const rank of [{ NRT: [0, 0, 1] }, { NRT: [] }, { NRT: [0, 1, 3] }, { NRT: [0, 1, 2, 0] }, { NRT: [0.5] }, [], null]) {
    assert.throws(() => readFleet(env(), rank), /cellrank\.js/, JSON.stringify(rank));
  }
  assert.throws(() => readFleet(env(), { NRT: [0, 0, 1] }), /cellrank\.js: the order for NRT/);
});

test("the kit's own cellrank.js ranks no colo: every colo takes the configured order", () => {
  forget();
  const cfg = readFleet(env());
  assert.deepEqual(names(choose(cfg, "IAD")), ["apac-jp", "eu-west"]);
});

test("bad bindings name the binding", () => {
  const bad = [
    [{ CELLS: [] }, /CELLS/],
    [{ CELLS: "not json" }, /CELLS: is not JSON/],
    [{ CELL_2: undefined }, /CELL_2/],
    [{ REMEMBER_MS: "-1" }, /REMEMBER_MS/],
    [{ MAX_BODY_BYTES: "0" }, /MAX_BODY_BYTES/],
    [{ CELL_TOKEN_1: "" }, /CELL_TOKEN_1: the cell's exchange token is missing/],
    [{ LEDGER: undefined }, /LEDGER/],
    [{ EXCHANGE_MS: "0" }, /EXCHANGE_MS/],
  ];
  for (const [over, message] of bad) assert.throws(() => readFleet(env(over), RANK), message, JSON.stringify(over));
});

test("no pod is a 503 with x-colocate-backend none, nothing else", () => {
  const r = (status, backend) => new Response("", { status, headers: backend ? { "x-colocate-backend": backend } : {} });
  assert.equal(isNoPod(r(503, "none")), true);
  assert.equal(isNoPod(r(503, "fallback")), false);
  assert.equal(isNoPod(r(503, null)), false);
  assert.equal(isNoPod(r(502, "none")), false);
});

// --- front.js end to end, with cells that are plain functions -------------------------


function fleetEnv(cells) {
  const e = env({ REMEMBER_MS: "5000" });
  cells.forEach((fn, i) => { e[`CELL_${i}`] = { fetch: fn }; });
  return e;
}

const ctx = { waitUntil() {} };

function ask(e, { body = '{"model":"m"}', auth = "Bearer clc_x", colo } = {}) {
  const req = new Request("https://fleet.example/v1/chat/completions", {
    method: "POST", body, headers: { authorization: auth, "content-type": "application/json", "x-colocate-fallback": "defer" },
  });
  if (colo) Object.defineProperty(req, "cf", { value: { colo } });
  return front.fetch(req, e, ctx);
}

const served = () => async () => new Response('{"ok":true}', { headers: { "x-colocate-backend": "pod-0", "server-timing": "state;dur=0, upstream;dur=5, fallback;dur=0, total;dur=5" } });
const noPod = (tried) => async () => new Response('{"error":{}}', { status: 503, headers: { "x-colocate-backend": "none", "x-colocate-pods-tried": String(tried) } });

test("the first cell gets the defer header, the last none; body and Authorization pass unchanged", async () => {
  forget();
  const seen = [];
  const record = (fn) => async (req) => {
    seen.push({ defer: req.headers.get("x-colocate-fallback"), auth: req.headers.get("authorization"), body: await req.text() });
    return fn(req);
  };
  const e = fleetEnv([record(noPod(1)), record(served("eu-west")), record(served("us-east"))]);
  const res = await ask(e, { colo: "NRT", body: '{"model":"m","messages":[]}' });
  assert.equal(res.status, 200);
  assert.equal(res.headers.get("x-colocate-cell"), "eu-west");
  assert.match(res.headers.get("server-timing"), /^front;dur=[0-9.]+;desc="NRT", state;dur=0, upstream;dur=5/);
  assert.deepEqual(seen, [
    { defer: "defer", auth: "Bearer clc_x", body: '{"model":"m","messages":[]}' },
    { defer: null, auth: "Bearer clc_x", body: '{"model":"m","messages":[]}' },
  ]);
  // tried a pod: not remembered, so apac-jp is asked first again
  assert.deepEqual(names(choose(readFleet(e), "NRT")), ["apac-jp", "eu-west"]);
});

test("a cell with no pod to try is remembered; an unreachable cell too", async () => {
  forget();
  const e = fleetEnv([noPod(0), served("eu-west"), served("us-east")]);
  assert.equal((await ask(e, { colo: "NRT" })).headers.get("x-colocate-cell"), "eu-west");
  assert.deepEqual(names(choose(readFleet(e), "NRT")), ["eu-west", "us-east"]);
  forget();
  const down = fleetEnv([async () => { throw new Error("connection refused"); }, served("eu-west"), served("us-east")]);
  assert.equal((await ask(down, { colo: "NRT" })).headers.get("x-colocate-cell"), "eu-west");
  assert.deepEqual(names(choose(readFleet(down), "NRT")), ["eu-west", "us-east"]);
  forget();
});

test("the last cell unreachable: 502 in OpenAI's shape", async () => {
  forget();
  const boom = async () => { throw new Error("down"); };
  const res = await ask(fleetEnv([boom, boom, boom]), { colo: "FRA" });
  assert.equal(res.status, 502);
  assert.equal(res.headers.get("retry-after"), "1");
  const body = await res.json();
  assert.deepEqual(Object.keys(body.error).sort(), ["code", "message", "type"]);
  assert.equal(body.error.code, "cell_unavailable");
  forget();
});

test("a deferred cell whose state is unreachable is passed for the next cell; the last cell's, and a busy key look-up, pass through", async () => {
  forget();
  const stateDown = async () => new Response('{"error":{"message":"the cell\'s state is unreachable; retry shortly","type":"server_error","code":"state_unavailable"}}',
    { status: 503, headers: { "retry-after": "1", "content-type": "application/json" } });
  const e = fleetEnv([stateDown, served(), served()]);
  const res = await ask(e, { colo: "NRT" });
  assert.equal(res.status, 200);
  assert.equal(res.headers.get("x-colocate-cell"), "eu-west");
  assert.deepEqual(names(choose(readFleet(e), "NRT")), ["apac-jp", "eu-west"]); // not remembered
  const last = await ask(fleetEnv([stateDown, stateDown, served()]), { colo: "NRT" });
  assert.equal(last.status, 503);
  assert.equal(last.headers.get("x-colocate-cell"), "eu-west");
  assert.equal((await last.json()).error.code, "state_unavailable");
  // A flood of unknown keys at one cell is not passed on to the next.
  const busy = async () => new Response('{"error":{"code":"key_lookup_busy"}}', { status: 503, headers: { "retry-after": "1" } });
  const refused = await ask(fleetEnv([busy, served(), served()]), { colo: "NRT" });
  assert.equal(refused.status, 503);
  assert.equal(refused.headers.get("x-colocate-cell"), "apac-jp");
  assert.equal(refused.headers.get("retry-after"), "1");
  assert.equal((await refused.json()).error.code, "key_lookup_busy");
  forget();
});

test("a cell's own error passes through with the cell named", async () => {
  forget();
  const unauthorised = async () => new Response('{"error":{"code":"invalid_api_key"}}', { status: 401 });
  const res = await ask(fleetEnv([unauthorised, served("x"), served("y")]), { colo: "NRT" });
  assert.equal(res.status, 401);
  assert.equal(res.headers.get("x-colocate-cell"), "apac-jp");
  assert.match(res.headers.get("server-timing"), /^front;dur=[0-9.]+;desc="NRT"$/);
});

test("bad bindings answer 500 misconfigured naming the binding", async () => {
  const res = await ask({ ...env(), CELLS: "nope" });
  assert.equal(res.status, 500);
  assert.match((await res.json()).error.message, /CELLS/);
});

test("the front door pokes the ledger in the background, at most once per isolate per period", async () => {
  forget();
  forgetPoke();
  const waited = [];
  const c = { waitUntil: (p) => waited.push(p) };
  const e = fleetEnv([served("apac-jp"), served("eu-west"), served("us-east")]);
  e.LEDGER = ledger({ hang: true }); // a poke that never answers must not hold any response
  for (let i = 0; i < 5; i++) {
    const req = new Request("https://fleet.example/v1/models", { headers: { authorization: "Bearer clc_x" } });
    assert.equal((await front.fetch(req, e, c)).status, 200);
  }
  await Promise.resolve(); // the poke is made in a microtask of its waitUntil promise
  assert.equal(e.LEDGER.pokes, 1);
  assert.equal(waited.length, 1);
  forgetPoke();
});

test("Server-Timing names the front door's colo only when it is one", async () => {
  const timingAt = async (colo) => {
    forget();
    return (await ask(fleetEnv([served("a"), served("b"), served("c")]), { colo })).headers.get("server-timing");
  };
  assert.match(await timingAt("fra"), /^front;dur=[0-9.]+;desc="FRA", state;dur=0/);
  assert.match(await timingAt(undefined), /^front;dur=[0-9.]+, state;dur=0/);
  assert.match(await timingAt('NRT", x;dur=1'), /^front;dur=[0-9.]+, state;dur=0/); // never quoted into the header
  forget();
});

// --- a key refused by a cell's lease alone: the other cells are tried -------------------

// A cell as router.js answers a key its lease refuses while under its fleet-wide limit: 429
// marked `elsewhere` only to the front door (its token); to anyone else a plain 429.
function leaseFull(token, calls) {
  return async (req) => {
    calls.push({ front: req.headers.get("x-colocate-front"), defer: req.headers.get("x-colocate-fallback"),
      lease: req.headers.get("x-colocate-lease") });
    const marked = req.headers.get("x-colocate-front") === token;
    return new Response('{"error":{"code":"rate_limit_exceeded"}}', {
      status: 429, headers: { "retry-after": "1", ...(marked ? { "x-colocate-lease": "elsewhere" } : {}) },
    });
  };
}

function recorded(fn, calls) {
  return async (req) => {
    calls.push({ front: req.headers.get("x-colocate-front"), defer: req.headers.get("x-colocate-fallback"),
      lease: req.headers.get("x-colocate-lease") });
    return fn(req);
  };
}

test("a refusal by a cell's lease is retried on every other cell, nearest first, past the ranking's cut", async () => {
  forget();
  const calls = [[], [], []];
  // NRT's ranking is cut to apac-jp alone (its budget): the others are still tried, in the configured order.
  const e = fleetEnv([leaseFull("t0", calls[0]), leaseFull("t1", calls[1]), recorded(served(), calls[2])]);
  const cfg = readFleet(e, { NRT: [0] });
  assert.deepEqual(names(choose(cfg, "NRT")), ["apac-jp"]);
  const res = await ask(e, { colo: "NRT" });
  assert.equal(res.status, 200);
  assert.equal(res.headers.get("x-colocate-cell"), "us-east");
  assert.equal(res.headers.get("x-colocate-lease"), null);
  // Each cell once; the token to every cell but the last one left, which refuses as it would anyone.
  assert.deepEqual(calls, [
    [{ front: "t0", defer: null, lease: null }],
    [{ front: "t1", defer: null, lease: null }],
    [{ front: null, defer: null, lease: null }],
  ]);
  forget();
});

test("every cell's lease refusing: the client gets the last cell's plain 429, each cell asked once", async () => {
  forget();
  const calls = [[], [], []];
  const e = fleetEnv([leaseFull("t0", calls[0]), leaseFull("t1", calls[1]), leaseFull("t2", calls[2])]);
  readFleet(e, RANK);
  const res = await ask(e, { colo: "FRA" });
  assert.equal(res.status, 429);
  assert.equal(res.headers.get("retry-after"), "1");
  assert.equal(res.headers.get("x-colocate-lease"), null);
  assert.equal(res.headers.get("x-colocate-cell"), "apac-jp"); // FRA: eu-west, us-east, then apac-jp
  assert.deepEqual(calls.map((c) => c.map((x) => x.front)), [[null], ["t1"], ["t2"]]);
  assert.equal((await res.json()).error.code, "rate_limit_exceeded");
  forget();
});

test("a key over its fleet-wide limit (a plain 429) is not retried: refused traffic is not amplified", async () => {
  forget();
  const calls = [[], [], []];
  const over = async () => new Response('{"error":{"code":"rate_limit_exceeded"}}', { status: 429, headers: { "retry-after": "7" } });
  const e = fleetEnv([recorded(over, calls[0]), recorded(served(), calls[1]), recorded(served(), calls[2])]);
  readFleet(e, RANK);
  const res = await ask(e, { colo: "NRT" });
  assert.equal(res.status, 429);
  assert.equal(res.headers.get("retry-after"), "7");
  assert.deepEqual(calls.map((c) => c.length), [1, 0, 0]);
  forget();
});

test("a client's own lease and front headers are dropped: they reach no cell and cause no retry", async () => {
  forget();
  const calls = [[], [], []];
  // The last cell left is sent no token: even a cell that marks its refusal then is not retried.
  const marks = async () => new Response("{}", { status: 429, headers: { "x-colocate-lease": "elsewhere" } });
  const e = fleetEnv([leaseFull("t0", calls[0]), leaseFull("t1", calls[1]), recorded(marks, calls[2])]);
  readFleet(e, RANK);
  const req = new Request("https://fleet.example/v1/models", {
    headers: { authorization: "Bearer clc_x", "x-colocate-lease": "elsewhere", "x-colocate-front": "t2" },
  });
  Object.defineProperty(req, "cf", { value: { colo: "NRT" } });
  const res = await front.fetch(req, e, ctx);
  assert.equal(res.status, 429);
  assert.equal(res.headers.get("x-colocate-lease"), null);
  assert.equal(res.headers.get("x-colocate-cell"), "us-east");
  assert.deepEqual(calls, [
    [{ front: "t0", defer: "defer", lease: null }], // the front door's own token, never the client's
    [{ front: "t1", defer: null, lease: null }],
    [{ front: null, defer: null, lease: null }],
  ]);
  forget();
});

test("a lease refusal and the other cells unreachable: the client gets the refusal, not a 502", async () => {
  forget();
  const calls = [[]];
  const boom = async () => { throw new Error("down"); };
  const e = fleetEnv([leaseFull("t0", calls[0]), boom, boom]);
  readFleet(e, RANK);
  const res = await ask(e, { colo: "NRT" });
  assert.equal(res.status, 429);
  assert.equal(res.headers.get("x-colocate-lease"), null);
  assert.equal(res.headers.get("x-colocate-cell"), "apac-jp");
  assert.equal(calls[0].length, 1);
  forget();
});

// --- AFFINITY conversation: a conversation stays in its cell (docs/fleet.md) -------------

const turn = (c, k, auth = "Bearer clc_x") => {
  const messages = [{ role: "system", content: "be brief" }, { role: "user", content: `conversation ${c}` }];
  for (let j = 0; j < k; j++) messages.push({ role: "assistant", content: `a${j}` }, { role: "user", content: `q${j}` });
  const body = new TextEncoder().encode(JSON.stringify({ model: "m", messages }));
  return { body, request: new Request("https://fleet.example/v1/chat/completions", { method: "POST", headers: { authorization: auth } }) };
};

test("AFFINITY conversation: a conversation's cell is the same from every colo whose budget admits it, and conversations spread", () => {
  forget();
  const rank = { FRA: [1, 2, 0], IAD: [2, 1, 0], CDG: [1, 2], NRT: [0] };
  const cfg = readFleet(env({ AFFINITY: "conversation" }), rank);
  const per = { "apac-jp": 0, "eu-west": 0, "us-east": 0 };
  for (let c = 0; c < 300; c++) {
    const first = turn(c, 0);
    const p = conversationPoint(cfg, first.request, first.body);
    const home = choose(cfg, "FRA", 0, p)[0].name;
    per[home]++;
    for (let k = 1; k < 4; k++) {
      const later = turn(c, k);
      const q = conversationPoint(cfg, later.request, later.body);
      assert.equal(q, p); // later turns keep the point
      assert.equal(choose(cfg, "IAD", 0, q)[0].name, home); // same cells within budget: same cell
      // a colo whose budget leaves the home out: its own ranked cells, the home never among them
      if (home === "apac-jp") assert.ok(names(choose(cfg, "CDG", 0, q)).every((n) => n !== "apac-jp"));
      else assert.equal(choose(cfg, "CDG", 0, q)[0].name, home);
      assert.deepEqual(names(choose(cfg, "NRT", 0, q)), ["apac-jp"]); // the budget cut holds
    }
    assert.equal(choose(cfg, "FRA", 0, p).length, MAX_TRIES);
  }
  for (const n of Object.values(per)) assert.ok(n > 60, JSON.stringify(per)); // each about 100
  // another key's same conversation is placed on its own
  let same = 0;
  for (let c = 0; c < 300; c++) {
    const a = turn(c, 0);
    const b = turn(c, 0, "Bearer clc_y");
    if (choose(cfg, "FRA", 0, conversationPoint(cfg, a.request, a.body))[0] === choose(cfg, "FRA", 0, conversationPoint(cfg, b.request, b.body))[0]) same++;
  }
  assert.ok(same > 50 && same < 150, `same cell for ${same} of 300 (chance: 100)`);
});

test("AFFINITY conversation: a cell with no pod is passed over, and the conversation comes back after; nearest is the default", () => {
  forget();
  const rank = { FRA: [1, 2, 0] };
  const cfg = readFleet(env({ AFFINITY: "conversation" }), rank);
  const t = turn(7, 2);
  const p = conversationPoint(cfg, t.request, t.body);
  const [home, next] = choose(cfg, "FRA", 1000, p);
  remember(cfg, home, 1000);
  const moved = choose(cfg, "FRA", 1001, p);
  assert.equal(moved[0], next); // its next cell, while home is passed over
  assert.ok(!moved.includes(home) || moved.at(-1) === home);
  assert.equal(choose(cfg, "FRA", 6000, p)[0], home);
  forget();
  // nearest (the default): the point is not even computed, the ranked order holds
  const near = readFleet(env(), rank);
  assert.equal(conversationPoint(near, t.request, t.body), null);
  assert.deepEqual(names(choose(near, "FRA", 0, 12345)), ["eu-west", "us-east"]);
  // a body that is not JSON has no point (the cell refuses it); a bad AFFINITY names the binding
  assert.equal(conversationPoint(cfg, t.request, new TextEncoder().encode("{nope")), null);
  assert.throws(() => readFleet(env({ AFFINITY: "sticky" }), rank), /AFFINITY/);
});

test("AFFINITY conversation through front.js: every turn reaches the same cell from any colo", async () => {
  forget();
  const hits = [];
  const cellFn = (name) => async (req) => {
    hits.push(name);
    await req.text();
    return new Response('{"ok":true}', { headers: { "x-colocate-backend": "pod-0" } });
  };
  const e = fleetEnv([cellFn("apac-jp"), cellFn("eu-west"), cellFn("us-east")]);
  e.AFFINITY = "conversation";
  const cellsOf = new Set();
  for (let c = 0; c < 12; c++) {
    const seen = new Set();
    for (let k = 0; k < 3; k++) {
      const messages = [{ role: "user", content: `conv ${c}` }];
      for (let j = 0; j < k; j++) messages.push({ role: "assistant", content: "a" }, { role: "user", content: "b" });
      const res = await ask(e, { body: JSON.stringify({ model: "m", messages }), colo: ["NRT", "FRA", "IAD"][k] });
      assert.equal(res.status, 200);
      seen.add(res.headers.get("x-colocate-cell"));
    }
    assert.equal(seen.size, 1, `conversation ${c} moved: ${[...seen]}`);
    cellsOf.add([...seen][0]);
  }
  assert.ok(cellsOf.size >= 2, "12 conversations all in one cell");
});
