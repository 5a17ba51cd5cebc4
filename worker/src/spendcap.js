// @ts-check
// The fallback's daily spend caps (colocate:fallbackCap), for the whole cell and for each
// key: checked before the fallback is called, never on a pod's path. Spend is counted
// from the fallback's answered usage at FALLBACK_PRICE (state.js `served`) and kept in the
// generation (usage_daily.fallback_microusd, fallback_spend), so it moves with it.

import { spentToday } from "./state.js";

const DAY_MS = 86_400_000;

const usd = (microusd) => (microusd / 1e6).toFixed(2);

/**
 * null, or why the fallback may not be called for `key` (its own cap, else the cell's per-key one) at `t` (ms):
 * {message, retryAfterS}, Retry-After being the end of the UTC day, when the caps start over.
 */
export function fallbackCapRefusal(cfg, key, t) {
  const { cellMicroUsd, keyMicroUsd, price } = cfg.fallbackSpend;
  if (price === null) return null; // spend is not counted
  const own = key.fallback_microusd_day > 0 ? key.fallback_microusd_day : 0;
  const keyCap = own || keyMicroUsd;
  if (cellMicroUsd === 0 && keyCap === 0) return null;
  const gen = cfg.activeGeneration;
  let over = null;
  if (keyCap > 0 && spentToday(gen, key.id, t) >= keyCap) {
    over = { who: "this key", cap: keyCap, setting: own ? "the key's fallback_microusd_day" : "colocate:fallbackCap.keyUsdPerDay" };
  } else if (cellMicroUsd > 0 && spentToday(gen, null, t) >= cellMicroUsd) {
    over = { who: "this cell", cap: cellMicroUsd, setting: "colocate:fallbackCap.cellUsdPerDay" };
  }
  if (over === null) return null;
  return {
    retryAfterS: Math.max(1, Math.ceil((DAY_MS - (t % DAY_MS)) / 1000)),
    message: `no pod could serve this request, and the fallback API's spend cap for today is reached: $${usd(over.cap)} `
      + `a day for ${over.who} (${over.setting}); retry when a pod is back, or after 00:00 UTC`,
  };
}
