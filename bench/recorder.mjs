// The live view's recorder alone: N calls of recordRequest, for callgrind to count.
//   valgrind --tool=callgrind node bench/recorder.mjs <worker/src dir> N
// Instructions per call = (count at N - count at 0) / N (node's own start-up cancels out).
import { resolve } from "node:path";

const [dir, n] = [process.argv[2] || "worker/src", Number(process.argv[3] || 0)];
const h = await import(resolve(dir, "histogram.js"));
let seed = 1;
const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
const timings = Array.from({ length: 1024 }, () => ({ state: 0, upstream: 30 + 40 * rand(), fallback: 0, total: 32 + 40 * rand(), client: null }));
for (let i = 0; i < n; i++) h.recordRequest("pod-0", timings[i & 1023]);
console.log(`${n} calls, ${h.recorder.size} minute(s) recorded`);
