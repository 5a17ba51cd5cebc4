import { test } from "node:test";
import assert from "node:assert/strict";
import { bearer, displayPrefix, keyHash, looksLikeKey, newKey, newKeyId, sameDigest } from "../src/keys.js";

test("keys are clc_ plus 192 random bits, ids are separate, listings show a short prefix", () => {
  const keys = new Set(Array.from({ length: 200 }, newKey));
  assert.equal(keys.size, 200);
  for (const k of keys) assert.ok(looksLikeKey(k), k);
  const k = newKey();
  assert.equal(k.length, 36);
  assert.equal(displayPrefix(k), k.slice(0, 10));
  assert.match(newKeyId(), /^key_[0-9a-f]{12}$/);
  for (const bad of ["", "clc_", "sk-abc", `clc_${"a".repeat(31)}`, `clc_${"a".repeat(32)}x`, null]) assert.equal(looksLikeKey(bad), false);
});

test("the stored digest is SHA-256 hex, compared in full", async () => {
  const k = newKey();
  const d = await keyHash(k);
  assert.match(d, /^[0-9a-f]{64}$/);
  assert.equal(sameDigest(d, await keyHash(k)), true);
  assert.equal(sameDigest(d, await keyHash(newKey())), false);
  assert.equal(sameDigest(d, d.slice(0, 63)), false);
  assert.equal(sameDigest(d, undefined), false);
});

test("the bearer credential is read case-insensitively and trimmed", () => {
  const req = (v) => new Request("http://x/", { headers: v === null ? {} : { authorization: v } });
  assert.equal(bearer(req("Bearer abc ")), "abc");
  assert.equal(bearer(req("bearer abc")), "abc");
  assert.equal(bearer(req("Basic abc")), null);
  assert.equal(bearer(req("Bearer ")), null);
  assert.equal(bearer(req(null)), null);
});
