// @ts-check
// The front door's decisions, pure of I/O: reading its bindings, the order of cells for a
// colo, the isolate's memory of cells that had no pod, and the cell's "no pod" answer.
// front.js does the I/O (frontindex.js is the Worker's main module); see docs/fleet.md.

import CELL_RANK from "./cellrank.js";
import { ConfigurationError } from "./errors.js";
import { order, prefixHash } from "./affinity.js";

import { DEFER_HEADER, FRONT_HEADER, LEASE_HEADER } from "./routes.js";

export { DEFER_HEADER, FRONT_HEADER, LEASE_HEADER };
export const CELL_HEADER = "x-colocate-cell";
export const MAX_TRIES = 2; // cells per request: the nearest able one, and one more

const configs = new WeakMap();

function json(env, name) {
  const v = env[name];
  if (typeof v !== "string") return v; // a json binding arrives parsed
  try {
    return JSON.parse(v);
  } catch {
    throw new ConfigurationError(name, "is not JSON");
  }
}

function whole(env, name, min) {
  const n = Number(env[name]);
  if (env[name] === undefined || env[name] === "" || !Number.isInteger(n) || n < min) {
    throw new ConfigurationError(name, `must be a whole number >= ${min} (got ${JSON.stringify(env[name] ?? null)})`);
  }
  return n;
}

/**
 * The checked fleet configuration of this env (cached per env object); `rank` is the
 * ranking ({colo: [cell index, ...]}): the module cellrank.js, one per script.
 */
export function readFleet(env, rank = CELL_RANK) {
  let cfg = configs.get(env);
  if (cfg) return cfg;
  const cells = json(env, "CELLS");
  if (!Array.isArray(cells) || cells.length === 0 || !cells.every((c) => c && typeof c.name === "string" && c.name)) {
    throw new ConfigurationError("CELLS", "must be a JSON array of {name, region}");
  }
  const services = cells.map((_, i) => {
    const s = env[`CELL_${i}`];
    if (!s || typeof s.fetch !== "function") throw new ConfigurationError(`CELL_${i}`, "the cell's service binding is missing");
    return s;
  });
  // Each cell's exchange token: the ledger (fleetledger.js) reads and writes the cells' counters with
  // it, and a request sent with `defer` carries it to show it comes from the front door.
  const tokens = cells.map((_, i) => {
    const t = env[`CELL_TOKEN_${i}`];
    if (typeof t !== "string" || t === "") throw new ConfigurationError(`CELL_TOKEN_${i}`, "the cell's exchange token is missing");
    return t;
  });
  if (!env.LEDGER || typeof env.LEDGER.idFromName !== "function") {
    throw new ConfigurationError("LEDGER", "the FleetLedger Durable Object namespace binding is missing");
  }
  if (rank === null || typeof rank !== "object" || Array.isArray(rank)) {
    throw new ConfigurationError("cellrank.js", "must export an object {colo: [cell index, ...]}");
  }
  const n = cells.length;
  for (const [colo, order] of Object.entries(rank)) {
    // Nearest first; the plan leaves out the cells beyond the nearest one's e2e budget.
    const ok = Array.isArray(order) && order.length >= 1 && order.length <= n && new Set(order).size === order.length &&
      order.every((i) => Number.isInteger(i) && i >= 0 && i < n);
    if (!ok) throw new ConfigurationError("cellrank.js", `the order for ${colo} is not a list of distinct cell indexes below ${n}`);
  }
  const affinity = env.AFFINITY === undefined ? "nearest" : env.AFFINITY;
  if (affinity !== "nearest" && affinity !== "conversation") {
    throw new ConfigurationError("AFFINITY", `must be nearest or conversation (got ${JSON.stringify(affinity)})`);
  }
  cfg = Object.freeze({
    cells: cells.map((c, i) => Object.freeze({ index: i, name: c.name, region: c.region, service: services[i] })),
    names: Object.freeze(cells.map((c) => c.name)), // a conversation's order of cells hashes their names, not their indexes
    affinity,
    rank,
    fallbackOrder: Object.freeze(cells.map((_, i) => i)),
    rememberMs: whole(env, "REMEMBER_MS", 0),
    maxBodyBytes: whole(env, "MAX_BODY_BYTES", 1),
    exchangeMs: whole(env, "EXCHANGE_MS", 1),
    tokens: Object.freeze(tokens),
  });
  configs.set(env, cfg);
  return cfg;
}

// Cells that answered "no pod", by name -> time until which they are passed over. Module
// scope: one isolate's memory, gone with it; a few cells at most.
const noPodUntil = new Map();

/** Forget every remembered cell (tests). */
export function forget() {
  noPodUntil.clear();
}

/**
 * The cells to try for a request from `colo`, at most MAX_TRIES: the ranked order with the
 * cells remembered as "no pod" moved to the end (never dropped: if all are remembered, the
 * nearest is asked again rather than refusing). With AFFINITY conversation and the request's
 * `point` (conversationPoint), the able ranked cells, all within the e2e budget from `colo`, in
 * the point's rendezvous order instead: a conversation stays in one cell while that cell is
 * within budget of where its requests arrive and has pods, whichever colo or isolate they reach.
 * @param {number | null} [point]
 */
export function choose(cfg, colo, t = Date.now(), point = null) {
  const ranked = (typeof colo === "string" && cfg.rank[colo.toUpperCase()]) || cfg.fallbackOrder;
  const able = [];
  const passed = [];
  for (const i of ranked) {
    const until = noPodUntil.get(cfg.cells[i].name);
    if (until !== undefined && until > t) passed.push(i);
    else able.push(i);
  }
  const first = cfg.affinity === "conversation" && point !== null && able.length > 1 ? order(cfg.names, able, point) : able;
  return first.concat(passed).slice(0, MAX_TRIES).map((i) => cfg.cells[i]);
}

/**
 * A routed request's conversation point for the front door (affinity.js prefixHash), salted by
 * the presented bearer token (the front door knows no key ids; the token never leaves this
 * function), or null: AFFINITY nearest, no body, or a body that is not JSON (the cell refuses it).
 * @param {Uint8Array | null} body
 */
export function conversationPoint(cfg, request, body) {
  if (cfg.affinity !== "conversation" || body === null) return null;
  let json;
  try {
    json = JSON.parse(new TextDecoder().decode(body));
  } catch {
    return null;
  }
  return prefixHash(request.headers.get("authorization") || "", json);
}

/**
 * The cells not in `tried` that a request refused by a cell's lease may go to next: every
 * other cell of the fleet, the colo's ranked ones first (nearest first), then the rest in
 * the configured order. A slower answer beats a refusal, so the ranking's cut to the e2e
 * budget does not apply here.
 */
export function others(cfg, colo, tried) {
  const ranked = (typeof colo === "string" && cfg.rank[colo.toUpperCase()]) || [];
  const out = [];
  for (const i of [...ranked, ...cfg.fallbackOrder]) {
    const cell = cfg.cells[i];
    if (!tried.includes(cell) && !out.includes(cell)) out.push(cell);
  }
  return out;
}

export function remember(cfg, cell, t = Date.now()) {
  if (cfg.rememberMs > 0) noPodUntil.set(cell.name, t + cfg.rememberMs);
}

/** The answer of a cell that asked to be passed over (the contract in router.js). */
export function isNoPod(res) {
  return res.status === 503 && res.headers.get("x-colocate-backend") === "none";
}

/**
 * Whether a deferred cell's answer says it could not reach its state object before routing
 * (router.js: 503 `state_unavailable`, no `x-colocate-backend`): nothing was admitted there or
 * sent to a pod, so another cell may serve it. Only that code: `key_lookup_busy` (a flood of
 * unknown keys at that edge) stays with the client, so a flood is not passed on to the next cell.
 * @param {Response} res @param {string} text its body
 */
export function isStateUnavailable(res, text) {
  if (res.status !== 503 || res.headers.has("x-colocate-backend")) return false;
  try {
    return JSON.parse(text)?.error?.code === "state_unavailable";
  } catch {
    return false;
  }
}

/** A cell's refusal by its lease alone, of a key under its fleet-wide limit (router.js): another cell may admit it. */
export function isLeaseElsewhere(res) {
  return res.status === 429 && res.headers.get(LEASE_HEADER) === "elsewhere";
}
