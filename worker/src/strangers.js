// @ts-check
// Callers with no key of this cell: each client address has a small budget of key
// look-ups in this isolate, so a flood of guessed `clc_` keys from one address cannot fill
// the isolate's look-up queue (state.js `findKey`) and delay real keys presented for the
// first time. A key this isolate already accepted never comes here (router.js
// `authenticate`): the warm path does no work for it. Per isolate, because the queue it
// protects is per isolate; a key that is found gives its look-up back.
//
// Rotating addresses (a /64 holds 2^64, a flood can use thousands) meet the isolate's total
// instead, which only a digest the isolate's key filter does not vouch for draws on
// (keyfilter.js: a guess, or a key created since this isolate's last sync): no rate of
// guesses leaves a real key without a look-up.

import { HttpError } from "./errors.js";

// An app behind one address may bring many keys to a new isolate at once (each key's first
// request there is a look-up); 100 at once and 10 a second more stay far below what the
// queue takes (LOOKUP_WAITING_MAX waiting, 400 digests a second looked up).
export const GUESS_BURST = 100; // unknown keys one address may present at once
export const GUESS_EVERY_MS = 100; // and one more each 100 ms after that
// Every address together, in this isolate, for digests the key filter does not vouch for:
// what rotating addresses (a /64 holds 2^64) can still take. The queue takes
// LOOKUP_WAITING_MAX waiting and about 400 a second looked up.
export const TOTAL_BURST = 1000;
export const TOTAL_EVERY_MS = 5; // 200 a second
const ADDRESSES_MAX = 4096; // addresses held; past it the longest-held is forgotten (the total still holds)

const buckets = new Map(); // address (IPv6: its /64) -> {tokens, at}
const total = { tokens: TOTAL_BURST, at: 0 };

/** The caller's address as Cloudflare's edge sets it (a client cannot: the edge overwrites it). */
export function clientAddress(request) {
  return request.headers.get("cf-connecting-ip") ?? "";
}

/**
 * The budget an address draws on: an IPv4 address itself, an IPv6 address's /64 (one
 * subscriber's prefix: its 2^64 addresses are one caller), as "a:b:c:d::/64".
 */
export function addressBucket(address) {
  if (!address.includes(":")) return address;
  const mapped = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(address); // an IPv4 address written as IPv6
  if (mapped) return mapped[1];
  const [head, tail = null] = address.toLowerCase().split("::");
  const left = head === "" ? [] : head.split(":");
  const right = tail === null || tail === "" ? [] : tail.split(":");
  const groups = tail === null ? left : [...left, ...new Array(Math.max(0, 8 - left.length - right.length)).fill("0"), ...right];
  return groups.slice(0, 4).map((g) => (parseInt(g, 16) || 0).toString(16)).join(":") + "::/64";
}

function refill(b, t, burst, every) {
  b.tokens = Math.min(burst, b.tokens + Math.max(0, t - b.at) / every);
  b.at = t;
}

/**
 * Take one look-up from `address`'s budget (its /64 for IPv6) at `t` (ms), or refuse: 429
 * `too_many_unknown_keys` with Retry-After, before any hashing or look-up.
 */
export function takeLookup(address, t) {
  const key = addressBucket(address);
  let b = buckets.get(key);
  if (b === undefined) {
    if (buckets.size >= ADDRESSES_MAX) buckets.delete(buckets.keys().next().value);
    b = { tokens: GUESS_BURST, at: t };
    buckets.set(key, b);
  } else {
    refill(b, t, GUESS_BURST, GUESS_EVERY_MS);
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

/**
 * Take one look-up from the isolate's total at `t`, for a digest its key filter does not
 * vouch for, or refuse: 429 `too_many_unknown_keys` (a key created since this isolate's
 * last sync meets it only during a flood, and is vouched for after the next sync).
 */
export function takeTotal(t) {
  refill(total, t, TOTAL_BURST, TOTAL_EVERY_MS);
  if (total.tokens < 1) {
    const wait = Math.max(1, Math.ceil(((1 - total.tokens) * TOTAL_EVERY_MS) / 1000));
    throw new HttpError(429, "too_many_unknown_keys",
      `too many unknown API keys at this edge: at most ${TOTAL_BURST} at once and ${1000 / TOTAL_EVERY_MS} a second from every `
      + `address together; retry in ${wait} s with a key from scripts/keys.py create`, { "retry-after": String(wait) });
  }
  total.tokens -= 1;
}

/** A look-up that found a real key: its token goes back to the address, and to the total if it took one. */
export function returnLookup(address, fromTotal = true) {
  const b = buckets.get(addressBucket(address));
  if (b !== undefined) b.tokens = Math.min(GUESS_BURST, b.tokens + 1);
  if (fromTotal) total.tokens = Math.min(TOTAL_BURST, total.tokens + 1);
}
