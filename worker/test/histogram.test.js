import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BUCKETS, EDGES, FIXED_EDGES, HIGH_MS, LOW_MS, RELATIVE_ERROR, REPS, Recorder, TOP, add, bounds, bucketOf, decode, decodeParts,
  empty, encode, merge, mergeEncoded, percentile, total,
} from "../src/histogram.js";

/** numpy's default percentile of exact values (the probe's, colocate/probe/stats.py). */
function exact(values, q) {
  const d = [...values].sort((a, b) => a - b);
  const pos = ((d.length - 1) * q) / 100;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return d[lo] + (d[hi] - d[lo]) * (pos - lo);
}

/** The bound the scheme promises: 1.08 % of the exact value, or 0.25 ms below 0.25 ms. */
function allowed(want) {
  return Math.max(want * RELATIVE_ERROR * (1 + 1e-9), want < LOW_MS ? LOW_MS : 0);
}

let seed = 7;
const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);

test("the buckets: 0 up to 0.25 ms, 32 a doubling to past 60 s, one overflow; upper edges inclusive as Prometheus' le", () => {
  assert.equal(TOP, 572);
  assert.equal(BUCKETS, 574);
  assert.equal(EDGES[0], LOW_MS);
  assert.ok(EDGES[TOP] >= HIGH_MS && EDGES[TOP - 1] < HIGH_MS);
  for (let k = 1; k <= TOP; k++) assert.ok(Math.abs(EDGES[k] / EDGES[k - 1] - 2 ** (1 / 32)) < 1e-12, `ratio at ${k}`);
  assert.equal(EDGES[32], 0.5); // OpenTelemetry's scale-5 grid: powers of two are edges
  assert.ok(Math.abs(RELATIVE_ERROR - 0.01083) < 0.00001);
  for (const v of [0, -3, NaN, 0.25]) assert.equal(bucketOf(v), 0, `${v}`);
  assert.equal(bucketOf(0.2500001), 1);
  assert.equal(bucketOf(0.5), 32);
  assert.equal(bucketOf(0.5000001), 33);
  assert.equal(bucketOf(EDGES[TOP]), TOP);
  assert.equal(bucketOf(EDGES[TOP] + 0.001), TOP + 1);
  assert.equal(bucketOf(1e9), TOP + 1);
  for (const v of [0.26, 0.3, 1, 12, 12.000001, 99.99, 100, 175, 977, 5000, 59999.9, ...EDGES]) {
    const [lo, hi] = bounds(bucketOf(v));
    assert.ok(v > lo && v <= hi, `${v} in (${lo}, ${hi}]`);
  }
});

test("every value from 0.25 ms to 60 s is within 1.08 % of the value its bucket stands for", () => {
  for (let k = 1; k <= TOP; k++) {
    const [lo, hi] = bounds(k);
    for (const v of [lo * (1 + 1e-12), (lo + hi) / 2, hi]) assert.ok(Math.abs(REPS[k] - v) <= allowed(v), `bucket ${k} value ${v}`);
  }
  assert.equal(REPS[0], 0);
  assert.equal(REPS[TOP + 1], EDGES[TOP]);
});

test("text round-trips, runs shorten, merging sums counts, bad text names the part", () => {
  const h = empty();
  for (const v of [0, 0, 0, 12, 13, 175, 175, 176]) add(h, v);
  const text = encode(h);
  assert.match(text, /^~0\*3,/);
  assert.deepEqual(decode(text), h);
  assert.deepEqual(decode(""), empty());
  const run = empty();
  run[200] = 4;
  run[201] = 5;
  run[202] = 1;
  run[205] = 2;
  assert.equal(encode(run), "~200*4,*5,1,3*2");
  assert.deepEqual(decode(encode(run)), run);
  const twice = merge(decode(text), h);
  assert.equal(total(twice), 16);
  assert.equal(mergeEncoded(text, text), encode(twice));
  assert.equal(encode(empty()), "");
  assert.throws(() => decode("~3,600*2"), /bad histogram part "600\*2"/);
  assert.throws(() => decode("~*3"), /bad histogram part "\*3"/);
  assert.throws(() => decode("~3,x"), /bad histogram part "x"/);
  assert.throws(() => decode("~3,2*0"), /bad histogram part "2\*0"/);
  assert.throws(() => decode("3:1,99:2"), /bad histogram part "99:2"/);
  assert.throws(() => decode("x"), /bad histogram part "x"/);
  assert.throws(() => decode(5), /must be text/);
});

test("the hand reader of encode's texts reads every text as the part-by-part reader does, and refuses what it refuses", () => {
  let seed = 7;
  const rand = (n) => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed % n;
  };
  const outcome = (read, text) => {
    try {
      return Array.from(read(text));
    } catch (err) {
      return String(err);
    }
  };
  const texts = ["~0", "~0*3", "~573", "~574", "~0,0,0", "~1,", "~,1", "~1,,2", "~00005", "~0005*2", "~00005*2", "~1*05", "~1*1e3",
    "~1* 5", "~1*5 ", "~2*9007199254740993", "~2*999999999999999", "~2*4294967297", "~1*", "~*", "~1**2", "~1,*2", "~-1"];
  for (let i = 0; i < 2000; i++) {
    const h = empty();
    for (let j = rand(40); j > 0; j--) h[rand(BUCKETS)] += 1 + (rand(3) === 0 ? rand(100000) : 0);
    const text = encode(h);
    if (text === "") continue; // "" is read before either reader
    const at = 1 + rand(text.length - 1); // and the same text with one character changed, and dropped
    texts.push(text, text.slice(0, at) + "0123456789*,x~ e-"[rand(17)] + text.slice(at + 1), text.slice(0, at) + text.slice(at + 1));
  }
  const refused = texts.filter((t) => typeof outcome(decodeParts, t) === "string").length;
  assert.ok(refused > 300, `${refused} of ${texts.length} texts malformed: the check needs both kinds`);
  for (const t of texts) assert.deepEqual(outcome(decode, t), outcome(decodeParts, t), t);
  // a merge reads both texts into one scratch array: a text refused leaves nothing behind for the next
  assert.throws(() => mergeEncoded("~3*7", "~3,x"), /bad histogram part "x"/);
  assert.equal(mergeEncoded("", "~5"), "~5");
});

test("percentiles are within 1.08 % (0.25 ms below 0.25 ms) of the exact ones, bimodal mixes included", () => {
  const sets = {
    pod: Array.from({ length: 500 }, () => 60 + 40 * rand()), // 60..100 ms
    wide: Array.from({ length: 300 }, () => Math.exp(rand() * 11) / 4), // 0.25 ms .. 15 s
    few: [12.5, 13, 250],
    zeros: Array.from({ length: 100 }, () => 0),
    bimodal: [...Array.from({ length: 80 }, () => 40 + 10 * rand()), ...Array.from({ length: 20 }, () => 900 + 400 * rand())],
    stateMostlyZero: [...Array.from({ length: 95 }, () => 0), ...Array.from({ length: 5 }, () => 12 + rand())],
    integers: Array.from({ length: 200 }, (_, i) => [1, 2, 4, 64, 108][i % 5]), // on and off the edges
  };
  for (const [name, values] of Object.entries(sets)) {
    const h = empty();
    for (const v of values) add(h, v);
    for (const q of [0, 10, 25, 50, 75, 90, 95, 99, 99.9, 100]) {
      const want = exact(values, q);
      const got = percentile(h, q);
      assert.ok(Math.abs(got - want) <= allowed(want), `${name} p${q}: ${got} vs ${want}`);
    }
  }
  assert.equal(percentile(empty(), 50), null);
  const zeros = empty();
  zeros[0] = 5;
  assert.equal(percentile(zeros, 99), 0);
});

test("histograms merge exactly: isolates, minutes and cells summed read as all their values together", () => {
  const parts = [[], [], []];
  const all = [];
  for (let i = 0; i < 900; i++) {
    const v = i % 3 === 2 ? 300 + 300 * rand() : 30 + 50 * rand();
    parts[i % 3].push(v);
    all.push(v);
  }
  const texts = parts.map((vs) => {
    const h = empty();
    for (const v of vs) add(h, v);
    return encode(h);
  });
  const merged = decode(mergeEncoded(mergeEncoded(texts[0], texts[1]), texts[2]));
  const whole = empty();
  for (const v of all) add(whole, v);
  assert.deepEqual(merged, whole);
  for (const q of [50, 90, 99]) assert.ok(Math.abs(percentile(merged, q) - exact(all, q)) <= allowed(exact(all, q)));
});

/** The earlier fixed buckets' percentile (its j-th of c values at (j + 0.5)/c of the way through the bucket). */
function fixedPercentile(text, q) {
  const counts = new Array(FIXED_EDGES.length + 1).fill(0);
  for (const part of text.split(",")) {
    const [k, c] = part.split(":").map(Number);
    counts[k] += c;
  }
  const n = counts.reduce((a, b) => a + b, 0);
  const at = (i) => {
    let before = 0;
    for (let k = 0; k < counts.length; k++) {
      const c = counts[k];
      if (c && i < before + c) {
        if (k === 0) return 0;
        if (k === counts.length - 1) return HIGH_MS;
        const lo = FIXED_EDGES[k - 1];
        return lo + ((FIXED_EDGES[k] - lo) * (i - before + 0.5)) / c;
      }
      before += c;
    }
    return HIGH_MS;
  };
  const pos = (q / 100) * (n - 1);
  const lo = Math.floor(pos);
  return lo === pos ? at(lo) : at(lo) + (at(lo + 1) - at(lo)) * (pos - lo);
}

test("text of the earlier fixed buckets still reads, each percentile within 1.08 % of what it read before", () => {
  for (const text of ["0:118,21:2,22:40", "0:3,21:2,22:40,40:1", "5:1", "22:1000,23:7", "0:5", "1:3,39:2"]) {
    const h = decode(text);
    assert.equal(total(h), text.split(",").reduce((n, p) => n + Number(p.split(":")[1]), 0), text);
    for (const q of [0, 10, 50, 90, 99, 100]) {
      const before = fixedPercentile(text, q);
      assert.ok(Math.abs(percentile(h, q) - before) <= allowed(before), `${text} p${q}: ${percentile(h, q)} vs ${before}`);
    }
    assert.deepEqual(decode(mergeEncoded("", text)), h, "stored once in the current form");
  }
  assert.equal(FIXED_EDGES.length, 40);
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

/** batch.hist's bytes for `syncs` takes of `perSync` requests each, now and in the fixed buckets' text. */
function syncBytes(perSync, syncs) {
  const r = new Recorder();
  const t = 29_000_000 * 60000;
  let s = 3;
  const rnd = () => ((s = (s * 1103515245 + 12345) % 2147483648) / 2147483648);
  const fixedOf = (v) => (v < LOW_MS ? 0 : v >= HIGH_MS ? 40 : FIXED_EDGES.findIndex((e) => v < e));
  let now = 0;
  let before = 0;
  let i = 0;
  for (let n = 0; n < syncs; n++) {
    const old = new Map(); // "who|segment" -> Map(bucket -> count): the same rows in the earlier text
    const count = (key, v) => {
      const m = old.get(key) ?? new Map();
      m.set(fixedOf(v), (m.get(fixedOf(v)) ?? 0) + 1);
      old.set(key, m);
    };
    for (let j = 0; j < perSync; j++, i++) {
      const pod = i % 50 === 0 ? "fallback" : String(i % 2);
      const up = 60 + 60 * rnd();
      const timing = { state: i % 300 === 0 ? 13 : 0, upstream: up, fallback: pod === "fallback" ? 300 * (1 + rnd()) : 0, total: up + 2 };
      r.request(t + i * 10, pod, timing);
      for (const seg of ["state", "upstream", "fallback", "total"]) count(pod + "|" + seg, timing[seg]);
    }
    const ms = 10 + 5 * rnd();
    r.sync(t + i * 10, "NRT", "NRT", ms);
    count("NRT|sync", ms);
    now += JSON.stringify(r.take("NRT")).length;
    const rows = [...old].map(([k, m]) => [Math.floor((t + i * 10) / 60000), "NRT", ...k.split("|"),
      [...m].sort((a, b) => a[0] - b[0]).map(([b, c]) => b + ":" + c).join(",")]);
    before += JSON.stringify(rows).length;
  }
  return { now, before };
}

test("batch.hist at the Worker's sync cadence (at most 1 s) stays within 2x the fixed buckets' bytes for the same traffic", () => {
  for (const [perSync, syncs] of [[1, 60], [10, 60], [100, 60]]) {
    const { now, before } = syncBytes(perSync, syncs);
    assert.ok(now <= 2 * before, `${perSync} requests a sync: ${now} bytes, ${before} in the fixed buckets`);
  }
  // a whole busy minute in one take (an isolate that could not sync for a minute): one run of buckets per segment
  const { now } = syncBytes(6000, 1);
  assert.ok(now < 2000, `one minute of 6000 requests took ${now} bytes`);
});
