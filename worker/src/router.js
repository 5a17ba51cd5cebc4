// @ts-check
// The request entry: dispatch, bad-input handling, and routing inference requests.
//
// A routed request, in order (docs/worker.md): the client key's shape (no I/O), the
// cached view of the generation (no wait while fresh), the key and its limits (from that
// view), the body, then a pod chosen among the healthy ones, one retry on another pod if
// the first fails before answering, and the fallback API last.

import { readBody, parseJsonObject } from "./body.js";
import { readConfig } from "./config.js";
import { ConfigurationError, HttpError, errorResponse, log, redact } from "./errors.js";
import {
  brokenEvent, callFallback, clientInit, fallbackBytes, healthOk, isStream, podFetch, streamable, tryPod, upstreamBody, upstreamHeaders,
} from "./forward.js";
import { assembleBytes } from "./assemble.js";
import { bearer, digestOf, looksLikeKey, remember, rememberedDigest, sameDigest } from "./keys.js";
import { estimate, leaseRefusal, mostTokens, neverFits, rateHeaders, refusal, underFleetLimit } from "./limits.js";
import { floorShare, provisionalLease } from "./fleetexchange.js";
import { COUNTER } from "./payloads.js";
import {
  POLICIES, begunAt, blameOf, candidates, finished, healthDue, leastLoaded, loadsOf, metricsDue, paceVerdict, queuedAt, started, unhurried,
  worthReporting,
} from "./pods.js";
import { judgeMiss, podBusy, scrapeMetrics } from "./busy.js";
import { counts as picks } from "./affinity.js";
import { CLIENT_COLO_HEADER, DEFER_HEADER, FRONT_HEADER, LEASE_HEADER, lookup, pathAndQuery } from "./routes.js";
import {
  admit, cache, currentView, findKey, freshEntry, hold, inflightHere, pendingCounter, pendingMonthTokens, promptHere, refused, report,
  reportPace, requestTrial, reservedHere, scheduleFlush, served, syncSoon, wantedDigest, withdraw,
} from "./state.js";
import { reasonOf } from "./refusals.js";
import { now, serverTiming } from "./timing.js";
import {
  capUsage, contentChars, estimateUsage, promptCount, streamCap, stripStream, tapStream, usageCeiling, usageOfAnswer, usageOfDoc, usageOfJson,
} from "./usage.js";
import { openTab } from "./tab.js";
import { pumpPod } from "./podstream.js";
import { fallbackFields, validateBody } from "./validate.js";
import { podFields } from "./podfields.js";
import { handleAdmin, tokenMatches } from "./admin.js";
import { clientAddress, returnLookup, takeLookup, takeTotal } from "./strangers.js";
import { fallbackCapRefusal, fallbackModel, fallbackShare, worstCost } from "./spendcap.js";
import { learnColo, recordCut, recordPick, recordQueue, recordRequest, recordStream } from "./histogram.js";

/**
 * @param {Request} request
 * @param {import("./payloads.js").Env} env  the bindings (see docs/worker.md)
 * @param {{waitUntil(p: Promise<unknown>): void}} ctx
 * @param {{fetch?: typeof fetch}} [deps]  tests may pass their own fetch (for the pods too)
 */
export async function handle(request, env, ctx, deps = {}) {
  const fetchImpl = deps.fetch || fetch;
  const hop = deps.fetch || podFetch(env);
  try {
    // Routed paths need only the path and query; the admin endpoints read the whole URL.
    const url = pathAndQuery(request.url);
    const r = lookup(url.pathname);
    if (!r) throw new HttpError(404, "not_found", `no route for ${url.pathname}`);
    if (!r.methods.includes(request.method)) {
      throw new HttpError(405, "method_not_allowed", `${request.method} is not allowed on ${url.pathname}; use ${r.methods.join(", ")}`,
        { allow: r.methods.join(", ") });
    }
    const cfg = readConfig(env);
    if (r.kind === "routed") {
      const res = await routed(request, env, ctx, cfg, url, r, fetchImpl, hop);
      learnColo(ctx, request, fetchImpl); // once per isolate, in the background, after the first answer
      return res;
    }
    return await handleAdmin(request, env, ctx, cfg, new URL(request.url), r, fetchImpl, hop);
  } catch (err) {
    releaseSlot(request); // a request that fails after admission gives its slot back
    if (err instanceof HttpError && err.holdMs) await new Promise((resolve) => setTimeout(resolve, err.holdMs));
    if (err instanceof HttpError) return errorResponse(err.status, err.code, err.message, err.headers, err.type, err.param);
    if (err instanceof ConfigurationError) {
      log(env, "misconfigured", { binding: err.binding });
      return errorResponse(500, "misconfigured", redact(err.message, env));
    }
    log(env, "internal_error", { error: String(err && err.name), message: String(err && err.message) });
    return errorResponse(500, "internal_error", "the router failed to handle this request");
  }
}

const BAD_KEY = "invalid API key: send Authorization: Bearer <client key> (clc_..., from scripts/keys.py create)";

/**
 * The client key of a request, checked against the cached view: the key's record.
 * Synchronous when this isolate accepted the key before and the view lists it (the warm
 * hot path); otherwise a promise (hashing, and perhaps a sync for a key created
 * elsewhere moments ago).
 */
function authenticate(request, env, cfg, entry, timing) {
  const presented = bearer(request);
  if (!presented) throw new HttpError(401, "missing_api_key", "missing API key: send Authorization: Bearer <client key> (clc_...)");
  // Only keys that had the right shape and were accepted are remembered, so a remembered
  // one needs no second look at its shape.
  const known = rememberedDigest(presented);
  if (known === undefined && !looksLikeKey(presented)) throw new HttpError(401, "invalid_api_key", BAD_KEY);
  if (entry.keys === null) {
    // Never seen the key list and the object is unreachable: not the client's fault.
    throw new HttpError(503, "state_unavailable", "the cell's state is unreachable; retry shortly", { "retry-after": "1" });
  }
  // The record was found under this very digest, so its hash is that digest: comparing
  // them again would compare a string with itself (authenticateSlow still compares, as a
  // check on findKey, off the warm path).
  const rec = known === undefined ? undefined : entry.keys.get(known);
  if (rec !== undefined) return usable(rec);
  return authenticateSlow(request, presented, env, cfg, entry, timing);
}

async function authenticateSlow(request, presented, env, cfg, entry, timing) {
  // A key this isolate has not accepted yet costs a hash and maybe a look-up: the caller's
  // address pays for it from its budget (strangers.js), and gets it back if the key is real.
  // A digest the key filter does not vouch for also draws on the isolate's total, so guesses
  // from rotating addresses use up only that, never a real key's look-up.
  const address = clientAddress(request);
  takeLookup(address, Date.now());
  const digest = await digestOf(presented);
  const vouched = cache.mayBeKey(cfg.activeGeneration, digest) === true;
  if (!vouched) takeTotal(Date.now());
  const key = await findKey(env, cfg, entry, digest, timing, vouched);
  if (!key || !sameDigest(key.hash, digest)) throw new HttpError(401, "invalid_api_key", BAD_KEY);
  returnLookup(address, !vouched);
  remember(presented, digest);
  return usable(key);
}

/** A stale view's sync also looks up the presented key when this isolate does not hold it. */
async function lookupWith(request, gen) {
  const presented = bearer(request);
  if (!presented || !looksLikeKey(presented)) return null;
  const d = wantedDigest(gen, await digestOf(presented));
  return d === null ? null : [d];
}

function usable(key) {
  if (key.expires_at !== null && Date.now() >= key.expires_at) {
    throw new HttpError(401, "expired_api_key", "this API key has expired: create a new one (scripts/keys.py create)");
  }
  return key;
}

// A key refused again within a second of its last refusal here has its 429 held back this
// long: a client that re-sends at once instead of honouring Retry-After then costs the
// isolate a few refusals a second per connection, not thousands, so it cannot take the
// router's CPU from other keys (docs/worker.md, "A client that ignores Retry-After"). A timer
// costs no CPU.
const REFUSAL_HOLD_MS = 250;
const refusedAt = new Map(); // key id -> when this isolate last refused it (bounded)

function holdFor(keyId, t) {
  const last = refusedAt.get(keyId);
  if (refusedAt.size >= 4096) refusedAt.clear();
  refusedAt.set(keyId, t);
  return last !== undefined && t - last < 1000 ? REFUSAL_HOLD_MS : 0;
}

// Requests holding a max_parallel slot: released when the answer has been sent (its last
// byte, or the client left) or when the request fails after admission.
const slots = new WeakMap();

function releaseSlot(request) {
  const release = slots.get(request);
  if (release) release();
}

/**
 * Refuse a request over one of the key's limits (429 with Retry-After; 400 when it can never
 * fit one), else admit it. Before its body is read (`ask` null) only a limit already used
 * up refuses, and the key's max_parallel slot is taken, so a key's uploads in flight are
 * its own limit's. Once the body is known, `ask` ({tokens, prompt}: its most tokens and
 * its prompt's, limits.js) is checked against each limit beside what is used and reserved,
 * and the request admitted, reserving them: returns when, and the x-ratelimit headers of
 * its answer.
 */
function enforceLimits(request, cfg, key, ask = null, json = null) {
  const t = Date.now();
  const gen = cfg.activeGeneration;
  const g = cache.count(gen, key.id);
  const est = estimate(g, pendingCounter(gen, key.id), t);
  const month = (g ? g[COUNTER.month_tokens] : 0) + pendingMonthTokens(gen, key.id, t);
  const held = ask !== null && slots.has(request); // its own slot, taken before the body, is not another's
  const inflight = key.max_parallel > 0 ? inflightHere(gen, key.id) + (g ? g[COUNTER.inflight] : 0) - (held ? 1 : 0) : 0;
  // What the key's requests in flight may still use (docs/worker.md, "What a request may cost").
  const reserved = key.tpm > 0 || key.monthly_tokens > 0 ? reservedHere(gen, key.id) + (g ? g[COUNTER.reserved] ?? 0 : 0) : 0;
  const promptLimit = key.max_parallel_tokens ?? cfg.keyDefaults.max_parallel_tokens;
  const asked = {
    tokens: ask === null ? 0 : ask.tokens, prompt: ask === null ? 0 : ask.prompt, promptLimit,
    promptInflight: promptLimit > 0 ? promptHere(gen, key.id) + (g ? g[COUNTER.prompt_inflight] ?? 0 : 0) : 0,
  };
  if (ask !== null) {
    const never = neverFits(key, asked, json);
    if (never) throw new HttpError(400, "request_too_large", never.message, {}, "invalid_request_error", never.param);
  }
  // In a fleet the cell's lease of the key bounds what it admits (a lone cell has none). A
  // held key whose lease this isolate dropped (idle past SERVED_KEEP_MS, state.js) gets its
  // floor share until a sync, started at once, brings the lease back: the least the ledger
  // counts for any cell (it may have cut the lease since), never the key's whole limit.
  const leased = cache.lease(gen, key.id);
  const lease = leased ?? provisionalLease(key, cache.fleetCells(gen), 0, floorShare);
  const no = refusal(key, est, month, t, inflight, reserved, asked) ?? (lease === undefined ? null : leaseRefusal(key, lease, est, month, reserved));
  if (no) {
    const headers = Object.fromEntries(rateHeaders(key, est, t, false, reserved));
    headers["retry-after"] = String(no.retryAfterS);
    const err = new HttpError(429, no.code, no.message, headers, no.type);
    err.reason = reasonOf(no);
    // Refused by this cell's share alone while the key is under its limit: another cell's
    // share may admit it. Only the front door can ask another cell (routed checks its token).
    if (no.byLease && request.headers.has(FRONT_HEADER) && underFleetLimit(key, lease, est, month, t)) err.elsewhere = { keyId: key.id, t };
    else err.holdMs = holdFor(key.id, t);
    throw err;
  }
  if (ask === null) {
    const slot = hold(cfg, key);
    if (slot) slots.set(request, slot);
    return null;
  }
  slots.set(request, admit(cfg, key, t, ask.tokens, promptLimit > 0 ? ask.prompt : 0, slots.get(request) ?? null));
  return { at: t, headers: rateHeaders(key, est, t, true, reserved), floor: leased === undefined && lease !== undefined };
}

async function routed(request, env, ctx, cfg, url, r, fetchImpl, hop) {
  const t0 = now();
  // `client`: the colo a fleet's front door received the request in (the live view's client colo)
  const timing = { state: 0, upstream: 0, fallback: 0, total: 0, client: null };
  const gen = cfg.activeGeneration;
  // The warm path awaits nothing until the body: a fresh view and a known key are sync.
  let entry = freshEntry(env, ctx, cfg);
  if (entry === null) {
    const v = await currentView(env, ctx, cfg, await lookupWith(request, gen));
    entry = v.entry;
    timing.state = v.wait;
  }
  let key = authenticate(request, env, cfg, entry, timing);
  if (key instanceof Promise) key = await key;
  let bytes = null;
  let json = null;
  // The most this request can cost (usage.js usageCeiling): reserved at admission, and what an
  // upstream's report is believed up to: a pod, the context it serves; the fallback (the
  // operator's own account, billed as it reports), the body's bytes and the completion limit.
  let ceiling = null;
  let fbCeiling = null;
  // The fallback's answers are priced for the model it was sent (spendcap.js), set when it is bought.
  let fbPrice = cfg.fallbackSpend.price;
  // Metering ends the request, once (tab.js): its max_parallel slot and its reservations are
  // freed then (a stream's, at its last byte), or when the client hangs up. The tab is opened
  // with the slot, before the body: a client that leaves mid-upload frees its slot there and is
  // charged nothing (no upstream was asked), as nothing after the read it was waiting on runs.
  const tab = openTab(request, ctx, (backend, usage) => {
    releaseSlot(request);
    if (backend !== null) {
      meterServed(env, ctx, cfg, key.id, backend, ceiling === null ? usage : ceiled(env, backend, usage, backend === "fallback" ? fbCeiling : ceiling),
        fbPrice);
    }
  }, null);
  if (r.json) {
    // The key's slot before its body: an upload in flight is its key's (bounded in time too).
    try {
      enforceLimits(request, cfg, key);
    } catch (err) {
      throw await refusedHere(env, ctx, cfg, request, key, err);
    }
    bytes = await readBody(request, cfg.maxBodyBytes, cfg.bodyTimeoutMs);
    json = parseJsonObject(bytes);
    validateBody(url.pathname, json, cfg.maxModelLen);
    ceiling = usageCeiling(json, bytes.length, cfg.maxModelLen);
    fbCeiling = usageCeiling(json, bytes.length);
    tab.know(ceiling, Number.isInteger(json.n) && json.n > 1 ? json.n : 1, promptCount(json));
  }
  // What a pod is sent: the fields and content parts it serves (podfields.js); a 400 names any other.
  const pod = json === null ? null : podFields(url.pathname, json, cfg.contentParts);
  // The live view's client colo is the front door's word, taken only with its token
  // (a client's own header would add labels at will).
  if (request.headers.has(CLIENT_COLO_HEADER) && (await fromFrontDoor(request, cfg))) timing.client = request.headers.get(CLIENT_COLO_HEADER);
  // The pod's deadline starts now: a slow upload is the client's time, not the pod's.
  const t1 = bytes === null ? t0 : now();
  let admitted;
  try {
    admitted = enforceLimits(request, cfg, key, ceiling === null ? { tokens: 0, prompt: 0 }
      : { tokens: mostTokens(json, ceiling, cfg.maxModelLen), prompt: ceiling.prompt }, json);
  } catch (err) {
    throw await refusedHere(env, ctx, cfg, request, key, err);
  }
  const limits = admitted.headers;
  if (admitted.floor) syncSoon(env, ctx, cfg); // the key's lease, in the background, now that it is asked for
  scheduleFlush(env, ctx, cfg);
  const meter = (backend, usage) => tab.settle(backend, usage);
  // Every stream is counted: the router asks for its usage event, and when the client did
  // not ask, takes it out of the client's stream (docs/worker.md, "Streams and tokens").
  const streamed = !!(json && json.stream === true);
  const wantUsage = streamed && !!json.stream_options && json.stream_options.include_usage === true;
  const askUsage = streamed && !wantUsage;
  const guess = (chars, c = ceiling) => estimateUsage(json, chars, c);
  // A stream past what the request can produce is cut there (usage.js streamCap).
  const cap = streamed || (json !== null && streamable(json)) ? streamCap(json, bytes.length, cfg.maxModelLen) : Infinity;
  const counted = (body, done, estimate = guess) => (askUsage ? stripStream(body, done, estimate, cap) : tapStream(body, wantUsage, done, estimate, cap));
  // Breaker blame (docs/worker.md, "Whose failure"): a pod's failure is reported once the
  // request's fate says whose it was, with the key it came from.
  const from = { key: key.id };
  const witness = (podUrl) => healthWitness(env, ctx, cfg, podUrl, hop);
  // A first-token deadline miss is judged apart (busy.js): a busy pod is not a broken one.
  let missed = null; // {url, ahead}: the pod that missed, and this isolate's requests waiting there before it
  const blame = (suspects, verdict) => {
    for (const s of suspects) {
      if (missed !== null && s === missed.url) judgeMiss(env, ctx, cfg, s, from, missed.ahead, verdict, hop, witness);
      else if (verdict === "pod") report(env, ctx, cfg, s, false, from, witness);
      else if (healthDue(s, Date.now())) ctx.waitUntil(witness(s));
    }
  };

  // The client's query string stays here: neither upstream is asked anything but the route.
  const path = url.pathname;
  const urls = cfg.podUrls;
  const tried = new Set();
  const suspects = []; // pods that failed this request, not reported yet
  // A client that asked for no stream is served from the pod's stream all the same, its
  // answer assembled (assemble.js), so the pod is judged by its first token and its pace;
  // but an answer of at most WHOLE_MAX_TOKENS is asked whole, within the first-token deadline
  // plus a token's allowance at the pace rule's rate for each token it may have (wholeMs):
  // one body costs the runtime a third less than a stream's events (docs/benchmarks.md), and
  // so short an answer has no pace to judge.
  const short = !streamed && ceiling !== null && ceiling.completion <= WHOLE_MAX_TOKENS;
  const assemble = !streamed && !short && streamable(json);
  const mode = streamed ? "stream" : assemble ? "assemble" : "whole";
  const assemblable = short && streamable(json);
  const budgetMs = short ? wholeMs(cfg, ceiling.completion) : cfg.deadlineMs;
  const chat = url.pathname === "/v1/chat/completions";
  const n = json === null ? 1 : Math.max(Number.isInteger(json.n) ? json.n : 1, 1);
  // The pod's prefix cache is salted per key (forward.js upstreamBody); the fallback takes no salt.
  // What a pod is sent: its fields only (podfields.js, those dropped logged by name). A pod's
  // stream is asked for continuous usage (podstream.js): a cut is charged what the pod made.
  const forPod = pod === null || pod.dropped.length === 0 ? bytes : droppedForPod(env, pod);
  const podJson = pod === null ? json : pod.json;
  const podBody = bytes === null ? null : upstreamBody(forPod, podJson, null, askUsage, key.id, assemble, true);
  // The engine's request id is the router's own, never the client's X-Request-Id (vLLM keys
  // its requests by it: a client's could name, and collide with, another key's request).
  const requestId = nextRequestId();
  const policy = POLICIES[cfg.balance];
  const info = { keyId: key.id, path: url.pathname, json, prefixBound: cfg.prefixBound };
  // The pace of an answer after its first token (pods.js paceVerdict): judged once, mid-stream
  // when it is already slow, else at its end; reported only when it says something.
  const judge = (podUrl, pace, view) => {
    if (pace.judged) return;
    const verdict = paceVerdict(pace, n, cfg.minTokensPerS);
    if (verdict === null) return;
    pace.judged = true;
    if (verdict === "slow" || (view.slow !== undefined && podUrl in view.slow)) reportPace(env, ctx, cfg, podUrl, verdict === "slow", from);
  };
  // At most two pods: the chosen one, and another healthy one if the first failed
  // before its first token and time is left.
  for (let attempt = 0; attempt < 2 && tried.size < urls.length; attempt++) {
    const view = cache.entry(gen).view; // reports and trials may have refreshed it
    const at = Date.now();
    const c = candidates(urls, view, at, cfg, tried);
    let index = c.pods.length ? policy(urls, unhurried(urls, c.pods, view, at), loadsOf(view), info) : -1;
    if (cfg.balance === "prefix" && index >= 0) recordPick(index, picks.lastShed, timing.client); // the live view's share sent by affinity
    let trial = false;
    if (index < 0 && c.trials.length) {
      const pick = c.trials[Math.floor(Math.random() * c.trials.length)];
      const t = now();
      try {
        trial = await requestTrial(env, cfg, urls[pick]);
      } catch (err) {
        log(env, "trial_failed", { message: String(err && err.message) });
      }
      timing.state += now() - t;
      if (trial) index = pick;
    }
    if (index < 0) break;
    const podUrl = urls[index];
    // A short answer is asked whole of a pod with no queue only: behind a queue its tokens come
    // at the queue's pace, so it is streamed and assembled, judged by its first token (busy.js).
    const asMode = mode === "whole" && short && assemblable && podBusy(podUrl, at) ? "assemble" : mode;
    const deadline = (asMode === mode ? budgetMs : cfg.deadlineMs) - (now() - t1);
    if (deadline <= 0) break;
    tried.add(index);
    // The pods' own load, for the next picks: every candidate's, so a pod passed over is not
    // judged on an old report (at most one scrape per pod a second, pods.js metricsDue).
    // At most METRICS_PER_REQUEST of them ride on one request (the rest on the next ones): a request
    // has six connections open at once, and its inference fetch must never wait for one
    // (docs/worker.md, "Subrequests per request").
    if (attempt === 0 && policy === leastLoaded) {
      let scrapes = 0;
      for (const i of c.pods) {
        if (scrapes >= METRICS_PER_REQUEST) break;
        if (metricsDue(urls[i], at)) {
          scrapes++;
          ctx.waitUntil(scrapeMetrics(hop, urls[i], cfg));
        }
      }
    }
    const t = now();
    started(podUrl);
    const backend = `pod-${index}`;
    tab.ask(backend);
    // Until its first token the request waits in the pod's queue, and its prompt holds its
    // key's max_parallel_tokens; the live view's `queue` is that wait.
    const ahead = queuedAt(podUrl);
    let waited = -1;
    const begin = () => {
      if (waited >= 0) return;
      waited = now() - t;
      begunAt(podUrl);
      slots.get(request)?.begun?.();
    };
    const res = await tryPod(hop, podUrl + path, {
      method: request.method,
      headers: upstreamHeaders(request.headers, cfg.podToken, requestId),
      body: asMode === mode ? podBody : upstreamBody(forPod, podJson, null, askUsage, key.id, true, true),
    }, deadline, asMode, cfg.stallMs, cap, cfg.minTokensPerS, tab, begin);
    begin(); // a whole answer's end, or an attempt that ended before any token
    timing.upstream += now() - t;
    if (res.ok || res.started || res.reason === "deadline") recordQueue(backend, timing.client, waited);
    if (res.ok) {
      // Another pod served what the first failed: that failure was the first pod's.
      blame(suspects, "pod");
      if (trial || worthReporting(view, podUrl, true)) report(env, ctx, cfg, podUrl, true, from);
      if (res.assembled) {
        finished(podUrl);
        const a = assembleBytes(res.bytes, chat, json);
        judge(podUrl, res.pace, view);
        if (a.error) return brokenAnswer(env, ctx, cfg, podUrl, from, witness, backend, res.bytes, meter, guess, timing, t0, limits, "error_event", tab.tally);
        meter(backend, usageOfDoc(a.answer, guess));
        return finish(a.bytes, assembledInit(res.response), backend, timing, t0, limits);
      }
      if (!res.stream) {
        finished(podUrl);
        // A request the pod refuses (a 4xx) is charged what the pod reports: vLLM reports no
        // usage with a 400, so nothing (it still counts as a request). docs/worker.md, "What a request may cost".
        meter(backend, json === null ? null : res.response.ok ? usageOfAnswer(res.bytes, guess) : usageOfJson(res.bytes));
        return finish(res.bytes, clientInit(res.response), backend, timing, t0, limits);
      }
      const pace = res.pace;
      if (pace) pace.onTick = (p) => judge(podUrl, p, view);
      const first = { at: now() }; // tryPod returns a stream once its first event has arrived
      // The pod's stream carries usage on every event (continuous usage): the client gets the
      // events it asked for, and a cut is charged what the pod had made (podstream.js).
      const want = { usage: wantUsage, continuous: wantUsage && json.stream_options.continuous_usage_stats === true };
      const tally = tab.tally;
      let broke = false; // the pod's stream broke off after its first token (a pod preempted or killed)
      const ended = (usage) => {
        finished(podUrl);
        usage ??= guess(tally.chars);
        meter(backend, usage); // what the client was sent, however it ended
        streamEnded(backend, timing.client, first, t0, usage);
        if (!pace) return;
        // A stall or a break after the first token is the pod's failure; the client saw the cut, an
        // error event (forward.js stallEvent, brokenEvent), counted for the live view and /metrics.
        if (pace.stalled || broke) {
          recordCut(backend, timing.client);
          report(env, ctx, cfg, podUrl, false, from, witness);
        } else judge(podUrl, pace, view);
      };
      const onBreak = () => {
        if (tab.hungUp) return null; // the client left: nobody reads an error event
        broke = true;
        return brokenEvent();
      };
      const tap = pace ? pumpPod(pace, want, tally, cap, ended, onBreak) : counted(res.response.body, ended);
      tab.pumping = true;
      ctx.waitUntil(tap.piped);
      return finish(tap.body, clientInit(res.response), backend, timing, t0, limits);
    }
    finished(podUrl);
    const { reason } = /** @type {{reason: string}} */ (res);
    log(env, "pod_failed", { reason, pod: index, generation: gen });
    if (res.started && reason !== "broken") {
      // The answer had begun: it is not bought again (docs/worker.md, "Routing"). A pod that
      // failed before it, as in any answer another pod began, failed on its own account.
      blame(suspects, "pod");
      return brokenAnswer(env, ctx, cfg, podUrl, from, witness, backend, res.bytes, meter, guess, timing, t0, limits, reason, tab.tally);
    }
    // An answer being assembled whose pod broke off (its connection lost: preempted, killed) has
    // sent its client nothing: another pod or the fallback serves it, as any failure before a
    // first token; what the lost pod made is not the client's to pay.
    suspects.push(podUrl);
    if (reason === "deadline") {
      missed = { url: podUrl, ahead };
      break; // no time is left for another pod
    }
  }

  if (request.headers.get(DEFER_HEADER) === "defer" && (await fromFrontDoor(request, cfg))) {
    // A fleet's front door asks for "no pod" rather than the paid fallback: it tries another
    // cell (docs/fleet.md). From anyone else the header is ignored: a client that could
    // defer would be served by no one yet have its request withdrawn from its limits.
    blame(suspects, blameOf(suspects.length, null)); // the next cell's outcome is not ours to know
    tab.settle(null, null);
    withdraw(cfg, key.id, admitted.at); // the next cell counts it: the fleet's limits count it once
    const none = errorResponse(503, "no_pod", "no pod of this cell can serve the request", { "x-colocate-pods-tried": String(tried.size) });
    return finish(none.body, none, "none", timing, t0);
  }
  // The fallback's money (spendcap.js): a model it may be sent, and room under its caps for
  // the most this request may cost, reserved until the answer's real cost is counted.
  const buy = fallbackModel(cfg, json);
  if (!buy.ok) {
    blame(suspects, blameOf(suspects.length, null));
    releaseSlot(request);
    const no = errorResponse(404, "model_not_found", `no pod could serve this request, and the fallback is not sent model `
      + `${JSON.stringify(String(json.model).slice(0, 64))}: it serves ${[...cfg.fallbackModels.keys()].slice(0, 8).join(", ")} `
      + "(colocate:fallbackModels)", {}, "invalid_request_error", "model");
    return finish(no.body, no, "none", timing, t0, limits);
  }
  const worst = bytes === null ? 0 : worstCost(buy.price, bytes.length, fbCeiling.completion);
  const capped = fallbackCapRefusal(cfg, key, Date.now(), worst, fallbackShare(cfg, key));
  if (!capped) slots.get(request)?.fallback?.(worst); // with the request's own reservation (state.js admit)
  fbPrice = buy.price;
  if (capped) {
    // Past the day's cap the fallback is not called: the request is refused, not bought.
    blame(suspects, blameOf(suspects.length, null));
    tab.settle(null, null);
    countRefusal(env, ctx, cfg, key.id, "fallback_cap");
    const no = errorResponse(429, "fallback_spend_cap", capped.message, { "retry-after": String(capped.retryAfterS) }, "insufficient_quota");
    return finish(no.body, no, "none", timing, t0, limits);
  }
  const t = now();
  let res;
  tab.ask("fallback", fbCeiling);
  const stop = new AbortController(); // the client hung up: the fallback's work stops (tab.js)
  tab.cancel = () => stop.abort();
  try {
    res = await callFallback(fetchImpl, cfg.fallbackUrl + path, {
      method: request.method,
      headers: upstreamHeaders(request.headers, cfg.fallbackApiKey),
      body: bytes === null ? null : fallbackBody(env, url.pathname, bytes, json, cfg, askUsage),
      signal: stop.signal,
    });
  } catch (err) {
    timing.fallback = now() - t;
    if (!(err instanceof HttpError)) throw err;
    blame(suspects, blameOf(suspects.length, null));
    meter("fallback", null);
    const error = errorResponse(err.status, err.code, err.message, {}, err.type);
    return finish(error.body, error, "fallback", timing, t0, limits);
  }
  blame(suspects, blameOf(suspects.length, res.status));
  if (streamed && isStream(res) && res.body) {
    timing.fallback = now() - t;
    const first = { at: now() }; // the fallback's headers: its first byte as near as the Worker sees it
    const tap = counted(res.body, (usage) => {
      meter("fallback", usage);
      streamEnded("fallback", timing.client, first, t0, usage);
    }, (chars) => guess(chars, fbCeiling));
    tab.pumping = true;
    ctx.waitUntil(tap.piped);
    return finish(tap.body, clientInit(res), "fallback", timing, t0, limits);
  }
  let body;
  try {
    body = await fallbackBytes(res);
  } catch (err) {
    if (!(err instanceof HttpError)) throw err;
    timing.fallback = now() - t;
    meter("fallback", null);
    const error = errorResponse(err.status, err.code, err.message, {}, err.type);
    return finish(error.body, error, "fallback", timing, t0, limits);
  }
  timing.fallback = now() - t;
  meter("fallback", res.ok && json !== null ? usageOfAnswer(body, (chars) => guess(chars, fbCeiling)) : null);
  return finish(body, clientInit(res), "fallback", timing, t0, limits);
}

// --- a stream's time to first byte and the gap between its tokens (the live view's ttft, itl) ---

/** A stream has ended: its ttft from the request's start `t0`, its itl over its completion tokens. */
function streamEnded(backend, client, first, t0, usage) {
  if (first.at >= 0) recordStream(backend, client, first.at - t0, now() - first.at, usage ? usage.completion : 0);
}

/**
 * A refusal by this cell's lease alone: to the front door, marked `elsewhere` (it tries the
 * other cells, docs/fleet.md) and answered at once, since the client has not been refused yet;
 * to anyone else, what any refusal is (held when repeated), and the header is ignored.
 */
async function leaseElsewhere(request, cfg, err) {
  if (await fromFrontDoor(request, cfg)) err.headers[LEASE_HEADER] = "elsewhere";
  else err.holdMs = holdFor(err.elsewhere.keyId, err.elsewhere.t);
  return err;
}

/**
 * A refusal by enforceLimits, counted per key and reason (refusals.js) unless the front door
 * tries another cell with it (the client is not refused yet).
 */
async function refusedHere(env, ctx, cfg, request, key, err) {
  const no = err instanceof HttpError && err.elsewhere ? await leaseElsewhere(request, cfg, err) : err;
  if (no instanceof HttpError && no.reason !== undefined && no.headers[LEASE_HEADER] !== "elsewhere") countRefusal(env, ctx, cfg, key.id, no.reason);
  return no;
}

/** Whether the request carries this cell's exchange token, as only its fleet's front door sends it. */
function fromFrontDoor(request, cfg) {
  const token = request.headers.get(FRONT_HEADER);
  return token === null ? false : tokenMatches(token, cfg.tokens.exchange);
}

/**
 * A keyless witness: GET <pod>/health, and a failed check reported as a failure of no key
 * (at most one check per pod per isolate a second, pods.js `healthDue`).
 */
function healthWitness(env, ctx, cfg, podUrl, fetchImpl) {
  return healthOk(fetchImpl, podUrl, cfg.deadlineMs, cfg.podToken).then((ok) => {
    return ok ? null : report(env, ctx, cfg, podUrl, false, { key: null, health: true });
  });
}

/**
 * The fallback's body: only the fields the owner agreed to send it (validate.js
 * `fallbackFields`, plus colocate:fallbackFields); the fields left out are logged by name.
 */
function fallbackBody(env, pathname, bytes, json, cfg, askUsage) {
  const allowed = fallbackFields(pathname, json, cfg.fallbackFields);
  if (allowed.dropped.length === 0) return upstreamBody(bytes, json, cfg.fallbackModel, askUsage);
  log(env, "fallback_fields_dropped", { fields: allowed.dropped.slice(0, 8).map((f) => f.slice(0, 40)), count: allowed.dropped.length });
  const body = { ...allowed.json };
  if (cfg.fallbackModel) body.model = cfg.fallbackModel;
  if (askUsage) body.stream_options = { ...json.stream_options, include_usage: true };
  return new TextEncoder().encode(JSON.stringify(body));
}

/** A pod's body without the OpenAI fields it does not serve (podfields.js), which are logged by name. */
function droppedForPod(env, pod) {
  log(env, "pod_fields_dropped", { fields: pod.dropped.slice(0, 8) });
  return new TextEncoder().encode(JSON.stringify(pod.json));
}

// The pods' request ids: 128 random bits each, from a pool crypto.getRandomValues refills every
// ID_BATCH requests (crypto.randomUUID on every request cost about 13k instructions).
const ID_BYTES = 16;
const ID_BATCH = 256;
const HEX2 = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, "0"));
let idPool = null;
let idAt = ID_BATCH;

function nextRequestId() {
  if (idAt === ID_BATCH) {
    idPool = crypto.getRandomValues(idPool ?? new Uint8Array(ID_BYTES * ID_BATCH));
    idAt = 0;
  }
  const from = idAt++ * ID_BYTES;
  let id = "";
  for (let i = from; i < from + ID_BYTES; i++) id += HEX2[idPool[i]];
  return id;
}

// The pods' /metrics reads one request may start: with the inference fetch, a failed one's health
// witness and the isolate's first trace, at most five connections are open at once (six allowed).
export const METRICS_PER_REQUEST = 2;

// The longest non-streamed answer asked of the pod whole (see `short` in routed).
export const WHOLE_MAX_TOKENS = 16;

/** A whole answer's time: the first-token deadline, plus each token it may have at the pace rule's rate. */
export function wholeMs(cfg, completionTokens) {
  return cfg.deadlineMs + Math.ceil((completionTokens * 1000) / Math.max(cfg.minTokensPerS, 1));
}

/** `usage` within what the request allows; a cut is logged (a pod that over-reports is broken or hostile). */
function ceiled(env, backend, usage, ceiling) {
  const u = capUsage(usage, ceiling);
  if (u && u.capped) log(env, "usage_capped", { backend, prompt: u.prompt, completion: u.completion });
  return u;
}

/** Count a refusal (a 429) against its key and reason, carried by the next sync (refusals.js). */
function countRefusal(env, ctx, cfg, keyId, reason) {
  refused(cfg, keyId, reason, Date.now());
  scheduleFlush(env, ctx, cfg);
}

/** Count a served request against its key (usage, tokens; a fallback answer's cost at `price`) and plan the flush. */
function meterServed(env, ctx, cfg, keyId, backend, usage, price) {
  served(cfg, keyId, Date.now(), backend, usage, price);
  try {
    scheduleFlush(env, ctx, cfg);
  } catch {
    // the request's context has ended: the next sync of this isolate carries it
  }
}

/**
 * An assembled answer whose pod failed after its first token (a stall, a broken or
 * oversized stream, an error event): 502 `upstream_stalled` or `upstream_broken`, never
 * the fallback (the answer had begun, and a slow long answer is not bought twice). What
 * was generated counts: what the pod reported by then (`tally`, its continuous usage), else
 * estimated from the text read; the failure is the pod's (reported
 * with the key: two keys, or a health check, open its breaker).
 */
function brokenAnswer(env, ctx, cfg, podUrl, from, witness, backend, bytes, meter, guess, timing, t0, limits, reason, tally = null) {
  report(env, ctx, cfg, podUrl, false, from, witness);
  meter(backend, (tally && tally.usage()) ?? guess(bytes ? contentChars(new TextDecoder().decode(bytes)) : 0));
  const stalled = reason === "stalled";
  const error = errorResponse(502, stalled ? "upstream_stalled" : "upstream_broken", stalled
    ? `the pod stopped sending the answer for ${cfg.stallMs} ms after it had begun; retry the request`
    : `the pod's answer broke off after it had begun (${reason}); retry the request`, {}, "server_error");
  return finish(error.body, error, backend, timing, t0, limits);
}

/** An assembled answer's init: JSON, with the pod's request id (the stream's other headers are a stream's). */
function assembledInit(res) {
  /** @type {Record<string, string>} */
  const headers = { "content-type": "application/json" }; // a record, as clientInit's: finish adds ours to it
  const id = res.headers.get("x-request-id");
  if (id !== null) headers["x-request-id"] = id;
  return { status: res.status, statusText: res.statusText, headers };
}

/** The client's response: `body` with the status and headers of `from` (a Response of ours,
 * or an upstream's `clientInit`), plus ours and the key's x-ratelimit `limits` headers. */
function finish(body, from, backend, timing, t0, limits = []) {
  timing.total = now() - t0;
  recordRequest(backend, timing); // the live view's histograms: memory only, carried by the next sync
  if (!(from instanceof Response)) {
    // an upstream's clientInit: our headers join its record, and the Response is built once
    const h = from.headers;
    h["x-colocate-backend"] = backend;
    h["server-timing"] = serverTiming(timing);
    for (const [name, value] of limits) h[name] = value;
    return new Response(body, from);
  }
  const res = new Response(body, from);
  res.headers.set("x-colocate-backend", backend);
  res.headers.set("server-timing", serverTiming(timing));
  for (const [name, value] of limits) res.headers.set(name, value);
  return res;
}
