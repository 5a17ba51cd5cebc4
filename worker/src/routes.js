// The Worker's HTTP surface: which paths exist and which methods each accepts.

export const ROUTES = {
  "/v1/chat/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/completions": { methods: ["POST"], kind: "routed", json: true },
  "/v1/models": { methods: ["GET"], kind: "routed", json: false },
  "/_colocate/probe": { methods: ["GET"], kind: "probe" },
  "/_colocate/breaker": { methods: ["GET", "PUT"], kind: "breaker" },
  "/_colocate/purge": { methods: ["POST"], kind: "purge" },
};

/** The route for a path, or null. */
export function lookup(pathname) {
  return Object.prototype.hasOwnProperty.call(ROUTES, pathname) ? ROUTES[pathname] : null;
}
