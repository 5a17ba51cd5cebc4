// @ts-check
// Callers with no key of this cell: each client address has a small budget of key
// look-ups in this isolate, so a flood of guessed `clc_` keys from one address cannot fill
// the isolate's look-up queue (state.js `findKey`) and delay real keys presented for the
// first time. A key this isolate already accepted never comes here (router.js
// `authenticate`): the warm path does no work for it. Per isolate, because the queue it
// protects is per isolate; a key that is found gives its look-up back.

import { HttpError } from "./errors.js";

// An app behind one address may bring many keys to a new isolate at once (each key's first
// request there is a look-up); 100 at once and 10 a second more stay far below what the
// queue takes (LOOKUP_WAITING_MAX waiting, 400 digests a second looked up).
export const GUESS_BURST = 100; // unknown keys one address may present at once
export const GUESS_EVERY_MS = 100; // and one more each 100 ms after that
const ADDRESSES_MAX = 4096; // addresses held; past it the longest-held is forgotten

const buckets = new Map(); // address -> {tokens, at}

/** The caller's address as Cloudflare's edge sets it (a client cannot: the edge overwrites it). */
export function clientAddress(request) {
  return request.headers.get("cf-connecting-ip") ?? "";
}

/**
 * Take one look-up from `address`'s budget at `t` (ms), or refuse: 429
 * `too_many_unknown_keys` with Retry-After, before any hashing or look-up.
 */
export function takeLookup(address, t) {
  let b = buckets.get(address);
  if (b === undefined) {
    if (buckets.size >= ADDRESSES_MAX) buckets.delete(buckets.keys().next().value);
    b = { tokens: GUESS_BURST, at: t };
    buckets.set(address, b);
  } else {
    b.tokens = Math.min(GUESS_BURST, b.tokens + (t - b.at) / GUESS_EVERY_MS);
    b.at = t;
  }
  if (b.tokens < 1) {
    const wait = Math.max(1, Math.ceil(((1 - b.tokens) * GUESS_EVERY_MS) / 1000));
    throw new HttpError(429, "too_many_unknown_keys",
      `too many unknown API keys from this address: at most ${GUESS_BURST} at once and ${1000 / GUESS_EVERY_MS} a second; `
      + `retry in ${wait} s `
      + "with a key from scripts/keys.py create", { "retry-after": String(wait) });
  }
  b.tokens -= 1;
}

/** A look-up that found a real key: its token goes back to the address. */
export function returnLookup(address) {
  const b = buckets.get(address);
  if (b !== undefined) b.tokens = Math.min(GUESS_BURST, b.tokens + 1);
}
