// Test-only entry for tests/test_worker_hot_path.py (never uploaded): counts every call
// the product Worker makes on a Durable Object stub, whatever the method is called.
//
// It imports the product Worker (index.js, the cloud's bytes) and hands it an env whose
// BREAKER namespace returns counting stubs: any property call on a stub (fetch or an RPC
// method) adds one, then goes to the real stub (the object hosted in another service).
// Creating ids and stubs is local bookkeeping and is not counted. GET /__count/calls
// answers {"calls": n, "methods": {...}}; the names are for failure messages only.

import product from "./index.js";

let calls = 0;
const methods = {};
const envs = new WeakMap();

function countingStub(stub) {
  return new Proxy({}, {
    get(_target, prop) {
      if (prop === "then") return undefined; // not a thenable
      if (prop === "id" || prop === "name") return stub[prop];
      return (...args) => {
        calls += 1;
        methods[String(prop)] = (methods[String(prop)] || 0) + 1;
        return stub[prop](...args);
      };
    },
  });
}

function countingNamespace(ns) {
  return new Proxy(ns, {
    get(target, prop) {
      const value = target[prop];
      if (typeof value !== "function") return value;
      if (prop === "get" || prop === "getByName") return (...args) => countingStub(value.apply(target, args));
      return (...args) => value.apply(target, args);
    },
  });
}

function productEnv(env) {
  let out = envs.get(env);
  if (!out) {
    out = { ...env, BREAKER: countingNamespace(env.BREAKER) };
    envs.set(env, out);
  }
  return out;
}

export default {
  fetch(request, env, ctx) {
    if (new URL(request.url).pathname === "/__count/calls") return Response.json({ calls, methods });
    return product.fetch(request, productEnv(env), ctx);
  },
};
