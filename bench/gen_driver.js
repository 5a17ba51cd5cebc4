// Test- and bench-only entry (never uploaded): calls the generation object's RPC methods
// directly, the way many isolates would, through a namespace bound to the product's
// Breaker class in another service of the same workerd. Reachable only on a socket of a
// config built by bench/scale.py or tests/support/workerd.py, never in a deployed cell.
//
// POST /rpc {gen, calls: [[method, ...args], ...]} runs the calls concurrently on the
// object of generation `gen` and answers {results: [...], bytes: [JSON length of each]}.
// Binary values (a sync's key filter, keyfilter.js) travel between isolates and the object
// as bytes (RPC's structured clone), so each is answered as {binary_bytes: n} and counted as
// n bytes: JSON would write a 256 KB filter as a 3 MB object of indexes.

export default {
  async fetch(request, env) {
    if (request.method !== "POST" || new URL(request.url).pathname !== "/rpc") return new Response("not found", { status: 404 });
    const { gen, calls } = await request.json();
    const stub = env.BREAKER.get(env.BREAKER.idFromName(gen));
    const results = await Promise.all(calls.map(([method, ...args]) => stub[method](...args)));
    const texts = [];
    const bytes = [];
    for (const r of results) {
      let binary = 0; // a binary value's bytes, less its stand-in's JSON
      const text = JSON.stringify(r ?? null, (_key, value) => {
        if (!ArrayBuffer.isView(value)) return value;
        const shown = { binary_bytes: value.byteLength };
        binary += value.byteLength - JSON.stringify(shown).length;
        return shown;
      });
      texts.push(text);
      bytes.push(text.length + binary);
    }
    return new Response(`{"results":[${texts.join(",")}],"bytes":${JSON.stringify(bytes)}}`,
      { headers: { "content-type": "application/json" } });
  },
};
