"""bench/router.py (make bench): a tiny real run (wrk, the bench pod, the bare, contract and router workerd),
the summary arithmetic, and usage errors as a subprocess. Nothing here asserts a speed."""

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import harness, router as bench_router

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow
needs_wrk = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (make bench installs it)")
# The runs below check plumbing, not speed: bench pods that answer this many ms late hold each
# client's closed loop to a few hundred requests a second, so the Workers (and the sandbox's
# proxy) spend a fraction of the CPU; every request still makes the whole trip. The router's
# wait on state is read over 20 requests after the rounds (--state-requests; the bench's 300 are for a p99).
POD_DELAY = "5"


@needs_wrk
def test_small_run_measures_every_target(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench_router.main(["--rounds", "2", "--seconds", "1", "--clients", "1,4", "--sse-requests", "20",
                            "--pod-delay-ms", POD_DELAY, "--state-requests", "20", "--quiet", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    (series,) = result["series"]
    assert series["router_backend"].startswith("pod")  # the router really served from a pod
    assert 0 < series["router_state_ms"]["n"] <= 20  # the router's Server-Timing said how long it waited on state
    assert [lv["clients"] for lv in series["levels"]] == [1, 4]
    for lv in series["levels"]:
        assert len(lv["rounds"]) == 2
        for r in lv["rounds"]:
            for t in harness.TARGETS:
                assert r[t]["n"] > 0 and r[t]["errors"] == 0
                # 20 asked, as many as --seconds allows (fewer on a loaded machine), each a 200 stream
                assert 0 < r[t]["sse"]["n"] <= 20 and r[t]["sse"]["errors"] == 0
            assert r["router"]["sse"]["backends"] == {"pod-0": r["router"]["sse"]["n"]}
            # CPU is read for the workerd processes, not for the pod.
            assert r["direct"].get("cpu_us_per_req") is None
            assert all(r[t]["cpu_us_per_req"] > 0 for t in ("bare", "contract", "router"))
        rb = lv["router_vs_bare"]
        per_round = sorted(r["router"]["p50_ms"] - r["bare"]["p50_ms"] for r in lv["rounds"])
        assert rb["added_p50_ms"] == pytest.approx(sum(per_round) / 2, abs=0.002)  # median of two rounds
        assert lv["router_vs_contract"]["cpu_ratio"] > 0 and lv["contract_vs_bare"]["cpu_ratio"] > 0
    assert {g["goal"] for g in result["goals"]} == {"added_p50_ms", "sse_added_ttfb_ms",  # 32 clients not run
                                                    "own_added_p50_ms", "own_sse_added_ttfb_ms"}
    out = capsys.readouterr().out
    assert "router vs bare" in out and "router vs contract" in out and "contract vs bare" in out
    assert all(r[t]["sse"]["with_usage"] == 0 for lv in series["levels"] for r in lv["rounds"] for t in harness.TARGETS)


@needs_wrk
def test_streams_asking_for_usage_reach_several_pods_and_carry_it(tmp_path):
    out = tmp_path / "bench.json"
    # Paced like tokens (12 events 5 ms apart): the router's counting branch then reads
    # what arrived in between, and the usage event must still reach every client.
    # least_busy spreads them: under the cells' default (prefix) the bench's identical requests stay on one pod
    rc = bench_router.main(["--rounds", "1", "--seconds", "1", "--clients", "2", "--sse-requests", "16", "--pods", "2",
                            "--pod-delay-ms", POD_DELAY, "--balance", "least_busy", "--sse-usage", "--sse-chunks", "12",
                            "--sse-chunk-ms", "5", "--state-requests", "20", "--quiet", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["options"]["sse_usage"] is True and result["options"]["balance"] == "least_busy"
    assert (result["options"]["sse_chunks"], result["options"]["sse_chunk_ms"]) == (12, 5)
    (series,) = result["series"]
    (r,) = series["levels"][0]["rounds"]
    for t in harness.TARGETS:
        # 16 asked, as many as --seconds allows (fewer on a loaded machine): every one carried its usage
        assert 0 < r[t]["sse"]["n"] <= 16 and r[t]["sse"]["with_usage"] == r[t]["sse"]["n"], (t, r[t]["sse"])
    # The router's tapped path, each stream from a pod: which of the two is prefix affinity's pick (one
    # prompt, one pod) unless that pod is busier than its bound, as the load and the schedule make it.
    backends = r["router"]["sse"]["backends"]
    assert set(backends) <= {"pod-0", "pod-1"} and sum(backends.values()) == r["router"]["sse"]["n"], backends
    assert "SSE requests ask include_usage; streams of 12 events 5 ms apart" in bench_router.table(result)
    # 12 events 5 ms apart take at least 55 ms, at the pod and so at every client
    assert all(r[t]["sse"]["ttlb_p50_ms"] >= 55 for t in harness.TARGETS), r


@needs_wrk
def test_ladder_runs_every_rung_through_the_pods_token_check(capsys):
    from bench import ladder

    # The bench pod answers 401 to a wrong credential and wrk counts that as an error, so
    # zero errors means each rung really swapped in the pod's token and was served.
    rc = ladder.main(["--rounds", "1", "--seconds", "1", "--clients", "2", "--pod-delay-ms", POD_DELAY, "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert list(rows) == list(ladder.RUNGS)
    for rung, cols in rows.items():
        assert float(cols[2]) > 0 and cols[-1] == "0", (rung, cols)
    assert float(rows["bare"][3]) == 1.0  # each rung's CPU is given against bare's


def test_held_body_rungs_send_the_request_on_and_return_the_whole_answer():
    import urllib.request

    from bench import ladder

    # A stream request: the bench pod streams only when the body it got says so, so an SSE
    # answer through held-request and held-both shows the held body reached the pod. The
    # answer rungs return the answer's bytes, so the whole stream arrives, [DONE] included.
    rungs = ("held-request", "held-answer", "held-both")
    with ladder.started(rungs=rungs) as (workers, headers):
        for rung in rungs:
            req = urllib.request.Request(workers[rung].url + harness.PATH, data=harness.STREAM_BODY.encode(),
                                         headers=headers[rung], method="POST")
            with urllib.request.urlopen(req, timeout=10) as res:
                assert res.status == 200, rung
                assert res.headers["content-type"].startswith("text/event-stream"), rung
                assert res.read().decode().rstrip().endswith("data: [DONE]"), rung


def test_ladder_refuses_a_bad_count():
    from bench import ladder

    with pytest.raises(SystemExit) as exc:
        ladder.main(["--rounds", "0"])
    assert exc.value.code == 2


@needs_wrk
def test_ladder_times_streams_through_two_pods_for_the_rungs_named(tmp_path):
    from bench import ladder

    # sse.mjs counts an answer that is not a 200 stream as an error, and the run refuses a
    # warm-up with errors, so rows with answers and no errors were served as streams.
    out = tmp_path / "ladder.json"
    rc = ladder.main(["--rungs", "bare,ends,router", "--request", "usage", "--pods", "2", "--clients", "1",
                      "--pod-delay-ms", POD_DELAY, "--rounds", "1", "--seconds", "1", "--quiet", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert (result["request"], result["pods"]) == ("usage", 2)
    rows = {r["rung"]: r for r in result["rungs"]}
    assert list(rows) == ["bare", "ends", "router"]
    for rung, r in rows.items():
        assert r["rps"] > 0 and r["errors"] == 0 and r["ttfb_p50_ms"] > 0, rung
    assert rows["bare"]["ttfb_added_ms"] == 0 and rows["bare"]["cpu_vs_bare"] == 1.0


@pytest.mark.parametrize("rungs, said", [("router,bare", "bare must come first"), ("bare,nope", "unknown rung 'nope'"),
                                         ("bare,router,router", "each rung once")])
def test_ladder_names_a_bad_rung_list(rungs, said, capsys):
    from bench import ladder

    with pytest.raises(SystemExit) as exc:
        ladder.main(["--rungs", rungs])
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def _round(p50, rps, cpu, ttfb=None):
    out = {"p50_ms": p50, "p99_ms": p50 * 2, "rps": rps, "cpu_us_per_req": cpu, "errors": 0}
    if ttfb is not None:
        out["sse"] = {"ttfb_p50_ms": ttfb, "ttfb_p99_ms": ttfb, "ttlb_p50_ms": ttfb + 1, "ttlb_p99_ms": ttfb + 1,
                      "rps": rps, "cpu_us_per_req": cpu, "errors": 0}
    return out


def test_summary_takes_medians_of_per_round_comparisons():
    rounds = [
        {"direct": _round(0.1, 9000, None, 0.3), "bare": _round(0.5, 2000, 300, 1.0), "router": _round(0.6, 1800, 330, 1.1)},
        {"direct": _round(0.1, 9000, None, 0.3), "bare": _round(0.9, 1000, 400, 1.0), "router": _round(1.0, 500, 800, 1.5)},
        {"direct": _round(0.1, 9000, None, 0.3), "bare": _round(0.5, 2000, 300, 1.0), "router": _round(0.7, 1900, 315, 1.2)},
    ]
    s = harness.summarise(rounds)
    rb = s["router_vs_bare"]
    assert rb["added_p50_ms"] == pytest.approx(0.1)
    assert rb["throughput_ratio"] == pytest.approx(0.9)
    assert rb["cpu_ratio"] == pytest.approx(1.1)
    assert rb["sse_added_ttfb_p50_ms"] == pytest.approx(0.2)
    assert "cpu_ratio" not in s["bare_vs_direct"]
    assert s["median"]["router"]["rps"] == 1800


def test_contract_floor_is_compared_both_ways_when_it_ran():
    rounds = [
        {"bare": _round(0.5, 2000, 300), "contract": _round(0.6, 1600, 390), "router": _round(0.7, 1500, 420)},
        {"bare": _round(0.5, 2000, 300), "contract": _round(0.8, 1000, 450), "router": _round(0.8, 1000, 450)},
        {"bare": _round(0.5, 2000, 300), "contract": _round(0.6, 1600, 360), "router": _round(0.6, 1700, 378)},
    ]
    rounds = [{"direct": _round(0.1, 9000, None), **r} for r in rounds]
    s = harness.summarise(rounds)
    assert s["contract_vs_bare"]["cpu_ratio"] == pytest.approx(1.3)  # 1.3, 1.5, 1.2
    assert s["router_vs_contract"]["cpu_ratio"] == pytest.approx(1.05)  # 1.0769, 1.0, 1.05
    assert s["router_vs_contract"]["added_p50_ms"] == pytest.approx(0.0)  # 0.1, 0.0, 0.0
    assert s["router_vs_bare"]["cpu_ratio"] == pytest.approx(1.4)
    lv = {"clients": 32, **s}
    got = {g["goal"]: (g["value"], g["met"]) for g in harness.goals([{"pods": 1, "levels": [lv]}])}
    assert got["own_cpu_ratio"] == (pytest.approx(1.05), True)
    assert got["cpu_ratio"] == (pytest.approx(1.4), False)
    # The same limits against the floor: throughput 1500/1600, 1000/1000, 1700/1600, median 1.0.
    assert got["own_throughput_ratio"] == (pytest.approx(1.0), True)
    assert got["throughput_ratio"] == (pytest.approx(0.75), False)  # 0.75, 0.5, 0.85


def test_goals_are_judged_at_their_client_counts():
    series = [{"pods": 2, "levels": [
        {"clients": 1, "router_vs_bare": {"added_p50_ms": 0.05, "sse_added_ttfb_p50_ms": 0.3}},
        {"clients": 32, "router_vs_bare": {"cpu_ratio": 1.2, "throughput_ratio": 0.95}},
    ]}]
    got = {g["goal"]: g["met"] for g in harness.goals(series)}
    assert got == {"added_p50_ms": True, "sse_added_ttfb_ms": False, "cpu_ratio": False, "throughput_ratio": True}
    # With the contract floor run too, each limit is judged against it as well.
    series[0]["levels"][0]["router_vs_contract"] = {"added_p50_ms": 0.2, "sse_added_ttfb_p50_ms": 0.1}
    series[0]["levels"][1]["router_vs_contract"] = {"cpu_ratio": 1.05, "throughput_ratio": 0.85}
    got = {g["goal"]: g["met"] for g in harness.goals(series)}
    assert {k: v for k, v in got.items() if k.startswith("own_")} == {
        "own_added_p50_ms": False, "own_sse_added_ttfb_ms": True, "own_cpu_ratio": True, "own_throughput_ratio": False}


def test_router_headers_carry_a_client_key_when_given():
    assert "authorization" not in harness.router_headers()
    assert harness.router_headers("clc_abc")["authorization"] == "Bearer clc_abc"


def test_worker_src_must_hold_every_module(tmp_path):
    with pytest.raises(harness.BenchError, match="module .* is missing"):
        harness.bench_plan(5000, tmp_path)
    for f in (ROOT / "worker" / "src").iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    plan = harness.bench_plan(5000, tmp_path)
    assert all(m.path.parent == tmp_path for m in plan.worker.modules)


@needs_wrk
def test_far_state_leaves_the_hot_path_at_zero(capsys):
    # The object 150 ms away (sandbox delay on that hop only): a forced round trip pays it;
    # routed requests, served from the isolate's copy, do not (their p50 stays far below).
    assert bench_router.main(["--rounds", "1", "--seconds", "1", "--clients", "1", "--no-stream", "--quiet",
                              "--pod-delay-ms", POD_DELAY, "--state-requests", "20", "--far-state-ms", "150", "--json", "-"]) == 0
    (series,) = json.loads(capsys.readouterr().out)["series"]
    assert series["far_state"]["state_colo"] == "IAD"
    assert 150 <= series["far_state"]["state_rtt_p50_ms"] < 300  # paid once, not twice
    assert series["levels"][0]["median"]["router"]["p50_ms"] < 150


def test_usage_error_exits_2_as_a_subprocess():
    res = subprocess.run([sys.executable, "-m", "bench.router", "--clients", "x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--clients" in res.stderr


@pytest.mark.parametrize(("flag", "value", "said"), [("--sse-chunks", "0", "must be at least 1 (got 0)"),
                                                     ("--sse-chunk-ms", "-1", "must be at least 0 (got -1.0)")])
def test_a_stream_shape_out_of_range_is_named(flag, value, said, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_router.main([flag, value])
    assert exc.value.code == 2
    assert f"{flag} {said}" in capsys.readouterr().err


def _post(url: str, timeout: float = 10.0):
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", harness.PATH, body=harness.BODY, headers={"content-type": "application/json"})
    return conn


def test_bench_pods_count_answers_and_free_a_slot_when_a_queued_client_leaves():
    with harness.pods(2, 200, None, slots=1) as urls:
        assert len(set(urls)) == 2
        busy = _post(urls[0])  # holds the only slot for 200 ms
        gone = _post(urls[0])  # queued behind it, then leaves
        gone.close()
        assert busy.getresponse().status == 200
        busy.close()
        after = _post(urls[0])  # would hang forever if the leaver kept the slot
        assert after.getresponse().status == 200
        after.close()
        assert harness.answered(urls[1]) == 2  # one process: the count covers every listener


def test_a_router_not_served_by_a_pod_is_a_setup_error(monkeypatch, capsys):
    # A pod that refuses the router's token: the router falls back, and the bench refuses
    # to measure the fallback as if it were the pod path.
    real = harness.pods

    def wrong_token(count, delay_ms, token, *shape):
        return real(count, delay_ms, "not-the-router-token" if token else None, *shape)

    monkeypatch.setattr(harness, "pods", wrong_token)
    assert bench_router.main(["--rounds", "1", "--seconds", "1", "--clients", "1", "--no-stream", "--quiet"]) == 2
    assert "not from a pod" in capsys.readouterr().err


def test_stall_bench_measures_a_stalled_client_and_a_burst_through_the_router(tmp_path, capsys):
    from bench import stall

    out = tmp_path / "stall.json"
    # The default shape, fewer events: each padded event with the usage the router asks the pod for
    # stays within the router's per-token allowance (usage.js streamCap), so the stream is not cut.
    assert stall.main(["--chunks", "1000", "--stall-s", "0.3", "--burst-chunks", "400", "--quiet",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    s, b = result["stall"], result["burst"]
    # ~3 KB a padded event, ~125 bytes a plain one; bench.stall refuses an answer without its usage event and [DONE]
    assert 2.9 < s["answer_mb"] < 3.4 and 0.04 < b["answer_mb"] < 0.06
    assert s["rss_start_mb"] > 0 and s["rest_read_s"] >= 0 and b["ttlb_ms"] >= b["max_gap_ms"] >= 0
    if shutil.which("ss"):
        assert 0 < s["left_the_pod_mb"] <= s["answer_mb"] * 1.1 + 0.1  # the pod's bytes: the usage it adds, headers
    assert "a client that stalls" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "said"), [
    (["--stall-s", "-1"], "--stall-s must be at least 0 (got -1.0)"),
    # more events than the request may have tokens: the router would cut the stream, not measure a stall
    (["--chunks", "200000"], "--chunks must be at most 8128 (got 200000)"),
    (["--burst-chunks", "9000"], "--burst-chunks must be at most 8128 (got 9000)"),
    (["--pad", "4000"], "--pad must be at most 3840 (got 4000)"),
])
def test_stall_bench_names_a_bad_value(argv, said, capsys):
    from bench import stall

    with pytest.raises(SystemExit) as exc:
        stall.main(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_profile_self_times_are_summed_per_function_and_divided_by_requests():
    from bench.profile import self_times

    frame = {"functionName": "readBody", "url": "file:///x/body.js", "lineNumber": 12}
    prof = {"nodes": [{"id": 1, "callFrame": frame}, {"id": 2, "callFrame": {**frame, "functionName": ""}}],
            "samples": [1, 2, 1, 1], "timeDeltas": [100, 50, 100, 0]}
    rows = self_times(prof, requests=10)
    assert rows[0] == (20.0, 0.8, "readBody body.js:13")
    assert rows[1] == (5.0, 0.2, "(anonymous) body.js:13")


def test_profile_compare_scales_each_share_of_busy_samples_by_the_processs_cpu(monkeypatch, tmp_path):
    from bench import profile as bench_profile

    def fake(target, src, seconds, clients):
        # bare: all busy time in fetch; the router: 3 of 8 busy samples in readBody
        frames = [{"functionName": "(idle)", "url": "", "lineNumber": -1},
                  {"functionName": "fetch", "url": "", "lineNumber": -1},
                  {"functionName": "readBody", "url": "file:///x/body.js", "lineNumber": 15 if src else 20}]
        samples = [1, 2, 2, 2] if target == "bare" else [1, 2, 2, 3, 3, 2, 2, 2, 3]
        prof = {"nodes": [{"id": i + 1, "callFrame": f} for i, f in enumerate(frames)], "samples": samples,
                "timeDeltas": [50] * len(samples), "cpu_us_per_req": 100.0 if target == "bare" else (200.0 if src else 160.0)}
        return prof, 1000

    monkeypatch.setattr(bench_profile, "profile", fake)
    costs, served = bench_profile.compare(tmp_path, 1, 32, rounds=3)
    assert costs["bare"] == {"fetch": 100.0}
    assert costs["before"] == {"fetch": 125.0, "readBody body.js": 75.0}  # 5 and 3 of 8 busy samples x 200 µs
    assert costs["after"] == {"fetch": 100.0, "readBody body.js": 60.0}
    text = bench_profile.compare_table(costs, served, top=5)
    assert "| `readBody body.js` | 0.0 | 75.0 | 60.0 |" in text
    assert "| the process's CPU per request | 100.0 | 200.0 | 160.0 |" in text


def test_instruction_total_comes_from_the_summary_or_totals_line():
    from bench.instructions import total_instructions

    assert total_instructions("events: Ir\nfl=x\n1 5\nsummary: 123456\n") == 123456
    assert total_instructions("events: Ir\ntotals: 987\n") == 987
    with pytest.raises(harness.BenchError, match="summary"):
        total_instructions("events: Ir\n")


def test_instruction_summary_takes_the_median_and_its_spread():
    from bench.instructions import summarise, table

    s = summarise({"bare": [1000, 1020, 990], "contract": [1500, 1500, 1500], "router": [2000, 1800, 2200]},
                  warm=0, requests=10)
    rows = {r["rung"]: r for r in s["rungs"]}
    assert rows["bare"]["instructions_per_req"] == 100 and rows["bare"]["runs"] == [100, 102, 99]
    assert rows["bare"]["spread"] == pytest.approx(0.03)
    assert rows["router"]["vs_bare"] == pytest.approx(2.0) and rows["router"]["spread"] == pytest.approx(0.2)
    assert s["router_vs_contract"] == pytest.approx(1.333, abs=0.001) and s["repeat"] == 3
    s.update(valgrind="valgrind-3.19.0", request="json", pods=1)
    assert "back to back)" in table(s).splitlines()[0]
    assert "one every 1000 ms, 2 late)" in table({**s, "every_ms": 1000, "late": 2}).splitlines()[0]


@pytest.mark.parametrize("kind", ["json", "stream", "usage"])
def test_a_prompt_of_n_bytes_is_a_system_message_before_the_users(kind):
    body = json.loads(harness.chat_body(kind, 5000))
    system, user = body["messages"]
    assert system["role"] == "system" and len(system["content"].encode()) == 5000 and user == {"role": "user", "content": "hi"}
    plain = json.loads(harness.chat_body(kind))
    assert plain["messages"] == [user]  # the rest of the request is the same with or without a prompt
    assert {k: v for k, v in body.items() if k != "messages"} == {k: v for k, v in plain.items() if k != "messages"}


@needs_wrk
def test_wrk_and_sse_runs_carry_the_prompt_to_the_pod():
    import urllib.request

    # wrk's Lua script and sse.mjs's argv both carry the body: each request the pod
    # answered, streamed or not, held the whole 8 KiB prompt.
    with harness.pods(1, 0, "tok") as (pod_url,):
        plain = harness.wrk_run(pod_url, 1, 1, harness.direct_headers("tok"), harness.chat_body("json", 8192))
        streamed = harness.sse_run(pod_url, 1, 20, 5, harness.direct_headers("tok"), usage=True, prompt_bytes=8192)
        with urllib.request.urlopen(pod_url + "/__bench/count", timeout=10) as res:
            seen = json.loads(res.read())
    assert plain["n"] > 0 and plain["errors"] == 0 and streamed["n"] == 20 and streamed["with_usage"] == 20
    # wrk may stop with a request answered but not counted
    assert seen["answered"] >= plain["n"] + 20 and seen["smallest_body"] > 8192


@contextlib.contextmanager
def json_answers(arrivals: list[float], answer_s: list[float]):
    """A Worker on 127.0.0.1 that answers every POST with a JSON chat completion, after
    ``answer_s[0]`` seconds, noting when each arrived: its URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answers(BaseHTTPRequestHandler):
        def do_POST(self):
            arrivals.append(time.monotonic())
            self.rfile.read(int(self.headers["content-length"]))
            time.sleep(answer_s[0])
            body = b'{"object":"chat.completion"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_instruction_driver_refuses_an_answer_that_is_not_the_stream_asked_for():
    from bench import instructions

    with json_answers([], [0.0]) as url:  # a Worker that answers JSON to a stream request
        instructions.drive(url, {"content-type": "application/json"}, 2)  # JSON asked, JSON answered
        with pytest.raises(harness.BenchError, match=r"does not end with \[DONE\]"):
            instructions.drive(url, {"content-type": "application/json"}, 2, harness.STREAM_BODY, stream=True)


def test_instruction_driver_paces_its_requests_and_counts_those_that_start_late():
    from bench import instructions

    arrivals: list[float] = []
    answer_s = [0.0]
    with json_answers(arrivals, answer_s) as url:
        t0 = time.monotonic()
        instructions.drive(url, {"content-type": "application/json"}, 5, every_s=0.1)
        # never early, timed where the driver is (a loaded server notes arrivals late): the fifth
        # request waited for its slot, 0.4 s after the first began; back to back takes milliseconds
        assert time.monotonic() - t0 >= 4 * 0.1 and len(arrivals) == 5
        answer_s[0] = 0.25  # every answer outlasts its slot: each request after the first starts late
        assert instructions.drive(url, {"content-type": "application/json"}, 4, every_s=0.1) == 3
        assert instructions.drive(url, {"content-type": "application/json"}, 2) == 0  # back to back: never late


def test_instructions_refuses_an_unknown_rung():
    from bench import instructions

    with pytest.raises(SystemExit) as exc:
        instructions.main(["--rungs", "bare,turbo"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, named", [(["--pods", "0"], "--pods must be at least 1"),
                                         (["--chunks", "0"], "--chunks must be at least 1"),
                                         (["--request", "ws"], "--request: invalid choice: 'ws'"),
                                         (["--prompt-bytes", "-1"], "--prompt-bytes must be at least 0"),
                                         (["--every-ms", "-1"], "--every-ms must be at least 0")])
def test_instructions_names_a_bad_request_shape(argv, named, capsys):
    from bench import instructions

    with pytest.raises(SystemExit) as exc:
        instructions.main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_a_bench_command_reports_a_setup_failure_as_exit_2_and_writes_its_json(tmp_path, capsys):
    def broken():
        raise harness.BenchError("valgrind is not installed")

    assert harness.report("bench.x", broken, str, tmp_path / "no.json") == 2
    assert capsys.readouterr().err.strip() == "bench.x: valgrind is not installed"
    assert not (tmp_path / "no.json").exists()
    assert harness.report("bench.x", lambda: {"n": 1}, lambda r: f"n={r['n']}", tmp_path / "r.json") == 0
    assert capsys.readouterr().out == "n=1\n" and json.loads((tmp_path / "r.json").read_text()) == {"n": 1}


def test_a_floor_worker_carries_every_module_its_router_modules_import():
    # forward.js imports body.js and errors.js; a floor that named only forward.js failed to load.
    mods = harness.with_imports(["forward.js"])
    assert {"forward.js", "body.js", "errors.js"} <= set(mods)
    for src in mods.values():
        for dep in harness.MODULE_IMPORT.findall(src):
            assert dep in mods


def test_micro_times_every_operation_inside_workerd():
    from bench import micro

    # every operation answers (a Worker error would fail the request); the figures themselves
    # are a few 10 ms clock ticks at this size, so only their presence is checked
    got = micro.run(micro.OPS, 2000, 1)
    assert set(got) == set(micro.OPS) and all(isinstance(ns, float) for ns in got.values())


def test_micro_names_an_unknown_operation(capsys):
    from bench import micro

    with pytest.raises(SystemExit) as exc:
        micro.main(["--ops", "url,nope"])
    assert exc.value.code == 2 and "--ops 'url,nope': use some of" in capsys.readouterr().err


def test_json_goes_to_stdout_for_a_dash_to_a_file_for_a_path_and_nowhere_for_none(tmp_path, capsys):
    doc = {"rows": [1, 2], "goal": "met"}
    harness.write_json("-", doc)
    assert json.loads(capsys.readouterr().out) == doc
    harness.write_json(str(tmp_path / "out.json"), doc, indent=1)
    assert json.loads((tmp_path / "out.json").read_text()) == doc and capsys.readouterr().out == ""
    harness.write_json(None, doc)
    assert capsys.readouterr().out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_stop_kills_a_pod_process_that_ignores_sigterm(monkeypatch):
    # A child that ignores SIGTERM and says so: stop() must still end it (SIGKILL after its wait).
    code = "import signal,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    monkeypatch.setattr(harness, "STOP_WAIT_S", 0.2)
    harness.stop(proc)
    assert proc.returncode == -9 and proc.stdout.closed


def test_a_bench_deadline_longer_than_the_body_timeout_raises_it_too():
    # under valgrind a slow 16 KiB upload was refused 408 at the stack's 10 s (the instruction bench's 120 s deadline)
    names = ("DEADLINE_MS", "STALL_MS", "BODY_TIMEOUT_MS")
    assert [harness.bench_plan(120_000).worker.binding(n).text for n in names] == ["120000"] * 3
    assert [harness.bench_plan(5000).worker.binding(n).text for n in names] == ["5000", "5000", "10000"]
