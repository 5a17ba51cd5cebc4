// Each pod's prefix-cache counters from its own /metrics (podmetrics.js), believed only within bounds.
import { test } from "node:test";
import assert from "node:assert/strict";
import { MAX_BYTES, podPrefixCaches, prefixCounters } from "../src/podmetrics.js";

// vLLM V1's exposition (prometheus_client: counters end in _total, one series per engine).
const VLLM = `# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"} 2048.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"} 1024.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"} 1536.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"} 0.0
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"} 3.0
`;

test("vLLM's counters are summed over its engines; anything missing, negative, non-finite or inconsistent is not believed", () => {
  assert.deepEqual(prefixCounters(VLLM), { hits: 1536, queries: 3072 });
  assert.deepEqual(prefixCounters("vllm:prefix_cache_hits 1\nvllm:prefix_cache_queries 4 1733450000000\n"), { hits: 1, queries: 4 });
  assert.equal(prefixCounters("vllm:num_requests_running 1\n"), null);
  assert.equal(prefixCounters("vllm:prefix_cache_hits_total 5\n"), null); // queries missing
  assert.equal(prefixCounters("vllm:prefix_cache_hits_total 5\nvllm:prefix_cache_queries_total 4\n"), null); // hits > queries
  assert.equal(prefixCounters("vllm:prefix_cache_hits_total -1\nvllm:prefix_cache_queries_total 4\n"), null);
  assert.equal(prefixCounters("vllm:prefix_cache_hits_total NaN\nvllm:prefix_cache_queries_total 4\n"), null);
  assert.equal(prefixCounters("# vllm:prefix_cache_hits_total 1\nxvllm:prefix_cache_queries_total 4\n"), null);
});

test("every pod is asked at once with the pod token; one that fails, refuses, stalls or answers too much is left out", async () => {
  const cfg = { deadlineMs: 300, podToken: "pt", podUrls: ["http://ok.test", "http://down.test", "http://401.test", "http://slow.test", "http://huge.test"] };
  const seen = [];
  const fetchImpl = async (url, init) => {
    seen.push([url, init.headers.authorization]);
    if (url.startsWith("http://ok")) return new Response(VLLM);
    if (url.startsWith("http://down")) throw new TypeError("connection refused");
    if (url.startsWith("http://401")) return new Response("no", { status: 401 });
    if (url.startsWith("http://slow")) {
      return new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new Error("aborted"))));
    }
    const chunk = new TextEncoder().encode("#".repeat(1 << 20));
    let sent = 0;
    return new Response(new ReadableStream({
      pull(c) {
        sent += chunk.byteLength;
        if (sent > MAX_BYTES + 2 * chunk.byteLength) c.close(); // bounded even if it were read on
        else c.enqueue(chunk);
      },
    }));
  };
  const t = Date.now();
  assert.deepEqual(await podPrefixCaches(cfg, fetchImpl), [{ index: 0, hits: 1536, queries: 3072 }]);
  assert.ok(Date.now() - t < 5000);
  assert.deepEqual(seen.map((s) => s[0]), cfg.podUrls.map((u) => u + "/metrics"));
  assert.ok(seen.every((s) => s[1] === "Bearer pt"));
});
