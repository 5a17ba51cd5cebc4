// The request entry: dispatch, bad-input handling, and routing inference requests.

import { readBody, parseJsonObject } from "./body.js";
import { readConfig } from "./config.js";
import { ConfigurationError, HttpError, errorResponse, log, redact } from "./errors.js";
import { callFallback, fallbackBody, tryPod, upstreamHeaders } from "./forward.js";
import { route } from "./machine.js";
import { lookup } from "./routes.js";
import { currentState, report, requestTrial } from "./state.js";
import { now, serverTiming } from "./timing.js";
import { handleAdmin } from "./admin.js";

/**
 * @param {Request} request
 * @param {object} env  the bindings (see docs/worker.md)
 * @param {{waitUntil(p: Promise<unknown>): void}} ctx
 * @param {{fetch?: typeof fetch}} [deps]  tests may pass their own fetch
 */
export async function handle(request, env, ctx, deps = {}) {
  const fetchImpl = deps.fetch || fetch;
  try {
    const url = new URL(request.url);
    const r = lookup(url.pathname);
    if (!r) throw new HttpError(404, "not_found", `no route for ${url.pathname}`);
    if (!r.methods.includes(request.method)) {
      throw new HttpError(405, "method_not_allowed", `${request.method} is not allowed on ${url.pathname}; use ${r.methods.join(", ")}`,
        { allow: r.methods.join(", ") });
    }
    const cfg = readConfig(env);
    if (r.kind === "routed") return await routed(request, env, ctx, cfg, url, r, fetchImpl);
    return await handleAdmin(request, env, ctx, cfg, url, r, fetchImpl);
  } catch (err) {
    if (err instanceof HttpError) return errorResponse(err.status, err.code, err.message, err.headers);
    if (err instanceof ConfigurationError) {
      log(env, "misconfigured", { binding: err.binding });
      return errorResponse(500, "misconfigured", redact(err.message, env));
    }
    log(env, "internal_error", { error: String(err && err.name), message: String(err && err.message) });
    return errorResponse(500, "internal_error", "the router failed to handle this request");
  }
}

async function routed(request, env, ctx, cfg, url, r, fetchImpl) {
  const t0 = now();
  let bytes = null;
  let json = null;
  if (r.json) {
    bytes = await readBody(request, cfg.maxBodyBytes);
    json = parseJsonObject(bytes);
  }
  const timing = { state: 0, upstream: 0, fallback: 0, total: 0 };
  const { snap, wait } = await currentState(env, ctx, cfg);
  timing.state = wait;

  let decision = route(snap, Date.now(), cfg);
  let trial = false;
  if (decision === "trial") {
    const t = now();
    try {
      trial = await requestTrial(env, cfg);
    } catch (err) {
      log(env, "trial_failed", { message: String(err && err.message) });
    }
    timing.state += now() - t;
    decision = trial ? "pod" : "fallback";
  }

  const path = url.pathname + url.search;
  if (decision === "pod") {
    const t = now();
    const deadline = Math.max(1, cfg.deadlineMs - (t - t0));
    const res = await tryPod(fetchImpl, cfg.podUrls[0] + path, {
      method: request.method,
      headers: upstreamHeaders(request.headers, cfg.podToken),
      body: bytes,
    }, deadline);
    timing.upstream = now() - t;
    report(env, ctx, cfg, snap, res.ok, trial);
    if (res.ok) return finish(res.response, "pod", timing, t0);
    log(env, "pod_failed", { reason: res.reason, generation: cfg.activeGeneration });
  }

  const t = now();
  let res;
  try {
    res = await callFallback(fetchImpl, cfg.fallbackUrl + path, {
      method: request.method,
      headers: upstreamHeaders(request.headers, cfg.fallbackApiKey),
      body: bytes === null ? null : fallbackBody(bytes, json, cfg.fallbackModel),
    });
  } catch (err) {
    timing.fallback = now() - t;
    if (!(err instanceof HttpError)) throw err;
    return finish(errorResponse(err.status, err.code, err.message), "fallback", timing, t0);
  }
  timing.fallback = now() - t;
  return finish(res, "fallback", timing, t0);
}

function finish(upstream, backend, timing, t0) {
  const res = new Response(upstream.body, upstream);
  timing.total = now() - t0;
  res.headers.set("x-colocate-backend", backend);
  res.headers.set("server-timing", serverTiming(timing));
  return res;
}
