import { test } from "node:test";
import assert from "node:assert/strict";
import { EDGES, add, empty, encode } from "../src/histogram.js";
import { exposition } from "../src/metrics.js";

const cfg = { podUrls: ["https://pod-a.example:8443", "https://pod-b.example"], activeGeneration: "us-east.g1", drainingGeneration: null,
  region: "us-east" };

function text(values) {
  const h = empty();
  for (const v of values) add(h, v);
  return encode(h);
}

function answer(segments) {
  return { segments, served: [{ backend: "pod-0", requests: 5, prompt_tokens: 50, completion_tokens: 20 }],
    keys: { total: 3, active: 1, revoked: 1 }, pods: [{ pod: cfg.podUrls[1], state: "open", failures: 4 }], forced: null };
}

test("a fleet's client colos add into one series per backend; buckets cumulative, every second edge, to 60 s", () => {
  const out = exposition(answer([["IAD", "0@NRT", "total", text([40, 41, 90])], ["IAD", "0@FRA", "total", text([42])],
    ["IAD", "IAD", "sync", text([3])]]), cfg);
  const buckets = out.split("\n").filter((l) => l.startsWith('colocate_segment_seconds_bucket{segment="total"'));
  assert.ok(buckets.every((l) => l.includes('backend="pod-0",colo="IAD"')), "one series");
  const counts = buckets.map((l) => Number(l.split(" ")[1]));
  assert.deepEqual([...counts].sort((a, b) => a - b), counts, "cumulative");
  assert.equal(counts.at(-1), 4);
  assert.equal(counts[0], 0, "starts at the edge below the first value");
  const les = buckets.slice(0, -1).map((l) => Number(/le="([^"]+)"/.exec(l)[1]));
  for (let i = 1; i < les.length; i++) assert.ok(Math.abs(les[i] / les[i - 1] - 2 ** (1 / 16)) < 1e-4, `edge ${i}`);
  assert.equal(les.at(-1), Number((EDGES.at(-1) / 1000).toPrecision(6)));
  assert.match(out, /colocate_segment_seconds_count\{segment="total",backend="pod-0",colo="IAD"\} 4/);
  assert.match(out, /colocate_segment_seconds_count\{segment="sync",backend="state",colo="IAD",state_colo="IAD"\} 1/);
  assert.match(out, /colocate_breaker_state\{pod="1",state="open"\} 1/);
  assert.match(out, /colocate_breaker_state\{pod="0",state="closed"\} 1/);
  assert.match(out, /colocate_keys\{state="expired"\} 1/);
  assert.match(out, /colocate_tokens_total\{backend="pod-0",kind="completion"\} 20/);
  assert.match(out, /colocate_requests_total\{backend="fallback"\} 0/); // always there: the dashboard's share divides by it
  assert.ok(!out.includes("pod-a.example") && !out.includes("pod-b.example"), "never a URL");
});

test("streams' ttft and itl are histograms; prefix affinity's picks and each pod's own prefix-cache counters are counters", () => {
  const segs = [["IAD", "0", "ttft", text([120, 130])], ["IAD", "0", "itl", text([14])],
    ["IAD", "0", "affinity", text([0, 0, 0])], ["IAD", "0@NRT", "affinity", text([0])], ["IAD", "1", "shed", text([0, 0])]];
  const out = exposition(answer(segs), cfg, [{ index: 0, hits: 750, queries: 1000 }, { index: 1, hits: 0, queries: 12 }]);
  assert.match(out, /colocate_segment_seconds_count\{segment="ttft",backend="pod-0",colo="IAD"\} 2/);
  assert.match(out, /colocate_segment_seconds_count\{segment="itl",backend="pod-0",colo="IAD"\} 1/);
  assert.ok(!/segment="(affinity|shed)"/.test(out), "picks are not durations");
  assert.match(out, /# TYPE colocate_balance_picks_total counter/);
  assert.match(out, /colocate_balance_picks_total\{backend="pod-0",by="affinity"\} 4/);
  assert.match(out, /colocate_balance_picks_total\{backend="pod-1",by="load"\} 2/);
  assert.match(out, /colocate_pod_prefix_cache_hits_total\{pod="0"\} 750/);
  assert.match(out, /colocate_pod_prefix_cache_queries_total\{pod="1"\} 12/);
  // no pod reported: the families are declared, with no series
  const none = exposition(answer([]), cfg);
  assert.match(none, /# TYPE colocate_pod_prefix_cache_hits_total counter/);
  assert.ok(!/colocate_pod_prefix_cache_hits_total\{/.test(none));
});

test("the keeper's last pass: every alert 0 or 1, the pods' verdicts, replacements by pod and reason; nothing without a keeper", () => {
  const keeper = { at: 1_800_000_000_000, alerts: [{ name: "replace_failed", pod: 1, message: "3 failures" }],
    pods: [{ index: 0, state: "ok" }, { index: 1, state: "dead" }],
    replacements: [{ pod: 1, reason: "dead", n: 2 }, { pod: 0, reason: "certificate", n: 1 }] };
  const out = exposition({ ...answer([]), keeper }, cfg);
  assert.match(out, /colocate_keeper_alert\{alert="replace_failed"\} 1/);
  for (const name of ["update_failing", "stack_locked", "stale_checkout"]) assert.match(out, new RegExp(`colocate_keeper_alert\\{alert="${name}"\\} 0`));
  assert.match(out, /colocate_keeper_last_pass_timestamp_seconds 1800000000/);
  assert.match(out, /colocate_keeper_pod_state\{pod="1",state="dead"\} 1/);
  assert.match(out, /# TYPE colocate_keeper_replacements_total counter/);
  assert.match(out, /colocate_keeper_replacements_total\{pod="1",reason="dead"\} 2/);
  assert.match(out, /colocate_keeper_replacements_total\{pod="0",reason="certificate"\} 1/);
  assert.ok(!exposition(answer([]), cfg).includes("colocate_keeper_"), "no keeper ran: no series to page on");
});
