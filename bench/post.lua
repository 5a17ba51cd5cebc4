-- wrk script template for bench/router.py (bench/harness.py fills the
-- placeholders): one POST with fixed headers and body, and a one-line JSON summary
-- (latency percentiles in microseconds) that the harness parses.
wrk.method = "POST"
wrk.body = [==[@BODY@]==]
@HEADERS@
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"n":%d,"us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,"p50_us":%.1f,"p99_us":%.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
