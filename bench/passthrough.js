// The floor for bench/router.py: a Worker that does nothing but fetch(pod) and
// return the answer. Same workerd, same compatibility date as the router (the bench
// renders both from the plan). Bench-only: never uploaded.
//
// POD_URLS is the router's binding (a JSON array); with several pods this takes them in
// turn, so that a multi-pod run has a floor with the same spread.

let pods = null;
let next = 0;

export default {
  fetch(request, env) {
    pods ??= JSON.parse(env.POD_URLS);
    const url = new URL(request.url);
    const pod = pods[next++ % pods.length];
    return fetch(pod + url.pathname + url.search, request);
  },
};
