// Per-operation costs of the router's hot-path choices, inside workerd (bench/micro.py).
// GET /?op=NAME&n=N runs operation NAME N times on this request and answers a checksum;
// bench/micro.py reads the process's CPU time around it. Bench-only: never uploaded.
import { pathAndQuery } from "./routes.js";
import { clientInit, upstreamHeaders } from "./forward.js";
import { parseJsonObject } from "./body.js";
import { validateBody } from "./validate.js";
import { hasUsageObject, usageOfAnswer } from "./usage.js";
import { Tally, clientEvents } from "./podstream.js";
import { serverTiming } from "./timing.js";
import { recordRequest } from "./histogram.js";

const encoder = new TextEncoder();
const salts = new Map();
const CLIENT_ALLOWED = ["content-type", "cache-control", "retry-after", "x-request-id"];
let upstream = null; // a pod's answer (made in the first request: not allowed at module scope)
// the bench's request body and its pod's answer (bench/harness.py, bench/pod.mjs)
const BODY = encoder.encode(JSON.stringify({ model: "bench", messages: [{ role: "user", content: "hi" }], max_tokens: 4 }));
const ANSWER = encoder.encode(JSON.stringify({ id: "chatcmpl-bench", object: "chat.completion", created: 0, model: "bench",
  choices: [{ index: 0, message: { role: "assistant", content: "ok ok ok ok" }, finish_reason: "stop" }],
  usage: { prompt_tokens: 4, completion_tokens: 4, total_tokens: 8 } }));
const estimate = () => null;
// a pod's event (vLLM 0.32's shape), without and with its continuous usage
const EVENT = '{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench","choices":[{"index":0,'
  + '"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]';
const PLAIN_EVENT = encoder.encode(`data: ${EVENT}}\n\n`);
const USAGE_EVENT = encoder.encode(`data: ${EVENT},"usage":{"prompt_tokens":4,"total_tokens":9,"completion_tokens":5}}\n\n`);
const NO_USAGE = { usage: false, continuous: false };
const tally = new Tally();
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
  // the router's own pure steps on every chat completion
  parse: () => validateBody("/v1/chat/completions", parseJsonObject(BODY)) ?? 1,
  usage: () => usageOfAnswer(ANSWER, estimate).prompt,
  upstream: (req) => (upstreamHeaders(req.headers, "pod-token").has("authorization") ? 1 : 0),
  timing: () => serverTiming({ state: 0, upstream: 1.25, fallback: 0, total: 1.5, client: null }).length,
  histogram: () => {
    recordRequest("pod-0", { state: 0, upstream: 1.25, fallback: 0, total: 1.5, client: null });
    return 1;
  },
  // a pod stream's event: what the router did per chunk before (a search for a usage object,
  // none found), and what it does now (the event's continuous usage found from its end and cut out)
  eventscan: () => (hasUsageObject(PLAIN_EVENT) ? 1 : 0),
  eventcut: () => clientEvents(USAGE_EVENT, NO_USAGE, tally).length,
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
