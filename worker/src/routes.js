// @ts-check
// The Worker's HTTP surface: which paths exist and which methods each accepts.
// `routed` paths need a client key; every /_colocate path an operator credential.

// `roles`: the operator credential each method of a /_colocate path needs (admin.js
// `authorise`): "read" (READ_TOKEN or ADMIN_TOKEN), "admin" or "exchange".
export const ROUTES = {
  "/v1/chat/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/models": { methods: ["GET"], kind: "routed", json: false },
  "/_colocate/probe": { methods: ["GET"], kind: "probe", roles: { GET: "read" } },
  "/_colocate/breaker": { methods: ["GET", "PUT"], kind: "breaker", roles: { GET: "read", PUT: "admin" } },
  "/_colocate/purge": { methods: ["POST"], kind: "purge", roles: { POST: "admin" } },
  "/_colocate/keys": { methods: ["GET", "POST"], kind: "keys", roles: { GET: "read", POST: "admin" } },
  "/_colocate/keys/replica": { methods: ["GET", "POST"], kind: "replica", roles: { GET: "admin", POST: "admin" } },
  "/_colocate/usage": { methods: ["GET"], kind: "usage", roles: { GET: "read" } },
  "/_colocate/live": { methods: ["GET"], kind: "live", roles: { GET: "read" } },
  "/_colocate/metrics": { methods: ["GET"], kind: "metrics", roles: { GET: "read" } },
  // The scaling controller (colocate/scaling/controller.py) reads with the read token, takes the lock and records with the admin one.
  "/_colocate/scale": { methods: ["GET", "POST"], kind: "scale", roles: { GET: "read", POST: "admin" } },
  "/_colocate/scale/lock": { methods: ["POST"], kind: "scale_lock", roles: { POST: "admin" } },
  "/_colocate/fleet/counters": { methods: ["GET"], kind: "fleet_counters", roles: { GET: "exchange" } },
  "/_colocate/fleet/peers": { methods: ["GET", "POST"], kind: "fleet_peers", roles: { GET: "exchange", POST: "exchange" } },
};

// A fleet's front door asks a cell for "no pod" rather than its paid fallback with
// DEFER_HEADER: defer, and shows it is the front door with the cell's exchange token in
// FRONT_HEADER; a cell honours the first only with the second (router.js).
export const DEFER_HEADER = "x-colocate-fallback";
export const FRONT_HEADER = "x-colocate-front";
// A cell's 429 to the front door (FRONT_HEADER shown) marked `elsewhere`: refused by this
// cell's lease alone, the key under its fleet-wide limit, so another cell may admit it.
export const LEASE_HEADER = "x-colocate-lease";

/** Set by a fleet's front door on what it forwards: the colo it received the request in (routes.js: both Workers read it). */
export const CLIENT_COLO_HEADER = "x-colocate-client-colo";

/**
 * The path and query of a request's URL as `new URL(url)` has them (`pathname`, `search`),
 * cut from the string: the runtime hands a Worker its request's URL already serialized
 * ("scheme://host[:port]/path[?query]"), so both are substrings of it. Building a URL object
 * on every routed request cost more than the rest of the dispatch (bench/profile.py).
 * @param {string} url
 */
export function pathAndQuery(url) {
  const start = url.indexOf("/", url.indexOf("//") + 2);
  if (start < 0) return { pathname: "/", search: "" };
  let end = url.indexOf("#", start);
  if (end < 0) end = url.length;
  const q = url.indexOf("?", start);
  if (q < 0 || q >= end) return { pathname: url.slice(start, end), search: "" };
  return { pathname: url.slice(start, q), search: q + 1 < end ? url.slice(q, end) : "" };
}

const REVOKE = /^\/_colocate\/keys\/([A-Za-z0-9_]{1,64})\/revoke$/;

/** The route for a path, or null. A key's revoke path carries its id in `param`. */
export function lookup(pathname) {
  if (Object.prototype.hasOwnProperty.call(ROUTES, pathname)) return ROUTES[pathname];
  const m = REVOKE.exec(pathname);
  return m ? { methods: ["POST"], kind: "revoke", param: m[1], roles: { POST: "admin" } } : null;
}
