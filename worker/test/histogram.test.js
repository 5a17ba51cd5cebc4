import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BUCKETS, EDGES, HIGH_MS, LOW_MS, Recorder, bounds, bucketOf, decode, empty, encode, merge, mergeEncoded, percentile, total,
} from "../src/histogram.js";

/** numpy's default percentile of exact values (the probe's, colocate/probe/stats.py). */
function exact(values, q) {
  const d = [...values].sort((a, b) => a - b);
  const pos = ((d.length - 1) * q) / 100;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return d[lo] + (d[hi] - d[lo]) * (pos - lo);
}

function widthAt(ms) {
  const [lo, hi] = bounds(bucketOf(ms));
  return hi - lo;
}

/** The width that bounds the error: the wider bucket of the two exact values the rank sits between. */
function tolerance(values, q) {
  const d = [...values].sort((a, b) => a - b);
  const pos = ((d.length - 1) * q) / 100;
  return Math.max(widthAt(d[Math.floor(pos)]), widthAt(d[Math.ceil(pos)]));
}

test("the buckets: 0 below 0.25 ms, log-spaced to 60 s, one overflow; every value in its own bucket's bounds", () => {
  assert.equal(BUCKETS, 41);
  assert.equal(EDGES[0], LOW_MS);
  assert.equal(EDGES[EDGES.length - 1], HIGH_MS);
  for (let k = 1; k < EDGES.length; k++) assert.ok(Math.abs(EDGES[k] / EDGES[k - 1] - 1.3741) < 0.001, `ratio at ${k}`);
  assert.equal(bucketOf(0), 0);
  assert.equal(bucketOf(-3), 0);
  assert.equal(bucketOf(NaN), 0);
  assert.equal(bucketOf(0.2499), 0);
  assert.equal(bucketOf(0.25), 1);
  assert.equal(bucketOf(60000), 40);
  assert.equal(bucketOf(1e9), 40);
  for (const v of [0.25, 0.3, 1, 12, 12.000001, 99.99, 175, 977, 5000, 59999.9, ...EDGES]) {
    const [lo, hi] = bounds(bucketOf(v));
    assert.ok(v >= lo && (v < hi || (v >= HIGH_MS && hi === HIGH_MS)), `${v} in [${lo}, ${hi})`);
  }
});

test("encode/decode round-trip; merging sums counts; bad text names the part", () => {
  const h = empty();
  for (const v of [0, 0, 0, 12, 13, 175, 175, 176]) h[bucketOf(v)]++;
  const text = encode(h);
  assert.match(text, /^0:3,/);
  assert.deepEqual(decode(text), h);
  assert.deepEqual(decode(""), empty());
  const twice = merge(decode(text), h);
  assert.equal(total(twice), 16);
  assert.equal(mergeEncoded(text, text), encode(twice));
  assert.throws(() => decode("3:1,99:2"), /bad histogram part "99:2"/);
  assert.throws(() => decode("x"), /bad histogram part "x"/);
  assert.throws(() => decode(5), /must be text/);
});

test("percentiles agree with the exact ones within one bucket's width", () => {
  let seed = 7;
  const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
  const sets = {
    pod: Array.from({ length: 500 }, () => 60 + 40 * rand()), // 60..100 ms
    wide: Array.from({ length: 300 }, () => Math.exp(rand() * 8)), // 1 ms .. 3 s
    few: [12.5, 13, 250],
    zeros: Array.from({ length: 100 }, () => 0),
  };
  for (const [name, values] of Object.entries(sets)) {
    const h = empty();
    for (const v of values) h[bucketOf(v)]++;
    for (const q of [10, 50, 90, 99]) {
      const want = exact(values, q);
      const got = percentile(h, q);
      assert.ok(Math.abs(got - want) <= tolerance(values, q), `${name} p${q}: ${got} vs ${want}`);
    }
  }
  assert.equal(percentile(empty(), 50), null);
  const zeros = empty();
  zeros[0] = 5;
  assert.equal(percentile(zeros, 99), 0);
});

test("the recorder keeps requests per minute and pod, syncs per object colo, and takes them as batch.hist rows", () => {
  const r = new Recorder();
  const t = 29_000_000 * 60000 + 5000;
  r.request(t, "0", { state: 0, upstream: 65, fallback: 0, total: 70 });
  r.request(t + 1000, "0", { state: 0, upstream: 70, fallback: 0, total: 72 });
  r.request(t + 2000, "fallback", { state: 12, upstream: 2000, fallback: 300, total: 2310 });
  r.sync(t + 3000, "IAD", "TPE", 198);
  r.request(t + 60000, "0", { state: 0, upstream: 66, fallback: 0, total: 71 });
  const rows = r.take("TPE");
  const m = Math.floor(t / 60000);
  const find = (minute, who, seg) => rows.find((x) => x[0] === minute && x[2] === who && x[3] === seg);
  assert.equal(total(decode(find(m, "0", "upstream")[4])), 2);
  assert.equal(find(m, "0", "upstream")[1], "TPE");
  assert.equal(decode(find(m, "0", "state")[4])[0], 2);
  assert.equal(decode(find(m, "fallback", "fallback")[4])[bucketOf(300)], 1);
  assert.deepEqual(find(m, "TPE", "sync").slice(0, 4), [m, "IAD", "TPE", "sync"]);
  assert.equal(total(decode(find(m + 1, "0", "total")[4])), 1);
  assert.equal(r.take("TPE").length, 0, "taken rows are gone");
  r.restore(rows);
  r.request(t + 4000, "0", { state: 0, upstream: 65, fallback: 0, total: 70 });
  const again = r.take("TPE");
  const up = again.find((x) => x[0] === m && x[2] === "0" && x[3] === "upstream");
  assert.equal(total(decode(up[4])), 3, "restored rows add to what came since");
  assert.equal(again.filter((x) => x[3] === "sync").length, 1);
});

test("a busy minute stays a few hundred bytes: 2 pods and the fallback, 4 segments, syncs", () => {
  const r = new Recorder();
  const t = 29_000_000 * 60000;
  let seed = 3;
  const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
  for (let i = 0; i < 6000; i++) {
    const pod = i % 50 === 0 ? "fallback" : String(i % 2);
    const up = 60 + 60 * rand();
    r.request(t + i * 10, pod, { state: i % 300 === 0 ? 13 : 0, upstream: up, fallback: pod === "fallback" ? 300 * (1 + rand()) : 0, total: up + 2 });
  }
  for (let i = 0; i < 60; i++) r.sync(t + i * 1000, "NRT", "NRT", 10 + 5 * rand());
  const bytes = JSON.stringify(r.take("NRT")).length;
  assert.ok(bytes < 1000, `one minute took ${bytes} bytes`);
});
