// The cost ladder for bench/ladder.py: bench/passthrough.js plus one piece of colocate's
// contract at a time, so each piece's CPU shows on its own. Bench-only: never uploaded.
// RUNG (a binding) picks how far up the ladder this copy goes:
//   credential  the pod's credential instead of the client's (a new Request, one header)
//   headers     + the two contract headers on a new Response (x-colocate-backend, Server-Timing)
//   deadline    + a deadline timer (AbortController, setTimeout/clearTimeout) around the fetch
// The next rung, bench/contract.js, adds the JS hop-header filter and holds both bodies.
// Beside the climb (named in --rungs of bench/ladder.py or bench/instructions.py), credential
// plus one held body, each read whole into JavaScript as the contract must
// (docs/benchmarks.md "The floors"):
//   held-request  the request's body, sent on as bytes (what a retry or the fallback resends)
//   held-answer   the pod's answer, returned from its bytes (what usage metering reads)
//   held-both     both
// and two ways to read a request body as JSON (credential plus the body, parsed, sent on):
//   parse-bytes   arrayBuffer(), TextDecoder, JSON.parse; the bytes sent (what the router does)
//   parse-text    text(), JSON.parse; the string sent (the runtime decodes and encodes)

const decoder = new TextDecoder();
let pods = null;
let next = 0;

export default {
  async fetch(request, env) {
    pods ??= JSON.parse(env.POD_URLS);
    const url = new URL(request.url);
    const req = new Request(pods[next++ % pods.length] + url.pathname + url.search, request);
    req.headers.set("authorization", `Bearer ${env.POD_TOKEN}`);
    if (env.RUNG === "credential") return fetch(req);
    if (env.RUNG === "parse-bytes" || env.RUNG === "parse-text") {
      let body;
      if (env.RUNG === "parse-bytes") {
        body = new Uint8Array(await req.arrayBuffer());
        JSON.parse(decoder.decode(body));
      } else {
        body = await req.text();
        JSON.parse(body);
      }
      return fetch(req.url, { method: req.method, headers: req.headers, body });
    }
    if (env.RUNG.startsWith("held-")) {
      const res = env.RUNG === "held-answer" ? await fetch(req)
        : await fetch(req.url, { method: req.method, headers: req.headers, body: await req.arrayBuffer() });
      return env.RUNG === "held-request" ? res : new Response(await res.arrayBuffer(), res);
    }
    let timer = null;
    let init;
    if (env.RUNG === "deadline") {
      const ac = new AbortController();
      timer = setTimeout(() => ac.abort(), 5000);
      init = { signal: ac.signal };
    }
    try {
      const res = await fetch(req, init);
      const out = new Response(res.body, res);
      out.headers.set("x-colocate-backend", "pod-0");
      out.headers.set("server-timing", "state;dur=0, upstream;dur=0, fallback;dur=0, total;dur=0");
      return out;
    } finally {
      if (timer !== null) clearTimeout(timer);
    }
  },
};
