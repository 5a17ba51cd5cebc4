// @ts-check
// The fleet's front door's request handling (the Worker's main module is frontindex.js).
// The Worker has no placement (it runs in the colo that received the request, beside the
// user) and is bound to each member cell's Worker by a service binding. It ranks the cells by the physical floor from its colo and sends the
// request to the nearest one that can serve; see docs/fleet.md.
//
// The ranking is the module cellrank.js ({colo: [cell index, ...]} nearest first; a colo it
// lacks uses 0..n-1), made by colocate/fleet/plan.py's plan. Bindings (from `plan_fleet` too):
//   CELLS         json: [{name, region}], index = position
//   CELL_<i>      service: cell i's router Worker
//   REMEMBER_MS   how long a cell that answered "no pod" is passed over (0: never)
//   MAX_BODY_BYTES  the body is buffered once (so it can be sent twice), up to this
//   CELL_TOKEN_<i>  secret: cell i's exchange token (the ledger's calls to the cell, and `defer`)
//   LEDGER        Durable Object namespace of FleetLedger (fleetledger.js): the limits exchange
//   EXCHANGE_MS   the exchange period
//   AFFINITY      nearest (default), or conversation: a conversation stays in one cell within budget
//
// The contract with a cell (worker/src/router.js): a request carrying
// `x-colocate-fallback: defer` and the cell's exchange token in `x-colocate-front` that finds no pod able to serve it is answered at once with
// 503 `no_pod` and `x-colocate-backend: none` instead of spending the paid fallback; a
// request carrying the token that the cell's lease of its key refuses while the key is under
// its fleet-wide limit is answered at once with 429 and `x-colocate-lease: elsewhere`, and
// the front door tries the other cells (docs/fleet.md, "A key that moves").

import { readBody } from "./body.js";
import { ConfigurationError, HttpError, errorResponse, log } from "./errors.js";
import {
  CELL_HEADER, DEFER_HEADER, FRONT_HEADER, LEASE_HEADER, choose, conversationPoint, isLeaseElsewhere, isNoPod, others, readFleet, remember,
} from "./fleetfront.js";
import { pokeLedger } from "./fleetexchange.js";
import { CLIENT_COLO_HEADER, lookup } from "./routes.js";
import { now, serverTiming } from "./timing.js";

const FRONT_METRICS = ["front"];
const COLO = /^[A-Za-z]{3}$/; // an IATA code; anything else (a forged cf-blob locally) is left out

/** `res` as the client sees it: which cell served, and the front door's own time (and colo) first. */
function finish(res, cell, frontMs, colo) {
  const out = new Response(res.body, res);
  out.headers.set(CELL_HEADER, cell.name);
  out.headers.delete(LEASE_HEADER); // between the front door and its cells only
  const inner = res.headers.get("server-timing");
  // desc = where the front door ran, so a probe can rank the cells as it did (docs/probe.md).
  const where = typeof colo === "string" && COLO.test(colo) ? `;desc="${colo.toUpperCase()}"` : "";
  out.headers.set("server-timing", serverTiming({ front: frontMs }, FRONT_METRICS) + where + (inner ? ", " + inner : ""));
  return out;
}

async function route(request, env, ctx) {
  const t0 = now();
  const url = new URL(request.url);
  const r = lookup(url.pathname);
  // Only the routed paths: /_colocate/* stays on each cell's own address.
  if (!r || r.kind !== "routed") throw new HttpError(404, "not_found", `no route for ${url.pathname}`);
  if (!r.methods.includes(request.method)) {
    throw new HttpError(405, "method_not_allowed", `${request.method} is not allowed on ${url.pathname}; use ${r.methods.join(", ")}`,
      { allow: r.methods.join(", ") });
  }
  const cfg = readFleet(env);
  pokeLedger(env, ctx, cfg); // the limits exchange runs while the fleet is used; never awaited here
  // Buffered once, bounded, so a second cell can be sent the same bytes.
  const body = r.json ? await readBody(request, cfg.maxBodyBytes) : null;
  const colo = request.cf && request.cf.colo;
  const tries = choose(cfg, colo, Date.now(), conversationPoint(cfg, request, body)); // AFFINITY conversation: its cell
  const deferring = tries.length - 1; // the ranked cells but the last may answer "no pod"
  let refused = null; // the latest refusal by a cell's lease: the answer if no later cell gives one
  for (let k = 0; k < tries.length; k++) {
    const cell = tries[k];
    const defer = k < deferring;
    // Whether another cell is left to try if this one's lease refuses the key.
    const more = k < tries.length - 1 || tries.length < cfg.cells.length;
    const headers = new Headers(request.headers);
    // Only the last ranked cell may spend the fallback; a client's own header never decides
    // it. Only the front door, with the cell's exchange token, may ask for `defer` or have a
    // refusal by lease marked: the last cell left to try refuses as it would anyone.
    headers.delete(FRONT_HEADER);
    headers.delete(LEASE_HEADER);
    if (defer) headers.set(DEFER_HEADER, "defer");
    else headers.delete(DEFER_HEADER);
    if (defer || more) headers.set(FRONT_HEADER, cfg.tokens[cell.index]);
    headers.delete("content-length"); // the runtime sets it from the buffered body
    // Where the client was, for the cell's live view (a client's own header is replaced or dropped).
    if (typeof colo === "string" && COLO.test(colo)) headers.set(CLIENT_COLO_HEADER, colo.toUpperCase());
    else headers.delete(CLIENT_COLO_HEADER);
    const t = now();
    let res;
    try {
      res = await cell.service.fetch(new Request(request.url, { method: request.method, headers, body }));
    } catch (err) {
      log(env, "cell_unreachable", { cell: cell.name, message: String(err && err.message) });
      remember(cfg, cell);
      if (refused && k === tries.length - 1) tries.push(...others(cfg, colo, tries)); // a share may be left elsewhere
      if (k < tries.length - 1) continue;
      if (refused) return finish(refused.res, refused.cell, now() - t0 - refused.spent, colo);
      throw new HttpError(502, "cell_unavailable", "no cell of the fleet could be reached; retry shortly", { "retry-after": "1" });
    }
    const spent = now() - t;
    if (defer && isNoPod(res)) {
      // Passed over for REMEMBER_MS only when the cell had no pod to try at all (breakers
      // open): one failed attempt is its breaker's business, not a verdict on the cell.
      if (res.headers.get("x-colocate-pods-tried") === "0") remember(cfg, cell);
      if (res.body) ctx.waitUntil(res.body.cancel().catch(() => {}));
      continue; // that cell's time stays in `front`: the client paid it on the way here
    }
    if (more && isLeaseElsewhere(res)) {
      // The key is under its limit and this cell's share is in use: every other cell, each
      // within its own share (so the fleet stays within the cap), at most once each.
      if (k === tries.length - 1) tries.push(...others(cfg, colo, tries));
      if (refused && refused.res.body) ctx.waitUntil(refused.res.body.cancel().catch(() => {}));
      refused = { res, cell, spent };
      continue;
    }
    if (refused && refused.res.body) ctx.waitUntil(refused.res.body.cancel().catch(() => {}));
    return finish(res, cell, now() - t0 - spent, colo);
  }
  // Unreachable: the last try either returns or throws.
  throw new HttpError(502, "cell_unavailable", "no cell of the fleet could serve this request");
}

export default {
  /** @param {Request} request @param {import("./payloads.js").FrontEnv} env @param {ExecutionContext} ctx */
  async fetch(request, env, ctx) {
    try {
      return await route(request, env, ctx);
    } catch (err) {
      if (err instanceof HttpError) return errorResponse(err.status, err.code, err.message, err.headers, err.type);
      if (err instanceof ConfigurationError) {
        log(env, "misconfigured", { binding: err.binding });
        return errorResponse(500, "misconfigured", err.message);
      }
      log(env, "internal_error", { error: String(err && err.name), message: String(err && err.message) });
      return errorResponse(500, "internal_error", "the front door failed to handle this request");
    }
  },
};
