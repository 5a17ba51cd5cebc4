// The Worker's HTTP surface: which paths exist and which methods each accepts.
// `routed` paths need a client key; every /_colocate path needs the probe token.

export const ROUTES = {
  "/v1/chat/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/models": { methods: ["GET"], kind: "routed", json: false },
  "/_colocate/probe": { methods: ["GET"], kind: "probe" },
  "/_colocate/breaker": { methods: ["GET", "PUT"], kind: "breaker" },
  "/_colocate/purge": { methods: ["POST"], kind: "purge" },
  "/_colocate/keys": { methods: ["GET", "POST"], kind: "keys" },
  "/_colocate/keys/replica": { methods: ["GET", "POST"], kind: "replica" },
  "/_colocate/usage": { methods: ["GET"], kind: "usage" },
  "/_colocate/live": { methods: ["GET"], kind: "live" },
  "/_colocate/metrics": { methods: ["GET"], kind: "metrics" },
  "/_colocate/fleet/counters": { methods: ["GET"], kind: "fleet_counters" },
  "/_colocate/fleet/peers": { methods: ["GET", "POST"], kind: "fleet_peers" },
};

const REVOKE = /^\/_colocate\/keys\/([A-Za-z0-9_]{1,64})\/revoke$/;

/** The route for a path, or null. A key's revoke path carries its id in `param`. */
export function lookup(pathname) {
  if (Object.prototype.hasOwnProperty.call(ROUTES, pathname)) return ROUTES[pathname];
  const m = REVOKE.exec(pathname);
  return m ? { methods: ["POST"], kind: "revoke", param: m[1] } : null;
}
