// A pod that answers at once (or after --delay-ms), for bench/router.py.
//
// Node's http server, Nagle off: the bench must measure the router, not a slow pod.
// POST with `"stream": true` in the body answers Server-Sent Events (a first chunk at
// once, the rest on later turns of the event loop, a usage chunk when the body asks
// `"include_usage": true`, then [DONE]; with `"continuous_usage_stats": true` as well, the
// usage so far on every chunk, as vLLM writes it); anything else a small chat.completion JSON.
// Bench-only; --token makes it answer 401 to a wrong bearer.
//
// --slots K bounds how many requests each pod works on at once (the rest queue, in
// order), like a GPU pod's batch: with --delay-ms 95 --slots 1 a pod serves ~10 req/s,
// so spreading over several pods shows as throughput. 0 (default) = no bound.
//
// GET /__bench/count answers {"answered": n, "smallest_body": bytes}: the harness reads the
// fallback's count to tell whether the router served everything from the pods; the
// smallest POST body shows that a bench's prompt (--prompt-bytes) reached the pod whole.
//
// --chunks N --chunk-ms MS: a stream has N events, MS apart (a real pod sends one per token);
// --chunk-ms 0 (default) sends them on successive turns of the event loop. --pad C adds C
// characters to each event's content (a large event, as vLLM's with top logprobs is).
//
// Usage: node bench/pod.mjs [--count N] [--delay-ms MS] [--slots K] [--chunks N] [--chunk-ms MS] [--pad C]
//        [--token T]
// Prints one JSON line {"urls": [...]} once every listener is up; SIGTERM stops it.

import http from "node:http";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const count = Number(args.count ?? 1);
const delayMs = Number(args["delay-ms"] ?? 0);
const chunks = Number(args.chunks ?? 8);
const chunkMs = Number(args["chunk-ms"] ?? 0);
const pad = "x".repeat(Number(args.pad ?? 0));
const token = args.token ?? null;
const slots = Number(args.slots ?? 0);

const JSON_BODY = JSON.stringify({
  id: "chatcmpl-bench", object: "chat.completion", created: 0, model: "bench",
  choices: [{ index: 0, message: { role: "assistant", content: "ok ok ok ok" }, finish_reason: "stop" }],
  usage: { prompt_tokens: 4, completion_tokens: 4, total_tokens: 8 },
});
const USAGE_CHUNK = `data: ${JSON.stringify({ id: "chatcmpl-bench", object: "chat.completion.chunk", choices: [], usage: { prompt_tokens: 4, completion_tokens: 8, total_tokens: 12 } })}\n\n`;
const CHUNK = (i) => `data: ${JSON.stringify({ id: "chatcmpl-bench", object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: `t${i} ${pad}` } }] })}\n\n`;
// vLLM's continuous usage: the same chunk with the usage so far last (its key order)
const USAGE_SO_FAR = (i) => `data: ${JSON.stringify({ id: "chatcmpl-bench", object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: `t${i} ${pad}` } }],
  usage: { prompt_tokens: 4, total_tokens: 5 + i, completion_tokens: i + 1 } })}\n\n`;

let answered = 0; // all listeners together; GET /__bench/count reads it
let smallestBody = null; // bytes of the smallest request body answered (the bench's prompt size reached us)

function answer(req, res, body) {
  if (res.destroyed) return; // gone during the delay: nothing to answer, nothing counted
  answered++;
  const size = Buffer.byteLength(body);
  if (req.method === "POST" && (smallestBody === null || size < smallestBody)) smallestBody = size;
  if (token !== null && req.headers.authorization !== `Bearer ${token}`) {
    res.writeHead(401, { "content-type": "application/json" });
    res.end('{"error":{"message":"bad token","type":"auth","code":"unauthorized"}}');
    return;
  }
  if (req.method === "POST" && /"stream"\s*:\s*true/.test(body)) {
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    const usage = /"include_usage"\s*:\s*true/.test(body);
    const soFar = usage && /"continuous_usage_stats"\s*:\s*true/.test(body);
    let i = 0;
    const more = () => {
      if (i < chunks) {
        res.write(soFar ? USAGE_SO_FAR(i++) : CHUNK(i++));
        if (chunkMs > 0) setTimeout(more, chunkMs);
        else setImmediate(more);
      } else {
        if (usage) res.write(USAGE_CHUNK);
        res.end("data: [DONE]\n\n");
      }
    };
    more();
    return;
  }
  res.writeHead(200, { "content-type": "application/json", "content-length": Buffer.byteLength(JSON_BODY) });
  res.end(JSON_BODY);
}

function handlerFor() {
  let busy = 0;
  const queue = [];
  const next = () => {
    while (queue.length && (slots === 0 || busy < slots)) {
      const job = queue.shift();
      if (job.closed) continue; // the client went away while it queued (e.g. the end of a wrk run)
      busy++;
      let freed = false;
      const free = () => {
        if (!freed) {
          freed = true;
          busy--;
          next();
        }
      };
      job.res.once("finish", free);
      job.res.once("close", free);
      if (delayMs > 0) setTimeout(() => answer(job.req, job.res, job.body), delayMs);
      else answer(job.req, job.res, job.body);
    }
  };
  return (req, res) => {
    if (req.url === "/__bench/count") {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ answered, smallest_body: smallestBody }));
      return;
    }
    const job = { req, res, body: "", closed: false };
    res.once("close", () => {
      job.closed = true;
    });
    const parts = [];
    req.on("data", (c) => parts.push(c));
    req.on("end", () => {
      job.body = Buffer.concat(parts).toString();
      queue.push(job);
      next();
    });
  };
}

const servers = [];
const urls = [];
for (let i = 0; i < count; i++) {
  const s = http.createServer({ noDelay: true, keepAliveTimeout: 60_000 }, handlerFor());
  s.listen(0, "127.0.0.1", 511);
  await new Promise((resolve) => s.once("listening", resolve));
  servers.push(s);
  urls.push(`http://127.0.0.1:${s.address().port}`);
}
process.stdout.write(JSON.stringify({ urls }) + "\n");
process.on("SIGTERM", () => {
  for (const s of servers) s.closeAllConnections?.();
  process.exit(0);
});
