// @ts-check
// The operator endpoints: probe, live view, breaker, purge, client keys, usage and the
// fleet's exchange, each behind the one operator credential its route names (routes.js
// `roles`; docs/worker.md, "Who holds what"). A client key never opens them.

import { readBody, parseJsonObject } from "./body.js";
import { HttpError, jsonResponse, log } from "./errors.js";
import { FORCE_VALUES } from "./machine.js";
import { displayPrefix, keyHash, newKey, newKeyId, sameDigest } from "./keys.js";
import { dayOf, monthStartDay } from "./limits.js";
import { podSnap } from "./pods.js";
import { cache, activeStub, infoOf, stubFor, sync, syncFailed } from "./state.js";
import { BUCKETS, LOW_MS, PER_OCTAVE, TOP, mergeEncoded } from "./histogram.js";
import { CONTENT_TYPE, exposition } from "./metrics.js";
import { podPrefixCaches } from "./podmetrics.js";
import { fetchColo, rayColo } from "./trace.js";
import { MAX_CELLS, badLeases, badRows, goodRows, upgradeRow } from "./fleetexchange.js";
import { EXCHANGE, LEASE } from "./payloads.js";
import { now, serverTiming, POD_PROBE_METRICS, PROBE_METRICS } from "./timing.js";

const ADMIN_BODY_LIMIT = 4096;
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$/;
const DAY_RE = /^\d{4}-\d{2}-\d{2}$/;
// fallback_microusd_day: the key's own cap on the fallback's spend per UTC day, in millionths
// of a dollar (0: colocate:fallbackCap.keyUsdPerDay, the cell's cap for every key).
// max_parallel_tokens: prompt tokens of the key's requests not yet begun at a pod, at once.
const LIMIT_FIELDS = ["rpm", "tpm", "monthly_tokens", "max_parallel", "max_parallel_tokens", "fallback_microusd_day"];

/** Constant-time comparison: both sides are hashed to equal length, then every character is compared. */
export async function tokenMatches(given, expected) {
  if (typeof given !== "string") return false;
  const [a, b] = await Promise.all([keyHash(given), keyHash(expected)]);
  return sameDigest(a, b);
}

// Which credentials open a role: an admin may also read; the exchange's only exchanges.
const OPENS = { read: ["read", "admin"], admin: ["admin"], exchange: ["exchange"] };
const HOLDER = { read: "READ_TOKEN", admin: "ADMIN_TOKEN", exchange: "EXCHANGE_TOKEN" };

/**
 * Refuse a request whose bearer credential does not open `role` ("read", "admin" or
 * "exchange"): 401 when it is no operator credential at all, 403 when it is one that
 * holds less (a read-only token asking to mint a key). Every comparison is constant-time.
 * Returns the roles the credential holds.
 */
export async function authorise(request, cfg, role) {
  const header = request.headers.get("authorization") || "";
  const m = /^Bearer\s+(.+)$/i.exec(header);
  if (!m) throw new HttpError(401, "unauthorized", `send Authorization: Bearer <${HOLDER[role]}>`);
  const given = await keyHash(m[1].trim());
  const held = Object.keys(HOLDER).filter((r) => cfg.tokens[r] !== undefined);
  const digests = await Promise.all(held.map((r) => digestOfToken(cfg.tokens[r])));
  const matched = held.filter((r, i) => sameDigest(given, digests[i]));
  if (matched.some((r) => OPENS[role].includes(r))) return matched;
  if (matched.length) {
    throw new HttpError(403, "forbidden", `this credential cannot ${request.method} ${new URL(request.url).pathname}: it needs ${HOLDER[role]}`);
  }
  throw new HttpError(401, "unauthorized", `the credential is wrong: this endpoint takes ${HOLDER[role]}`);
}

// The configured tokens' digests, once per token per isolate.
const tokenDigests = new Map();

async function digestOfToken(token) {
  let d = tokenDigests.get(token);
  if (d === undefined) {
    d = await keyHash(token);
    if (tokenDigests.size >= 16) tokenDigests.clear();
    tokenDigests.set(token, d);
  }
  return d;
}

async function jsonBody(request, limit = ADMIN_BODY_LIMIT) {
  return parseJsonObject(await readBody(request, limit));
}

const HANDLERS = {
  probe: (request, env, cfg, url, r, fetchImpl, hop, hosts) => probe(request, env, cfg, url, fetchImpl, hop, hosts),
  breaker: (request, env, cfg, url, r, fetchImpl, hop, hosts) => breaker(request, env, cfg, hosts),
  purge: (request, env, cfg) => purge(request, env, cfg),
  keys: (request, env, cfg) => (request.method === "POST" ? createKey(request, env, cfg) : listKeys(env, cfg)),
  revoke: (request, env, cfg, url, r) => revokeKey(env, cfg, r.param),
  replica: (request, env, cfg) => (request.method === "POST" ? importKey(request, env, cfg) : keyDigests(env, cfg)),
  usage: (request, env, cfg, url) => usage(env, cfg, url),
  live: (request, env, cfg, url, r, fetchImpl, hop, hosts) => live(env, cfg, url, hosts, hop),
  scale: (request, env, cfg) => (request.method === "POST" ? scaleRecord(request, env, cfg) : scaleState(env, cfg)),
  scale_lock: (request, env, cfg) => scaleLock(request, env, cfg),
  metrics: (request, env, cfg, url, r, fetchImpl, hop) => metrics(env, cfg, hop),
  fleet_counters: (request, env, cfg, url) => fleetCounters(env, cfg, url),
  fleet_peers: (request, env, cfg, url) => (request.method === "POST" ? setPeers(request, env, cfg) : peersOf(env, cfg, url)),
};

export async function handleAdmin(request, env, ctx, cfg, url, r, fetchImpl, hop) {
  const roles = await authorise(request, cfg, r.roles[request.method]);
  // Pod hosts (addresses) only to the admin credential: a read-only answer names pods by
  // index, so the token monitoring holds does not hand out where the pods are.
  const hosts = roles.includes("admin");
  return HANDLERS[r.kind](request, env, cfg, url, r, fetchImpl, hop, hosts);
}

const noStore = { "cache-control": "no-store" };

async function health(fetchImpl, url, deadlineMs, headers, json = true) {
  const t = now();
  try {
    const init = { signal: AbortSignal.timeout(deadlineMs) };
    if (headers) init.headers = headers;
    const res = await fetchImpl(url, init);
    const body = res.ok && json ? await res.json().catch(() => null) : (await res.body?.cancel().catch(() => {}), null);
    return { ms: now() - t, ok: res.status === 200, status: res.status, body };
  } catch {
    return { ms: now() - t, ok: false, status: null, body: null };
  }
}

/** One authenticated GET of the fallback's model list: is the fallback usable as configured? */
async function fallbackCheck(cfg, fetchImpl) {
  const h = await health(fetchImpl, cfg.fallbackUrl + "/v1/models", cfg.deadlineMs, { authorization: `Bearer ${cfg.fallbackApiKey}` });
  const ids = h.body && Array.isArray(h.body.data) ? h.body.data.map((m) => m && m.id) : null;
  const listed = cfg.fallbackModel && ids ? ids.includes(cfg.fallbackModel) : null;
  let error = null;
  if (!h.ok) error = h.status === null ? "unreachable" : `status ${h.status}`;
  else if (listed === false) error = `FALLBACK_MODEL is not among the fallback's models`;
  return { ok: h.ok && listed !== false, status: h.status, rtt_ms: round(h.ms), model: cfg.fallbackModel, model_listed: listed, error };
}

/** The breaker as operators read it: pod 0's machine state and the override, plus every pod. */
function breakerView(cfg, view, hosts) {
  const pods = cfg.podUrls.map((u, index) => ({ index, ...(hosts ? { host: new URL(u).host } : {}), ...podSnap(view, u) }));
  // A cell scaled to zero routes to no pod: its machine reads closed, with the override as set.
  const { state, failures, opened_at, trial_at } = pods[0] ?? { state: "closed", failures: 0, opened_at: null, trial_at: null };
  return { state, failures, opened_at, trial_at, forced: view.forced, updated_at: view.forced_at,
    imported: view.imported, importing: view.importing ?? [], pods };
}

/** Every pod's GET /health over the pod hop, in POD_URLS order, with the pod token (the pod's guard opens /health to it). */
function checkPods(cfg, hop) {
  const auth = { authorization: `Bearer ${cfg.podToken}` };
  return Promise.all(cfg.podUrls.map((u) => health(hop, u + "/health", cfg.deadlineMs, auth, false)));
}

/** The probe's `pods` list from those checks. */
function podEntries(cfg, pods, hosts) {
  return pods.map((p, index) => ({ index, ...(hosts ? { host: new URL(cfg.podUrls[index]).host } : {}), rtt_ms: round(p.ms), ok: p.ok,
    status: p.status }));
}

/** The pods' health checks alone (`?only=pods`): the probe's new-connection samples time the
 * pod hop, and a split cell's state round trip would only make them slower to take. */
async function probePods(cfg, hop, t0, hosts) {
  const pods = await checkPods(cfg, hop);
  const body = { generation: cfg.activeGeneration, region: cfg.region, pods: podEntries(cfg, pods, hosts) };
  const timing = serverTiming({ pod_rtt: pods.length ? pods[0].ms : 0, total: now() - t0 }, POD_PROBE_METRICS);
  return jsonResponse(200, body, { "server-timing": timing, ...noStore });
}

async function probe(request, env, cfg, url, fetchImpl, hop, hosts) {
  const t0 = now();
  const only = url.searchParams.get("only");
  if (only === "pods") return probePods(cfg, hop, t0, hosts);
  if (only !== null) throw new HttpError(400, "invalid_field", `query "only" must be "pods" (got ${JSON.stringify(only)})`);
  // The first touch of a new generation: stubFor passes ACTIVE_HINT as locationHint.
  const stub = activeStub(env, cfg);
  // Asked together with the sync, not after it: a split cell's probe waits one round trip to
  // its state object, not two. A new object busy with its first sync (a migration's import)
  // may hold the answer past its trace timeout: then it is asked again, after the sync.
  const asked = stub.colo().catch(() => null);
  const t = now();
  const view = await stub.sync(infoOf(cfg), null);
  const stateRtt = now() - t;
  cache.put(cfg.activeGeneration, view, Date.now());
  const [workerColo, stateColo, pods, fallback] = await Promise.all([
    fetchColo(fetchImpl),
    asked.then((colo) => colo ?? stub.colo().catch(() => null)),
    checkPods(cfg, hop),
    url.searchParams.get("fallback") === "1" ? fallbackCheck(cfg, fetchImpl) : null,
  ]);
  const body = {
    worker_colo: workerColo,
    cf_placement: request.headers.get("cf-placement"),
    ray_colo: rayColo(request.headers.get("cf-ray")),
    state_colo: stateColo,
    state_rtt_ms: round(stateRtt),
    pod_rtt_ms: pods.length ? round(pods[0].ms) : null,
    pod_ok: pods.length ? pods[0].ok : null,
    pod_status: pods.length ? pods[0].status : null,
    generation: cfg.activeGeneration,
    hint: cfg.activeHint,
    draining_generation: cfg.drainingGeneration,
    region: cfg.region,
    pod_host: pods.length && hosts ? new URL(cfg.podUrls[0]).host : null,
    pods: podEntries(cfg, pods, hosts),
    breaker: breakerView(cfg, view, hosts),
  };
  if (fallback) body.fallback = fallback;
  const timing = serverTiming({ state_rtt: stateRtt, pod_rtt: pods.length ? pods[0].ms : 0, total: now() - t0 }, PROBE_METRICS);
  return jsonResponse(200, body, { "server-timing": timing, ...noStore });
}

async function breaker(request, env, cfg, hosts) {
  const stub = activeStub(env, cfg);
  let view;
  if (request.method === "PUT") {
    const body = await jsonBody(request);
    if (!Object.prototype.hasOwnProperty.call(body, "force") || !FORCE_VALUES.includes(body.force)) {
      throw new HttpError(400, "invalid_field", `field "force" must be "open", "closed" or null (got ${JSON.stringify(body.force ?? "missing")})`);
    }
    view = await stub.setForce(body.force, infoOf(cfg));
  } else {
    view = await stub.sync(infoOf(cfg), null);
  }
  const entry = cache.put(cfg.activeGeneration, view, Date.now());
  return jsonResponse(200, { generation: cfg.activeGeneration, breaker: breakerView(cfg, entry.view, hosts) }, noStore);
}

async function purge(request, env, cfg) {
  const body = await jsonBody(request);
  const gen = body.generation;
  if (typeof gen !== "string" || gen === "") {
    throw new HttpError(400, "invalid_field", "field \"generation\" must be a generation name");
  }
  if (gen === cfg.activeGeneration) {
    throw new HttpError(409, "active_generation", `refusing to purge ${gen}: it is the active generation`);
  }
  const hint = gen === cfg.drainingGeneration ? cfg.drainingHint : "";
  // Copy first: keys, limits and usage of the purged generation live on in the active one.
  const copy = await activeStub(env, cfg).importFrom({ ...infoOf(cfg), draining: gen, drainingHint: hint });
  if (!copy.imported) {
    const p = copy.progress;
    const far = p ? `${p.rows} of ${p.total} rows` : "nothing yet";
    throw new HttpError(409, "import_incomplete", `refusing to purge ${gen}: ${cfg.activeGeneration} has imported ${far} of it; `
      + "retry once `migrate.py status` says the import is done", { "retry-after": "30" });
  }
  const result = await stubFor(env, gen, hint).purge();
  cache.drop(gen);
  return jsonResponse(200, { generation: gen, purged: true, copied_to: cfg.activeGeneration, ...result });
}

function limitOf(body, field, fallback = 0) {
  const v = body[field] ?? fallback;
  if (!Number.isSafeInteger(v) || v < 0) {
    throw new HttpError(400, "invalid_field", `field "${field}" must be a whole number >= 0, 0 meaning no limit (got ${JSON.stringify(v)})`);
  }
  return v;
}

async function createKey(request, env, cfg) {
  const body = await jsonBody(request);
  if (typeof body.name !== "string" || !NAME_RE.test(body.name)) {
    throw new HttpError(400, "invalid_field",
      `field "name" must be 1-64 characters: letters, digits, space, . _ @ - (got ${JSON.stringify(body.name ?? null)})`);
  }
  const unknown = Object.keys(body).filter((k) => !["name", "expires_in_s", ...LIMIT_FIELDS].includes(k));
  if (unknown.length) throw new HttpError(400, "invalid_field", `unknown field "${unknown[0]}": use name, ${LIMIT_FIELDS.join(", ")}, expires_in_s`);
  // A limit absent: the cell's default for new keys (colocate:keys.defaults).
  const limits = Object.fromEntries(LIMIT_FIELDS.map((f) => [f, limitOf(body, f, cfg.keyDefaults[f])]));
  let expiresAt = null;
  if (body.expires_in_s !== undefined && body.expires_in_s !== null) {
    if (!Number.isSafeInteger(body.expires_in_s) || body.expires_in_s <= 0) {
      throw new HttpError(400, "invalid_field", `field "expires_in_s" must be a whole number of seconds > 0 (got ${JSON.stringify(body.expires_in_s)})`);
    }
    expiresAt = Date.now() + body.expires_in_s * 1000;
  }
  const key = newKey();
  const row = { id: newKeyId(), hash: await keyHash(key), prefix: displayPrefix(key), name: body.name, ...limits,
    created_at: Date.now(), expires_at: expiresAt };
  // Isolates (this one too) find the new key by looking it up on its first request.
  const stored = await activeStub(env, cfg).createKey(row, infoOf(cfg));
  return jsonResponse(201, { ...stored, key }, noStore);
}

const ID_RE = /^key_[0-9a-f]{12}$/;
const HASH_RE = /^[0-9a-f]{64}$/;
const PREFIX_RE = /^clc_[A-Za-z0-9_-]{6}$/;
const IMPORT_FIELDS = ["id", "hash", "prefix", "name", "created_at", "expires_at", ...LIMIT_FIELDS];

function fieldMatching(body, field, re, what) {
  const v = body[field];
  if (typeof v !== "string" || !re.test(v)) throw new HttpError(400, "invalid_field", `field "${field}" must be ${what} (got ${JSON.stringify(v ?? null)})`);
  return v;
}

function timeOf(body, field, nullable) {
  const v = body[field] ?? null;
  if (v === null && nullable) return null;
  if (!Number.isSafeInteger(v) || v <= 0) {
    throw new HttpError(400, "invalid_field", `field "${field}" must be a time in ms since the epoch${nullable ? " or null" : ""} (got ${JSON.stringify(v)})`);
  }
  return v;
}

/**
 * A key row made elsewhere (scripts/keys.py, once for a whole fleet): only its digest
 * travels. Same id and digest again: 200 with the row (a retry is harmless); an id or
 * digest already held with the other half different: 409.
 */
async function importKey(request, env, cfg) {
  const body = await jsonBody(request);
  const unknown = Object.keys(body).filter((k) => !IMPORT_FIELDS.includes(k) && k !== "fleet_cells");
  if (unknown.length) throw new HttpError(400, "invalid_field", `unknown field "${unknown[0]}": use ${IMPORT_FIELDS.join(", ")}, fleet_cells`);
  // The fleet's size (keys.py on a fleet): a cell the exchange has not reached yet learns it
  // here, so the key is admitted within its default share from its first request.
  const cells = body.fleet_cells ?? null;
  if (cells !== null && !(Number.isInteger(cells) && cells >= 2 && cells <= 64)) {
    throw new HttpError(400, "invalid_field", `field "fleet_cells" must be the fleet's number of cells, 2 to 64 (got ${JSON.stringify(cells)})`);
  }
  const row = {
    id: fieldMatching(body, "id", ID_RE, "a key id: key_ and 12 hex digits"),
    hash: fieldMatching(body, "hash", HASH_RE, "the key's SHA-256 as 64 lower-case hex digits"),
    prefix: fieldMatching(body, "prefix", PREFIX_RE, "the key's first 10 characters (clc_ and 6 more)"),
    name: fieldMatching(body, "name", NAME_RE, "1-64 characters: letters, digits, space, . _ @ -"),
    ...Object.fromEntries(LIMIT_FIELDS.map((f) => [f, limitOf(body, f, cfg.keyDefaults[f])])),
    created_at: timeOf(body, "created_at", false),
    expires_at: timeOf(body, "expires_at", true),
  };
  const { outcome, row: stored } = await activeStub(env, cfg).importKey(row, infoOf(cfg), cells);
  if (outcome === "conflict") {
    throw new HttpError(409, "key_conflict", `this cell already holds key id ${row.id} or its digest with a different other half: `
      + "the fleet's copies disagree; compare them with scripts/keys.py list --stack <fleet>");
  }
  return jsonResponse(outcome === "created" ? 201 : 200, stored, noStore);
}

/** Every key row with its digest, for scripts/keys.py sync (the digest of a 192-bit random key reveals nothing usable). */
async function keyDigests(env, cfg) {
  return jsonResponse(200, { generation: cfg.activeGeneration, keys: await activeStub(env, cfg).keyDigests(infoOf(cfg)) }, noStore);
}

async function listKeys(env, cfg) {
  return jsonResponse(200, { generation: cfg.activeGeneration, keys: await activeStub(env, cfg).listKeys(infoOf(cfg)) }, noStore);
}

async function revokeKey(env, cfg, id) {
  const row = await activeStub(env, cfg).revokeKey(id, infoOf(cfg));
  if (!row) throw new HttpError(404, "unknown_key", `no key with id ${id}: list them with scripts/keys.py list`);
  cache.dropKey(cfg.activeGeneration, id); // takes effect here at once, elsewhere within STATE_TTL_MS
  return jsonResponse(200, row, noStore);
}

async function usage(env, cfg, url) {
  const q = url.searchParams;
  const today = dayOf(Date.now());
  const query = { from: q.get("from") || monthStartDay(Date.now()), to: q.get("to") || today, key: q.get("key") || null };
  for (const f of ["from", "to"]) {
    if (!DAY_RE.test(query[f])) throw new HttpError(400, "invalid_field", `query "${f}" must be a day YYYY-MM-DD (got ${JSON.stringify(query[f])})`);
  }
  const rows = await activeStub(env, cfg).usage(query, infoOf(cfg));
  return jsonResponse(200, { generation: cfg.activeGeneration, from: query.from, to: query.to, usage: rows }, noStore);
}

const LIVE_DEFAULT_MS = 3600 * 1000;
const LIVE_MAX_MS = 35 * 24 * 3600 * 1000; // what the object keeps (seg_hour)
const LIVE_HOURLY_AFTER_MS = 6 * 3600 * 1000; // longer windows answer per hour: a bounded answer

/** The live segment histograms since `since` (ms epoch; default an hour ago), for probe.py --live. */
/** The fallback's spend today against its caps, in $ (null: no price, so not counted; a cap null: none). */
function spendView(cfg, spent) {
  const s = cfg.fallbackSpend;
  const usd = (microusd) => (microusd > 0 ? microusd / 1e6 : null);
  return { day: spent.day, usd: s.price ? spent.microusd / 1e6 : null, cell_cap_usd: usd(s.cellMicroUsd), key_cap_usd: usd(s.keyMicroUsd) };
}

async function live(env, cfg, url, hosts, hop) {
  const t = Date.now();
  const raw = url.searchParams.get("since");
  const since = raw === null ? t - LIVE_DEFAULT_MS : Number(raw);
  if (raw === "" || !Number.isSafeInteger(since) || since < 0) {
    throw new HttpError(400, "invalid_field", `query "since" must be a time in ms since the epoch, e.g. ${t - LIVE_DEFAULT_MS} for an hour ago (got ${JSON.stringify(raw)})`);
  }
  const from = Math.max(since, t - LIVE_MAX_MS);
  // Each pod's own prefix-cache counters (podmetrics.js), asked while the object answers.
  const caches = podPrefixCaches(cfg, hop);
  // This isolate's own rows first: they otherwise ride on its next flush, which may not come
  // (no further request) in time for this answer; a failed sync is only logged.
  await sync(env, cfg).catch(syncFailed(env, cfg.activeGeneration));
  let { minutes, hours, spent } = await activeStub(env, cfg).live(from, infoOf(cfg));
  if (t - from > LIVE_HOURLY_AFTER_MS) {
    // Fold minutes into hours here, in the Worker, rather than in the single-threaded object.
    const folded = new Map(hours.map((r) => [r.slice(0, 4).join("|"), r]));
    for (const [minute, colo, pod, segment, hist] of minutes) {
      const key = [Math.floor(minute / 60), colo, pod, segment].join("|");
      const prev = folded.get(key);
      folded.set(key, prev ? [prev[0], colo, pod, segment, mergeEncoded(prev[4], hist)] : [Math.floor(minute / 60), colo, pod, segment, hist]);
    }
    hours = [...folded.values()];
    minutes = [];
  }
  return jsonResponse(200, {
    generation: cfg.activeGeneration, draining_generation: cfg.drainingGeneration, region: cfg.region,
    pods: cfg.podUrls.map((u, index) => (hosts ? { index, host: new URL(u).host } : { index })),
    since: from, now: t, buckets: LIVE_BUCKETS, minutes, hours, fallback_spend: spendView(cfg, spent),
    pod_prefix: await caches,
  }, noStore);
}

// How the probe rebuilds the buckets (histogram.js): edges low_ms x 2^(k / per_octave), k = 0..top.
const LIVE_BUCKETS = Object.freeze({ low_ms: LOW_MS, per_octave: PER_OCTAVE, top: TOP, count: BUCKETS });

/** The cell for Prometheus (metrics.js): cumulative histograms, counters, breaker, key counts. */
async function metrics(env, cfg, hop) {
  const caches = podPrefixCaches(cfg, hop);
  const m = await activeStub(env, cfg).metrics(infoOf(cfg));
  return new Response(exposition(m, cfg, await caches), { status: 200, headers: { "content-type": CONTENT_TYPE, ...noStore } });
}

// --- a fleet's limits exchange (worker/src/fleetledger.js calls these; docs/fleet.md) ---

const PEERS_BODY_LIMIT = 1024 * 1024; // MAX_ROWS peer rows of ~75 bytes and as many lease rows of ~50

/** This cell's own counters of the keys changed since `since` (the exchange's cursor). */
async function fleetCounters(env, cfg, url) {
  const raw = url.searchParams.get("since") ?? "0";
  const since = Number(raw);
  if (raw === "" || !Number.isSafeInteger(since) || since < 0) {
    throw new HttpError(400, "invalid_field", `query "since" must be a whole number >= 0, the cursor of the last answer (got ${JSON.stringify(raw)})`);
  }
  return jsonResponse(200, await activeStub(env, cfg).changedCounters(since, infoOf(cfg)), noStore);
}

/** What the exchange sends: the other cells' counters, this cell's leases and the fleet's size. */
async function setPeers(request, env, cfg) {
  const body = parseJsonObject(await readBody(request, PEERS_BODY_LIMIT));
  const unknown = Object.keys(body).filter((k) => !["rows", "leases", "cells"].includes(k));
  if (unknown.length) throw new HttpError(400, "invalid_field", `unknown field "${unknown[0]}": use rows, leases, cells`);
  // A ledger of the release before sends rows without the fallback's day and spend.
  if (Array.isArray(body.rows)) body.rows = body.rows.map((r) => upgradeRow(r, EXCHANGE));
  if (Array.isArray(body.leases)) body.leases = body.leases.map((r) => upgradeRow(r, LEASE));
  const bad = badRows(body.rows) ?? (body.leases === undefined ? null : badLeases(body.leases));
  if (bad) throw new HttpError(400, "invalid_field", bad);
  const cells = body.cells ?? null;
  if (cells !== null && (!Number.isSafeInteger(cells) || cells < 1 || cells > MAX_CELLS)) {
    throw new HttpError(400, "invalid_field", `field "cells" must be the fleet's number of cells, 1..${MAX_CELLS} (got ${JSON.stringify(cells)})`);
  }
  const { good, dropped } = goodRows(body.rows);
  if (dropped.length) log(env, "fleet_rows_dropped", { count: dropped.length, first: dropped[0] });
  const stored = await activeStub(env, cfg).setPeers(good, infoOf(cfg), body.leases ?? [], cells);
  return jsonResponse(200, { ...stored, dropped }, noStore);
}

/** One key here: own counters, the peers' as last pushed, this cell's lease and the fleet's size. */
async function peersOf(env, cfg, url) {
  const id = url.searchParams.get("key");
  if (id === null || !ID_RE.test(id)) throw new HttpError(400, "invalid_field", `query "key" must be a key id: key_ and 12 hex digits (got ${JSON.stringify(id)})`);
  return jsonResponse(200, await activeStub(env, cfg).peersOf(id, infoOf(cfg)), noStore);
}

function round(ms) {
  return Math.round(ms * 100) / 100;
}

// --- scaling (colocate/scaling/controller.py) ---

const OWNER_RE = /^[A-Za-z0-9][A-Za-z0-9 ._:@-]{0,127}$/;
const MAX_LOCK_MS = 3_600_000;

/** The scaling signals, the lock and the last decision, with the pods this version routes to. */
async function scaleState(env, cfg) {
  const state = await activeStub(env, cfg).scaleState(infoOf(cfg));
  // worker_hash: the content hash of the modules this version runs (WORKER_HASH, colocate/cell/plan.py),
  // which a controller compares with its checkout's before it deploys anything (colocate/scaling/keeper.py).
  return jsonResponse(200, { ...state, generation: cfg.activeGeneration, routed_pods: cfg.podUrls.length,
    worker_hash: env.WORKER_HASH ?? null }, noStore);
}

function ownerOf(body) {
  if (typeof body.owner !== "string" || !OWNER_RE.test(body.owner)) {
    throw new HttpError(400, "invalid_owner", "owner must be 1-128 letters, digits, spaces or ._:@- (the controller's name)");
  }
  return body.owner;
}

/** {owner, ttl_ms, release?}: take, renew or release the controllers' lock (409 when another holds it). */
async function scaleLock(request, env, cfg) {
  const body = await jsonBody(request);
  const owner = ownerOf(body);
  const release = body.release === true;
  const ttl = body.ttl_ms;
  if (!release && !(Number.isInteger(ttl) && ttl > 0 && ttl <= MAX_LOCK_MS)) {
    throw new HttpError(400, "invalid_ttl", `ttl_ms must be a whole number of ms from 1 to ${MAX_LOCK_MS}`);
  }
  const res = await activeStub(env, cfg).scaleLock(owner, release ? 0 : ttl, release, infoOf(cfg));
  return jsonResponse(res.granted ? 200 : 409, res, noStore);
}

const MAX_SCALE_PODS = 8; // colocate/cell/settings.py MAX_PODS
const SCALE_BODY_LIMIT = 16384;
const KEEPER_MAX_CHARS = 12000; // the keeper's record (colocate/scaling/keeper.py Record.as_json) as stored

/** {pod index: times replaced} (colocate:pod.replaced), or a 400 naming the field. */
function replacedOf(value) {
  const ok = value && typeof value === "object" && !Array.isArray(value)
    && Object.entries(value).every(([i, n]) => /^[0-7]$/.test(i) && Number.isInteger(n) && n >= 0 && n <= 1_000_000);
  if (!ok) throw new HttpError(400, "invalid_desired", "desired.replaced must be {pod index 0-7: times replaced, a whole number >= 0}");
  return value;
}

/**
 * {owner, decision: {desired, running, reason, ...}, desired?: {pods, draining, replaced?},
 * keeper?: {...}}: recorded only for the lock's holder (409 otherwise). `desired` is what every
 * `pulumi up` applies (infra/program.py reads it back from GET /_colocate/scale); `keeper` the
 * keeper's last pass, which the live view and /_colocate/metrics show.
 */
async function scaleRecord(request, env, cfg) {
  const body = await jsonBody(request, SCALE_BODY_LIMIT);
  const owner = ownerOf(body);
  const d = body.decision;
  if (!d || typeof d !== "object" || !Number.isInteger(d.desired) || !Number.isInteger(d.running) || typeof d.reason !== "string"
      || d.reason.length > 500) {
    throw new HttpError(400, "invalid_decision", "decision must be {desired: int, running: int, reason: text up to 500 characters, ...}");
  }
  const want = body.desired;
  const count = (n) => Number.isInteger(n) && n >= 0 && n <= MAX_SCALE_PODS;
  if (want !== undefined && (!want || typeof want !== "object" || !count(want.pods) || !count(want.draining)
      || want.pods + want.draining > MAX_SCALE_PODS)) {
    throw new HttpError(400, "invalid_desired", `desired must be {pods: int, draining: int}, together 0 to ${MAX_SCALE_PODS}`);
  }
  const desired = want === undefined ? null : { pods: want.pods, draining: want.draining,
    ...(want.replaced === undefined ? {} : { replaced: replacedOf(want.replaced) }) };
  const keeper = body.keeper ?? null;
  if (keeper !== null && (typeof keeper !== "object" || Array.isArray(keeper) || JSON.stringify(keeper).length > KEEPER_MAX_CHARS)) {
    throw new HttpError(400, "invalid_keeper", `keeper must be the keeper's record, an object of at most ${KEEPER_MAX_CHARS} characters as JSON`);
  }
  const res = await activeStub(env, cfg).scaleRecord(owner, d, infoOf(cfg), desired, keeper);
  return jsonResponse(res.recorded ? 200 : 409, res, noStore);
}
