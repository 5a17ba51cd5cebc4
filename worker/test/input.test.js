import { test } from "node:test";
import assert from "node:assert/strict";
import { readBody, parseJsonObject } from "../src/body.js";
import { readConfig } from "../src/config.js";
import { HttpError, ConfigurationError, redact } from "../src/errors.js";
import { tokenMatches } from "../src/admin.js";
import { upstreamHeaders, isPodFailure, upstreamBody } from "../src/forward.js";

function chunked(parts) {
  // No Content-Length: the body arrives as a stream of chunks.
  const stream = new ReadableStream({
    start(c) {
      for (const p of parts) c.enqueue(new TextEncoder().encode(p));
      c.close();
    },
  });
  return new Request("http://x/", { method: "POST", body: stream, duplex: "half" });
}

test("bodies over the limit are refused by Content-Length and by counting", async () => {
  const declared = new Request("http://x/", { method: "POST", body: "x".repeat(11) });
  await assert.rejects(readBody(declared, 10), (e) => e instanceof HttpError && e.status === 413);
  await assert.rejects(readBody(chunked(["12345", "678901"]), 10), (e) => e.status === 413);
  const ok = await readBody(chunked(["12345", "67890"]), 10);
  assert.equal(new TextDecoder().decode(ok), "1234567890");
});

test("malformed JSON and non-objects are 400 invalid_json", () => {
  const enc = (s) => new TextEncoder().encode(s);
  for (const bad of ["{", "[]", "null", "42", ""]) {
    assert.throws(() => parseJsonObject(enc(bad)), (e) => e.status === 400 && e.code === "invalid_json");
  }
  assert.deepEqual(parseJsonObject(enc('{"a":1}')), { a: 1 });
});

const env = {
  BREAKER: {}, CELL_REGION: "us-east", ACTIVE_GENERATION: "us-east.g1", ACTIVE_HINT: "enam",
  DEADLINE_MS: "300", MAX_BODY_BYTES: "100", FAILURE_THRESHOLD: "3", OPEN_MS: "1000", STATE_TTL_MS: "0",
  POD_URLS: '["http://127.0.0.1:9/"]', POD_TOKEN: "pod-secret", FALLBACK_URL: "https://api.example.com/",
  FALLBACK_API_KEY: "fb-secret", PROBE_TOKEN: "probe-secret", FALLBACK_MODEL: "fb-model",
};

test("config parses numbers and trims URLs; a bad binding is named without its secret", () => {
  const cfg = readConfig({ ...env });
  assert.equal(cfg.deadlineMs, 300);
  assert.deepEqual(cfg.podUrls, ["http://127.0.0.1:9"]);
  assert.equal(cfg.drainingGeneration, null);
  assert.throws(() => readConfig({ ...env, DEADLINE_MS: "soon" }), (e) => e instanceof ConfigurationError && e.binding === "DEADLINE_MS");
  assert.throws(() => readConfig({ ...env, FALLBACK_URL: "not a url fb-secret" }),
    (e) => e.binding === "FALLBACK_URL" && !e.message.includes("fb-secret"));
});

test("redact removes every secret binding value", () => {
  const line = redact("pod-secret at https://api.example.com/ with fb-secret and probe-secret", env);
  for (const s of ["pod-secret", "fb-secret", "probe-secret", "https://api.example.com/"]) assert.ok(!line.includes(s), line);
});

test("token comparison", async () => {
  assert.equal(await tokenMatches("probe-secret", "probe-secret"), true);
  assert.equal(await tokenMatches("probe-secreT", "probe-secret"), false);
  assert.equal(await tokenMatches("", "probe-secret"), false);
});

test("upstream headers replace the client's credentials; fallback model substitution", () => {
  const h = upstreamHeaders(new Headers({ authorization: "Bearer client", "content-type": "application/json", "cf-ray": "x", host: "w" }), "tok");
  assert.equal(h.get("authorization"), "Bearer tok");
  assert.equal(h.get("content-type"), "application/json");
  assert.equal(h.get("cf-ray"), null);
  const body = new TextDecoder().decode(upstreamBody(new Uint8Array(), { model: "m", messages: [] }, "fb-model", false));
  assert.deepEqual(JSON.parse(body), { model: "fb-model", messages: [] });
  const same = new Uint8Array([1]);
  assert.equal(upstreamBody(same, { model: "m" }, null, false), same);
  assert.equal(isPodFailure(500), true);
  assert.equal(isPodFailure(400), false);
});

test("the router asks upstream for a stream's usage: spliced into the client's bytes, or re-encoded", () => {
  const dec = (b) => JSON.parse(new TextDecoder().decode(b));
  const raw = new TextEncoder().encode(' {"model":"m","stream":true,"messages":[]}');
  assert.deepEqual(dec(upstreamBody(raw, dec(raw), null, true)),
    { stream_options: { include_usage: true }, model: "m", stream: true, messages: [] });
  const theirs = { model: "m", stream: true, stream_options: { include_usage: false, continuous_usage_stats: false } };
  assert.deepEqual(dec(upstreamBody(new Uint8Array(), theirs, null, true)).stream_options, { include_usage: true, continuous_usage_stats: false });
  assert.deepEqual(dec(upstreamBody(raw, dec(raw), "fb", true)), { model: "fb", stream: true, messages: [], stream_options: { include_usage: true } });
  assert.equal(upstreamBody(raw, dec(raw), null, false), raw);
});

test("a pod's body carries the key's cache_salt, which the client cannot choose", () => {
  const dec = (b) => JSON.parse(new TextDecoder().decode(b));
  const enc = (o) => new TextEncoder().encode(JSON.stringify(o));
  const plain = { model: "m", messages: [] };
  assert.deepEqual(dec(upstreamBody(enc(plain), plain, null, false, "key_0123456789ab")), { cache_salt: "key_0123456789ab", ...plain });
  const theirs = { model: "m", messages: [], cache_salt: "victim" };
  assert.equal(dec(upstreamBody(enc(theirs), theirs, null, false, "key_0123456789ab")).cache_salt, "key_0123456789ab");
  const stream = { model: "m", messages: [], stream: true };
  assert.deepEqual(dec(upstreamBody(enc(stream), stream, null, true, "key_a")),
    { cache_salt: "key_a", stream_options: { include_usage: true }, ...stream });
  const both = { ...theirs, stream: true, stream_options: { include_usage: false } };
  assert.deepEqual(dec(upstreamBody(enc(both), both, null, true, "key_a")),
    { ...both, cache_salt: "key_a", stream_options: { include_usage: true } });
});
