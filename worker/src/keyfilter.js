// @ts-check
// A Bloom filter of a generation's key digests: what lets an isolate tell a guessed key
// from a real one without the object (router.js `authenticateSlow`, strangers.js). The
// object builds it once from its key table and keeps it in memory, adding each key it
// stores; an isolate gets a copy with the sync that starts its key list (a cold isolate's,
// or one reset) and adds every key row later syncs bring (the key deltas every isolate
// already receives). A digest the filter lacks is not a key the isolate could have
// learnt of; one it holds is a key, or one guess in about 1,700 (BITS_PER_KEY, PROBES).
//
// The digest is SHA-256 of 192 random bits, itself uniformly random: its 32-bit slices are
// the probes, so nothing is hashed again.

export const BITS_PER_KEY = 16;
export const PROBES = 8;
const MIN_KEYS = 8192; // the smallest filter (16 KB) takes this many keys at its rate
const HEADROOM = 1.25; // room for keys added after it was built

/** An empty filter's bytes for `keys` keys (a power of two bits, at least MIN_KEYS' worth). */
export function filterFor(keys) {
  const want = Math.max(MIN_KEYS, Math.ceil(keys * HEADROOM)) * BITS_PER_KEY;
  let bits = 8;
  while (bits < want) bits *= 2;
  return new Uint8Array(bits / 8);
}

function probe(bytes, digest, i) {
  return parseInt(digest.slice(8 * i, 8 * i + 8), 16) & (bytes.length * 8 - 1);
}

/** Add a digest (64 hex characters) to `bytes`. */
export function addDigest(bytes, digest) {
  for (let i = 0; i < PROBES; i++) {
    const b = probe(bytes, digest, i);
    bytes[b >> 3] |= 1 << (b & 7);
  }
}

/** Whether `bytes` may hold `digest`: false means no key with that digest was added. */
export function mayHold(bytes, digest) {
  for (let i = 0; i < PROBES; i++) {
    const b = probe(bytes, digest, i);
    if ((bytes[b >> 3] & (1 << (b & 7))) === 0) return false;
  }
  return true;
}
