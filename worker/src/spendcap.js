// @ts-check
// The fallback's money: which model it may be sent and at what price (colocate:fallbackModel,
// colocate:fallbackModels), and its daily spend caps (colocate:fallbackCap, each key's own
// fallback_microusd_day, keys.defaults.fallbackUsdPerDay) for the whole cell and for each key.
// Checked when the router decides to call the fallback, never on a pod's path: a request is
// admitted only if what it may cost at most fits beside what was spent today and what the
// fallback requests in flight reserved, and its worst case is then reserved until its real
// cost is counted (state.js `admit`'s release.fallback, `served`). Spend is kept in the generation
// (usage_daily.fallback_microusd, fallback_spend), so it moves with it.

import { cache, fallbackReserved, spentToday } from "./state.js";
import { floorShare, provisionalLease } from "./fleetexchange.js";

const DAY_MS = 86_400_000;

const usd = (microusd) => (microusd / 1e6).toFixed(2);

/**
 * What the fallback may be sent for `json` and what it costs: {ok, price} ($ per 1M tokens
 * {input, output}, or null: not counted). With passthrough (no FALLBACK_MODEL) only the
 * models FALLBACK_MODELS names, each at its own price or FALLBACK_PRICE's; a body-less
 * request (GET /v1/models) costs nothing and may go.
 */
export function fallbackModel(cfg, json) {
  const price = cfg.fallbackSpend.price;
  if (cfg.fallbackModels === null || json === null) return { ok: true, price };
  const model = json.model;
  if (typeof model !== "string" || !cfg.fallbackModels.has(model)) return { ok: false, price: null };
  return { ok: true, price: cfg.fallbackModels.get(model) ?? price };
}

/**
 * The most a request may cost at the fallback, in millionths of a dollar ($ per 1M tokens
 * is millionths of a dollar per token): every byte of its body a prompt token (the fallback
 * bills its own context, not the pods'), and its ceiling's completion tokens (usage.js usageCeiling).
 */
export function worstCost(price, bodyBytes, completion) {
  if (price === null) return 0;
  return Math.ceil(bodyBytes * price.input + completion * price.output);
}

/**
 * In a fleet, this cell's share of the key's daily fallback cap (its lease, fleetexchange.js),
 * for today (its floor share while this isolate holds no lease of it); null: a lone cell.
 */
export function fallbackShare(cfg, key) {
  const gen = cfg.activeGeneration;
  const lease = cache.lease(gen, key.id) ?? provisionalLease(key, cache.fleetCells(gen), cfg.fallbackSpend.keyMicroUsd, floorShare);
  return lease && lease.fallback_microusd != null ? lease.fallback_microusd : null;
}

/**
 * null, or why the fallback may not be called for `key` at `t` (ms) for a request that may
 * cost `worst` at most: {message, retryAfterS}, Retry-After being the end of the UTC day,
 * when the caps start over. Its own cap (else the cell's per-key one), then the cell's; in a
 * fleet, this cell's share of the key's (`share`, fleetexchange.js), all against what was
 * spent today plus what fallback requests in flight reserved.
 */
export function fallbackCapRefusal(cfg, key, t, worst = 0, share = null) {
  const { cellMicroUsd, keyMicroUsd, price } = cfg.fallbackSpend;
  if (price === null) return null; // spend is not counted
  const own = key.fallback_microusd_day > 0 ? key.fallback_microusd_day : 0;
  const keyCap = own || keyMicroUsd;
  if (cellMicroUsd === 0 && keyCap === 0) return null;
  const gen = cfg.activeGeneration;
  const past = (used, cap) => cap > 0 && (used >= cap || used + worst > cap);
  let over = null;
  if (keyCap > 0) {
    const used = spentToday(gen, key.id, t) + fallbackReserved(gen, key.id);
    if (past(used, keyCap)) {
      over = { who: "this key", used, cap: keyCap, setting: own ? "the key's fallback_microusd_day" : "colocate:fallbackCap.keyUsdPerDay" };
    } else if (share !== null && past(used, share)) {
      over = { who: "this key in this cell", used, cap: share, setting: "this cell's share of the key's cap across the fleet" };
    }
  }
  if (over === null && cellMicroUsd > 0) {
    const used = spentToday(gen, null, t) + fallbackReserved(gen, null);
    if (past(used, cellMicroUsd)) over = { who: "this cell", used, cap: cellMicroUsd, setting: "colocate:fallbackCap.cellUsdPerDay" };
  }
  if (over === null) return null;
  return {
    retryAfterS: Math.max(1, Math.ceil((DAY_MS - (t % DAY_MS)) / 1000)),
    message: `no pod could serve this request, and the fallback API's spend cap for today leaves no room for it: $${usd(over.cap)} `
      + `a day for ${over.who} (${over.setting}), $${usd(over.used)} spent or reserved, this request up to $${usd(worst)}; `
      + "retry when a pod is back, or after 00:00 UTC",
  };
}
