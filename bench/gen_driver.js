// Test- and bench-only entry (never uploaded): calls the generation object's RPC methods
// directly, the way many isolates would, through a namespace bound to the product's
// Breaker class in another service of the same workerd. Reachable only on a socket of a
// config built by bench/scale.py or tests/support/workerd.py, never in a deployed cell.
//
// POST /rpc {gen, calls: [[method, ...args], ...]} runs the calls concurrently on the
// object of generation `gen` and answers {results: [...], bytes: [JSON length of each]}.

export default {
  async fetch(request, env) {
    if (request.method !== "POST" || new URL(request.url).pathname !== "/rpc") return new Response("not found", { status: 404 });
    const { gen, calls } = await request.json();
    const stub = env.BREAKER.get(env.BREAKER.idFromName(gen));
    const results = await Promise.all(calls.map(([method, ...args]) => stub[method](...args)));
    return Response.json({ results, bytes: results.map((r) => JSON.stringify(r ?? null).length) });
  },
};
