// bench/passthrough.js plus what it costs a Worker to learn when a stream has ended: the
// pod's body piped by the runtime into an IdentityTransformStream, the pipe's promise kept
// alive with waitUntil. The router pays this for every stream when it has several pods
// (fewest-in-flight must know when a pod is free again; worker/src/usage.js tapStream).
// Not a rung of the climb: bench/ladder.py times it and bench/instructions.py counts it when
// named, as in `--rungs bare,ends,contract,router --request stream --pods 2`. Bench-only:
// never uploaded.

let pods = null;
let next = 0;

export default {
  async fetch(request, env, ctx) {
    pods ??= JSON.parse(env.POD_URLS);
    const url = new URL(request.url);
    const res = await fetch(pods[next++ % pods.length] + url.pathname + url.search, request);
    const ts = new IdentityTransformStream();
    const end = () => {};
    ctx.waitUntil(res.body.pipeTo(ts.writable).then(end, end));
    return new Response(ts.readable, res);
  },
};
