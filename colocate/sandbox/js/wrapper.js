// Sandbox-only entry module. It is never uploaded to Cloudflare.
//
// It imports the product Worker (index.js, byte-for-byte the cloud's) and hands its
// default handler an env whose BREAKER is a wrapper namespace, so that the hop to the
// state object costs what the emulated geography says it costs:
//   - the first use of a generation name asks the sandbox's control endpoint where the
//     object lives (it pins on first touch, like the real platform, and remembers);
//   - every call on the stub (fetch or an RPC method) waits RTT(edge, object site)/2,
//     is delegated to the real stub in the object-hosting service of that site, then
//     waits RTT/2 again.
// Each object-hosting service runs the same product modules with its own outbound that
// names its site, so the object's own /cdn-cgi/trace reports where it lives.
//
// Bindings the sandbox adds (stripped before the product sees env):
//   __SANDBOX_EDGE_SITE  text: the colo this Worker (or this object host) runs in
//   __SANDBOX_CONTROL    service: the pin control endpoint
//   __SANDBOX_NS_<SITE>  durable object namespace hosted at <SITE>

import product, { Breaker as ProductBreaker } from "./index.js";
export * from "./index.js";

const PREFIX = "__SANDBOX_";
// generation name -> {site, rtt_ms}, once the control endpoint answered: plain data, never a
// promise. A promise made in one request and awaited by another can never settle once its
// request ended (workerd's handle_cross_request_promise_resolution): a first caller that hung
// up mid-look-up left every later call of the isolate failing. Callers that arrive together
// each ask (the pin is made on first touch and never moves: they get the same answer).
const pins = new Map();
const envs = new WeakMap();

function sleep(ms) {
  return ms > 0 ? new Promise((resolve) => setTimeout(resolve, ms)) : Promise.resolve();
}

async function pinOf(env, name, hint) {
  const known = pins.get(name);
  if (known) return known;
  const q = new URLSearchParams({ name, edge: env.__SANDBOX_EDGE_SITE, hint: hint || "" });
  const r = await env.__SANDBOX_CONTROL.fetch(`http://sandbox-control/_sandbox/pin?${q}`);
  const body = await r.json();
  if (!r.ok) throw new Error(`sandbox: cannot place ${name}: ${body.error?.message ?? r.status}`);
  pins.set(name, body);
  return body;
}

function hostAt(env, site) {
  const ns = env[`${PREFIX}NS_${site}`];
  if (!ns) throw new Error(`sandbox: no object host for site ${site}; restart the sandbox (sandbox.py down, up)`);
  return ns;
}

class SandboxId {
  constructor(name, real) {
    this.name = name;
    this.real = real;
  }
  toString() {
    return this.real.toString();
  }
  equals(other) {
    return other instanceof SandboxId && other.name === this.name;
  }
}

function stubFor(env, id, options) {
  if (!(id instanceof SandboxId)) throw new Error("sandbox: only ids from idFromName() are emulated");
  const hint = options?.locationHint ?? "";
  return new Proxy(
    {},
    {
      get(_target, prop) {
        if (prop === "then") return undefined; // not a thenable
        if (prop === "id") return id;
        if (prop === "name") return id.name;
        return async (...args) => {
          const pin = await pinOf(env, id.name, hint);
          const ns = hostAt(env, pin.site);
          const real = ns.get(ns.idFromName(id.name));
          await sleep(pin.rtt_ms / 2);
          const out = await real[prop](...args);
          await sleep(pin.rtt_ms / 2);
          return out;
        };
      },
    },
  );
}

function wrappedNamespace(env) {
  const edgeHost = hostAt(env, env.__SANDBOX_EDGE_SITE);
  const ns = {
    idFromName: (name) => new SandboxId(String(name), edgeHost.idFromName(String(name))),
    get: (id, options) => stubFor(env, id, options),
    getByName: (name, options) => stubFor(env, ns.idFromName(name), options),
    idFromString() {
      throw new Error("sandbox: only named generations (idFromName) are emulated");
    },
    newUniqueId() {
      throw new Error("sandbox: only named generations (idFromName) are emulated");
    },
  };
  return ns;
}

function productEnv(env) {
  let out = envs.get(env);
  if (!out) {
    out = {};
    for (const [k, v] of Object.entries(env)) if (!k.startsWith(PREFIX)) out[k] = v;
    out.BREAKER = wrappedNamespace(env);
    envs.set(env, out);
  }
  return out;
}

export default {
  fetch(request, env, ctx) {
    return product.fetch(request, productEnv(env), ctx);
  },
};

// The object hosts run this entry too: the Breaker they host sees the same wrapped
// BREAKER, so an object reading through from a draining generation reaches that
// generation where it is pinned, at the emulated distance (not an empty local twin).
export class Breaker extends ProductBreaker {
  constructor(ctx, env) {
    super(ctx, productEnv(env));
  }
}
