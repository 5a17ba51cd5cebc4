// The contract floor for bench/router.py: the least a Worker must do to keep
// colocate's contract, with none of the router's own logic (no keys, limits, metering,
// breaker or pod choice). Bench-only: never uploaded. Compared with bench/passthrough.js,
// it pays for exactly what the contract requires of any router in front of the pod:
//   - the pod's credential instead of the client's, and the hop headers dropped;
//   - the request body held, so that a retry on another pod or the fallback can resend it;
//   - a deadline timer that covers the whole non-streamed answer, or a stream's first event;
//   - a stream's chunks passed on through JavaScript that counts its events (a Pace: the
//     least a router that counts a stream's tokens can do), and
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
      "stream"); // no body is parsed here: an event stream passes as a stream
    if (!res.ok) return new Response(`pod failed: ${res.reason}`, { status: 502 });
    // A stream passes on chunk by chunk as the Pace reads it, which counts its events
    // (line feeds) and watches for stalls: the floor a router that counts a stream's tokens pays.
    const out = new Response(res.stream ? res.pace.stream() : res.bytes, res.response);
    out.headers.set("x-colocate-backend", `pod-${i}`);
    out.headers.set("server-timing", serverTiming({}));
    return out;
  },
};
