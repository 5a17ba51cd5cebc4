// Streaming (SSE) client for bench/router.py: time to first byte and to last
// byte of each answer, from N concurrent clients on keep-alive connections.
//
// Usage: node bench/sse.mjs URL CLIENTS REQUESTS MAX_SECONDS HEADERS_JSON BODY
// Prints one JSON line: {n, errors, seconds, rps, ttfb_p50_ms, ttfb_p99_ms, ttlb_p50_ms,
// ttlb_p99_ms, backends, with_usage}: with_usage counts the answers that carried a usage
// event (asked for with stream_options.include_usage). Bounded by REQUESTS and MAX_SECONDS.

import http from "node:http";

const [url, clientsArg, requestsArg, maxSecondsArg, headersArg, body] = process.argv.slice(2);
const clients = Number(clientsArg);
const requests = Number(requestsArg);
const stopAt = performance.now() + Number(maxSecondsArg) * 1000;
const headers = { ...JSON.parse(headersArg), "content-length": Buffer.byteLength(body) };
const target = new URL(url);
const agent = new http.Agent({ keepAlive: true, maxSockets: clients });

const ttfb = [];
const ttlb = [];
const backends = {};
let issued = 0;
let errors = 0;
let withUsage = 0;

function once() {
  return new Promise((resolve) => {
    const t0 = performance.now();
    let first = null;
    let last = "";
    const req = http.request(
      { host: target.hostname, port: target.port, path: target.pathname, method: "POST", headers, agent },
      (res) => {
        res.on("data", (chunk) => {
          if (first === null) first = performance.now() - t0;
          last = (last + chunk).slice(-512); // the usage event and [DONE] end the answer
        });
        res.on("end", () => {
          const ok = res.statusCode === 200 && first !== null;
          if (ok) {
            ttfb.push(first);
            ttlb.push(performance.now() - t0);
            const b = res.headers["x-colocate-backend"] || "direct";
            backends[b] = (backends[b] || 0) + 1;
            if (last.includes('"usage":{')) withUsage++;
          } else errors++;
          resolve();
        });
        res.on("error", () => {
          errors++;
          resolve();
        });
      },
    );
    req.on("error", () => {
      errors++;
      resolve();
    });
    req.end(body);
  });
}

async function client() {
  while (issued < requests && performance.now() < stopAt) {
    issued++;
    await once();
  }
}

function pct(values, q) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b);
  const k = Math.min(s.length - 1, Math.max(0, Math.round((q / 100) * (s.length - 1))));
  return Math.round(s[k] * 1000) / 1000;
}

// The first request on each connection pays its connect and is counted; with
// REQUESTS well above CLIENTS that does not move the medians.
const t0 = performance.now();
await Promise.all(Array.from({ length: clients }, client));
const seconds = (performance.now() - t0) / 1000;
agent.destroy();
process.stdout.write(JSON.stringify({
  n: ttfb.length, errors, seconds: Math.round(seconds * 1000) / 1000,
  rps: seconds > 0 ? Math.round((ttfb.length / seconds) * 10) / 10 : 0,
  ttfb_p50_ms: pct(ttfb, 50), ttfb_p99_ms: pct(ttfb, 99), ttlb_p50_ms: pct(ttlb, 50), ttlb_p99_ms: pct(ttlb, 99),
  backends, with_usage: withUsage,
}) + "\n");
