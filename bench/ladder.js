// The cost ladder for bench/ladder.py: bench/passthrough.js plus one piece of colocate's
// contract at a time, so each piece's CPU shows on its own. Bench-only: never uploaded.
// RUNG (a binding) picks how far up the ladder this copy goes:
//   credential  the pod's credential instead of the client's (a new Request, one header)
//   headers     + the two contract headers on a new Response (x-colocate-backend, Server-Timing)
//   deadline    + a deadline timer (AbortController, setTimeout/clearTimeout) around the fetch
// The next rung, bench/contract.js, adds the JS hop-header filter and holds both bodies.

let pods = null;
let next = 0;

export default {
  async fetch(request, env) {
    pods ??= JSON.parse(env.POD_URLS);
    const url = new URL(request.url);
    const req = new Request(pods[next++ % pods.length] + url.pathname + url.search, request);
    req.headers.set("authorization", `Bearer ${env.POD_TOKEN}`);
    if (env.RUNG === "credential") return fetch(req);
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
