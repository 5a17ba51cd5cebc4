// @ts-check
// Why a key was refused: a fixed set of reasons, so the per-key refusal counts (a sync's
// `refusals` rows, refusal_total, GET /_colocate/metrics) carry bounded labels whatever
// the refusals say.

export const REASONS = /** @type {const} */ (["rpm", "tpm", "monthly_tokens", "tokens_reserved", "max_parallel", "lease",
  "fallback_cap", "other"]);

export const REFUSAL_KEYS = 20; // keys GET /_colocate/metrics names in its refusal counts; the rest are "other"

const BY_CODE = { tokens_reserved: "tokens_reserved", too_many_parallel_requests: "max_parallel", fallback_spend_cap: "fallback_cap" };

/**
 * The reason of a refusal (limits.js `refusal`/`leaseRefusal`: {type, code, byLease?}, or a
 * router 429's code): one of REASONS.
 * @param {{type?: string, code: string, byLease?: boolean}} no
 */
export function reasonOf(no) {
  if (no.byLease) return "lease";
  if (Object.hasOwn(BY_CODE, no.code)) return BY_CODE[no.code];
  if (no.code === "insufficient_quota") return "monthly_tokens";
  if (no.code === "rate_limit_exceeded") return no.type === "tokens" ? "tpm" : "rpm";
  return "other";
}
