// The contract floor for bench/router.py: the least a Worker must do to keep
// colocate's contract, with none of the router's own logic (no keys, limits, metering,
// breaker or pod choice). Bench-only: never uploaded. Compared with bench/passthrough.js,
// it pays for exactly what the contract requires of any router in front of the pod:
//   - the pod's credential instead of the client's, and the hop headers dropped;
//   - the request body held, so that a retry on another pod or the fallback can resend it;
//   - a deadline timer that covers the whole non-streamed answer;
//   - the answer's bytes in hand (the router reads the usage from them), and
//   - the two contract headers (x-colocate-backend, Server-Timing) on a new Response.
// It uses the router's own forward.js and timing.js, so those pieces cost the same here.

import { tryPod, upstreamHeaders } from "./forward.js";
import { serverTiming } from "./timing.js";

let pods = null;
let next = 0;

export default {
  async fetch(request, env) {
    pods ??= JSON.parse(env.POD_URLS);
    const url = new URL(request.url);
    const i = next++ % pods.length;
    const body = request.body ? await request.arrayBuffer() : null;
    const res = await tryPod(fetch, pods[i] + url.pathname + url.search,
      { method: request.method, headers: upstreamHeaders(request.headers, env.POD_TOKEN), body }, Number(env.DEADLINE_MS),
      true); // no body is parsed here: an event stream passes as a stream
    if (!res.ok) return new Response(`pod failed: ${res.reason}`, { status: 502 });
    const out = new Response(res.stream ? res.response.body : res.bytes, res.response);
    out.headers.set("x-colocate-backend", `pod-${i}`);
    out.headers.set("server-timing", serverTiming({}));
    return out;
  },
};
