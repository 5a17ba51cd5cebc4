// Pods that batch as vLLM does, for bench/balance.py: one token per engine step for every
// running sequence, a step that takes longer the larger the batch, at most --max-seqs
// sequences running (the rest wait, in order), and vLLM's /metrics gauges
// (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc).
//
// A step takes --step-ms + --per-seq-ms × running: the defaults, 12 + 0.55 ms, make about
// 47 tokens/s a sequence at a batch of 16 and 26 at 48, the shape of a 7B INT4 model on one
// RTX 4090 (docs/benchmarks.md "Balancing policies"). A new sequence's first token comes
// with the first step it runs in (prefill is not modelled apart: the prompts are short).
// The KV cache holds --kv-tokens tokens; a sequence holds its prompt (16) and its tokens so far.
//
// POST /v1/chat/completions (or /v1/completions): `max_tokens` tokens (default 16), as SSE with
// "stream": true (the usage event with include_usage), else one JSON answer at the end.
// GET /metrics: the gauges. Bench-only; no token check.
//
// Usage: node bench/batchpod.mjs [--count N] [--step-ms A] [--per-seq-ms B] [--max-seqs S] [--kv-tokens T]
// Prints one JSON line {"urls": [...]} once every listener is up; SIGTERM stops it.

import http from "node:http";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const count = Number(args.count ?? 2);
const stepMs = Number(args["step-ms"] ?? 12);
const perSeqMs = Number(args["per-seq-ms"] ?? 0.55);
const maxSeqs = Number(args["max-seqs"] ?? 48);
const kvTokens = Number(args["kv-tokens"] ?? 48 * 600);
const PROMPT_TOKENS = 16;

function makePod() {
  const pod = { waiting: [], running: [], stepping: false };
  const schedule = () => {
    if (pod.stepping || (pod.running.length === 0 && pod.waiting.length === 0)) return;
    pod.stepping = true;
    while (pod.running.length < maxSeqs && pod.waiting.length) pod.running.push(pod.waiting.shift());
    setTimeout(() => {
      for (const s of pod.running) s.token();
      pod.running = pod.running.filter((s) => !s.done);
      pod.stepping = false;
      schedule();
    }, stepMs + perSeqMs * pod.running.length);
  };
  pod.add = (s) => {
    pod.waiting.push(s);
    schedule();
  };
  pod.drop = (s) => {
    s.done = true;
    pod.waiting = pod.waiting.filter((x) => x !== s);
  };
  pod.metrics = () => {
    const used = pod.running.reduce((n, s) => n + PROMPT_TOKENS + s.made, 0);
    return [
      "# TYPE vllm:num_requests_running gauge", `vllm:num_requests_running{engine="0",model_name="bench"} ${pod.running.length}.0`,
      "# TYPE vllm:num_requests_waiting gauge", `vllm:num_requests_waiting{engine="0",model_name="bench"} ${pod.waiting.length}.0`,
      "# TYPE vllm:kv_cache_usage_perc gauge", `vllm:kv_cache_usage_perc{engine="0",model_name="bench"} ${Math.min(1, used / kvTokens)}`,
      "",
    ].join("\n");
  };
  return pod;
}

function serve(pod) {
  return http.createServer((req, res) => {
    res.socket?.setNoDelay(true);
    if (req.method === "GET" && req.url === "/metrics") {
      res.writeHead(200, { "content-type": "text/plain; version=0.0.4" });
      res.end(pod.metrics());
      return;
    }
    if (req.method !== "POST") {
      res.writeHead(404).end();
      return;
    }
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", () => {
      let doc = {};
      try {
        doc = JSON.parse(body);
      } catch {
        res.writeHead(400, { "content-type": "application/json" }).end('{"error":{"message":"bad json"}}');
        return;
      }
      const chat = req.url.startsWith("/v1/chat");
      const max = Number.isInteger(doc.max_tokens) ? doc.max_tokens : 16;
      const stream = doc.stream === true;
      const usage = !!(doc.stream_options && doc.stream_options.include_usage);
      const id = `cmpl-${Math.random().toString(16).slice(2)}`;
      const event = (i, last) => {
        const choice = chat
          ? { index: 0, delta: i === 0 ? { role: "assistant", content: "t " } : { content: "t " }, logprobs: null, finish_reason: last ? "length" : null }
          : { index: 0, text: "t ", logprobs: null, finish_reason: last ? "length" : null };
        return `data: ${JSON.stringify({ id, object: chat ? "chat.completion.chunk" : "text_completion", created: 0, model: "bench", choices: [choice] })}\n\n`;
      };
      const s = { made: 0, done: false };
      if (stream) res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
      s.token = () => {
        if (s.done) return;
        const last = s.made + 1 >= max;
        if (stream) res.write(event(s.made, last));
        s.made++;
        if (!last) return;
        s.done = true;
        const u = { prompt_tokens: PROMPT_TOKENS, completion_tokens: max, total_tokens: PROMPT_TOKENS + max };
        if (!stream) {
          const message = { role: "assistant", content: "t ".repeat(max) };
          res.writeHead(200, { "content-type": "application/json" });
          res.end(JSON.stringify({ id, object: chat ? "chat.completion" : "text_completion", created: 0, model: "bench",
            choices: [chat ? { index: 0, message, finish_reason: "length" } : { index: 0, text: message.content, finish_reason: "length" }], usage: u }));
          return;
        }
        if (usage) res.write(`data: ${JSON.stringify({ id, object: "chat.completion.chunk", created: 0, model: "bench", choices: [], usage: u })}\n\n`);
        res.end("data: [DONE]\n\n");
      };
      res.on("close", () => pod.drop(s)); // the client left: vLLM aborts the sequence
      pod.add(s);
    });
  });
}

const servers = [];
for (let i = 0; i < count; i++) {
  const srv = serve(makePod());
  await new Promise((resolve) => srv.listen(0, "127.0.0.1", resolve));
  servers.push(srv);
}
console.log(JSON.stringify({ urls: servers.map((s) => `http://127.0.0.1:${s.address().port}`) }));
process.on("SIGTERM", () => {
  for (const s of servers) s.close();
  process.exit(0);
});
