// @ts-check
// Client API keys: their format, their hash, and reading one from a request.
//
// A key is "clc_" + 32 base64url characters (24 random bytes: 192 bits). The object
// stores only its SHA-256 (hex); the plaintext is returned once, when it is created,
// and never logged. The edge finds a key by its digest (a map keyed by digest), so the
// lookup times the digest, never the secret; where a record comes back from a sync the
// digests are also compared in constant time.

export const KEY_PREFIX = "clc_";
const KEY_RE = /^clc_[A-Za-z0-9_-]{32}$/;
const KEY_LENGTH = KEY_PREFIX.length + 32;
const encoder = new TextEncoder();

function base64url(bytes) {
  let s = "";
  for (const b of bytes) s += String.fromCharCode(b);
  return btoa(s).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

const HEX = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, "0"));

function hex(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i++) s += HEX[bytes[i]];
  return s;
}

export function newKey() {
  return KEY_PREFIX + base64url(crypto.getRandomValues(new Uint8Array(24)));
}

export function newKeyId() {
  return "key_" + hex(crypto.getRandomValues(new Uint8Array(6)));
}

/** What a listing shows of a key: enough to recognise it, far too little to use it. */
export function displayPrefix(key) {
  return key.slice(0, KEY_PREFIX.length + 6);
}

export async function keyHash(key) {
  return hex(new Uint8Array(await crypto.subtle.digest("SHA-256", encoder.encode(key))));
}

// Digests of keys this isolate has already accepted, so a known key is not hashed again
// on every request (SHA-256 was the largest part of the key check's CPU). Only accepted
// keys are remembered, so junk cannot fill it; the digest is still compared in constant
// time against the stored one, and a revoked key is refused by the key list, not here.
const accepted = new Map();
const ACCEPTED_MAX = 1024;

/** The digest of a key this isolate accepted before, or undefined (no hashing; a string
 * that is not a key's length is not even looked up, so junk of any size costs nothing). */
export function rememberedDigest(key) {
  return key.length === KEY_LENGTH ? accepted.get(key) : undefined;
}

/** The digest of a presented key: remembered if it was accepted before, else computed. */
export async function digestOf(key) {
  return accepted.get(key) ?? keyHash(key);
}

export function remember(key, digest) {
  if (accepted.size >= ACCEPTED_MAX) accepted.clear();
  accepted.set(key, digest);
}

/** Constant-time equality of two equal-length hex digests. */
export function sameDigest(a, b) {
  if (typeof a !== "string" || typeof b !== "string" || a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return diff === 0;
}

/** The bearer credential of a request, or null. */
export function bearer(request) {
  const header = request.headers.get("authorization");
  if (!header || header.length < 8 || header.slice(0, 7).toLowerCase() !== "bearer ") return null;
  return header.slice(7).trim() || null;
}

/** Whether a string is shaped like a client key (checked before hashing: junk costs nothing). */
export function looksLikeKey(s) {
  return typeof s === "string" && KEY_RE.test(s);
}
