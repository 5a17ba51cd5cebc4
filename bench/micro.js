// Per-operation costs of the router's hot-path choices, inside workerd (bench/micro.py).
// GET /?op=NAME&n=N runs operation NAME N times on this request and answers a checksum;
// bench/micro.py reads the process's CPU time around it. Bench-only: never uploaded.
import { pathAndQuery } from "./routes.js";
import { clientInit } from "./forward.js";

const encoder = new TextEncoder();
const salts = new Map();
const CLIENT_ALLOWED = ["content-type", "cache-control", "retry-after", "x-request-id"];
let upstream = null; // a pod's answer (made in the first request: not allowed at module scope)
const SERVER_TIMING = "state;dur=0, upstream;dur=1.25, fallback;dur=0, total;dur=1.5";

const OPS = {
  // the path and query of a request: a URL object, or cut from the string (routes.js)
  url: (req) => {
    const u = new URL(req.url);
    return u.pathname.length + u.search.length;
  },
  cut: (req) => {
    const u = pathAndQuery(req.url);
    return u.pathname.length + u.search.length;
  },
  // a key's cache_salt field: encoded on every request, or once per key (forward.js)
  salt: () => encoder.encode(`"cache_salt":${JSON.stringify("key_0123456789ab")},`).length,
  saltcached: () => {
    let f = salts.get("key_0123456789ab");
    if (f === undefined) salts.set("key_0123456789ab", (f = encoder.encode(`"cache_salt":${JSON.stringify("key_0123456789ab")},`)));
    return f.length;
  },
  // the client's Response: a Headers init, then set() for ours; or one record (forward.js clientInit)
  headers: () => {
    const h = new Headers();
    for (const k of CLIENT_ALLOWED) {
      const v = upstream.headers.get(k);
      if (v !== null) h.set(k, v);
    }
    const res = new Response(null, { status: 200, statusText: "OK", headers: h });
    res.headers.set("x-colocate-backend", "pod-0");
    res.headers.set("server-timing", SERVER_TIMING);
    return res.status;
  },
  record: () => {
    const init = clientInit(upstream);
    init.headers["x-colocate-backend"] = "pod-0";
    init.headers["server-timing"] = SERVER_TIMING;
    return new Response(null, init).status;
  },
};

export default {
  fetch(request) {
    const q = new URL(request.url).searchParams;
    const op = OPS[q.get("op") ?? ""];
    if (!op) return new Response(`op: one of ${Object.keys(OPS).join(", ")}`, { status: 400 });
    const n = Number(q.get("n") ?? "0");
    upstream ??= new Response("{}", { headers: { "content-type": "application/json", "x-request-id": "r1", server: "pod" } });
    let sum = 0;
    for (let i = 0; i < n; i++) sum += op(request);
    return new Response(String(sum));
  },
};
