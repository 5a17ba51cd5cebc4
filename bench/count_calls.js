// Test-only entry for tests/test_worker_hot_path.py and tests/support/workerd.py (never
// uploaded): counts every call the product Worker makes on a Durable Object stub,
// whatever the method is called, and whether it was made on the hot path.
//
// It imports the product Worker (index.js, the cloud's bytes) and hands each request an
// env whose BREAKER namespace returns counting stubs: any property call on a stub (fetch
// or an RPC method) adds one, then goes to the real stub. A call made before the
// product's fetch handler returned its Response counts as `hot` (the client waited for
// it); one made after (a ctx.waitUntil report or batched sync) counts as `background`.
// Creating ids and stubs is local bookkeeping and is not counted.
// GET /__count/calls answers {"calls", "hot", "background", "methods"}.

import product from "./index.js";
export * from "./index.js";

const counts = { calls: 0, hot: 0, background: 0, methods: {} };

function countingStub(stub, req) {
  return new Proxy({}, {
    get(_target, prop) {
      if (prop === "then") return undefined; // not a thenable
      if (prop === "id" || prop === "name") return stub[prop];
      return (...args) => {
        counts.calls += 1;
        if (req.responded) counts.background += 1;
        else counts.hot += 1;
        counts.methods[String(prop)] = (counts.methods[String(prop)] || 0) + 1;
        return stub[prop](...args);
      };
    },
  });
}

function countingNamespace(ns, req) {
  return new Proxy(ns, {
    get(target, prop) {
      const value = target[prop];
      if (typeof value !== "function") return value;
      if (prop === "get" || prop === "getByName") return (...args) => countingStub(value.apply(target, args), req);
      return (...args) => value.apply(target, args);
    },
  });
}

export default {
  async fetch(request, env, ctx) {
    if (new URL(request.url).pathname === "/__count/calls") return Response.json(counts);
    const req = { responded: false };
    try {
      return await product.fetch(request, { ...env, BREAKER: countingNamespace(env.BREAKER, req) }, ctx);
    } finally {
      req.responded = true;
    }
  },
};
