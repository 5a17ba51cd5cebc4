import { test } from "node:test";
import assert from "node:assert/strict";
import { serverTiming, parseServerTiming, PROBE_METRICS } from "../src/timing.js";
import { parseTraceColo, rayColo } from "../src/trace.js";

test("Server-Timing lists the contract's names in order, missing as 0", () => {
  assert.equal(serverTiming({ state: 0, upstream: 12.345, total: 13 }), "state;dur=0, upstream;dur=12.35, fallback;dur=0, total;dur=13");
  assert.equal(serverTiming({ state_rtt: 1, pod_rtt: 2, total: 3 }, PROBE_METRICS), "state_rtt;dur=1, pod_rtt;dur=2, total;dur=3");
  assert.deepEqual(parseServerTiming("state;dur=0, upstream;dur=12.5, x"), { state: 0, upstream: 12.5, x: 0 });
});

test("colo from a trace body and from CF-Ray", () => {
  assert.equal(parseTraceColo("fl=1\nh=www.cloudflare.com\ncolo=nrt\nhttp=http/2\n"), "NRT");
  assert.equal(parseTraceColo("no colo here"), null);
  assert.equal(rayColo("8f1a2b3c4d5e6f70-TPE"), "TPE");
  assert.equal(rayColo(null), null);
});

test("durations print as String(Math.round(ms * 100) / 100) would, for any value", () => {
  const reference = (ms) => String(Math.round((Number.isFinite(ms) && ms > 0 ? ms : 0) * 100) / 100);
  const values = [0, -1, NaN, Infinity, -Infinity, 0.004, 0.005, 0.015, 0.1, 1.005, 2.675, 99.995, 1e-9, 123456.789];
  for (let i = 0; i < 20000; i++) values.push(i / 1000, i / 7, Math.random() * 10 ** (i % 6));
  for (const v of values) {
    assert.equal(serverTiming({ total: v }, ["total"]), `total;dur=${reference(v)}`, `for ${v}`);
  }
});
