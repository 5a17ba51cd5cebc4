"""bench/prefix.py: the multi-turn workload, the driver against a real stand-in, and the summary."""

from __future__ import annotations

import copy
import json
import statistics
import threading

import pytest

from bench import prefix
from colocate.pods import standin


def test_the_workload_is_seeded_poisson_conversations_over_apps_with_long_system_prompts():
    w = prefix.workload(seed=1, seconds=600, rate_per_s=0.5)
    assert w == prefix.workload(seed=1, seconds=600, rate_per_s=0.5)  # the same seed, the same work
    assert w != prefix.workload(seed=2, seconds=600, rate_per_s=0.5)
    assert len(w.apps) == 3
    for app in w.apps:
        assert 1000 <= app.system_tokens <= 3000
        assert len(app.system.split()) >= app.system_tokens  # one word a token, plus the preamble
    n = len(w.conversations)
    assert 240 <= n <= 360  # Poisson: 300 expected, 3.5 standard deviations either side
    gaps = [b.at_s - a.at_s for a, b in zip(w.conversations, w.conversations[1:], strict=False)]
    assert 1.6 <= statistics.fmean(gaps) <= 2.4  # exponential gaps of mean 2 s
    assert all(2 <= len(c.questions) <= 8 and len(c.think_s) == len(c.questions) - 1 for c in w.conversations)
    assert {c.app for c in w.conversations} == {0, 1, 2}
    assert 4.5 <= w.mean_turns() <= 5.5
    # a turn past the system prompt carries the questions and answers before it
    assert w.mean_uncached_tokens(75) > 75 + w.answer_tokens


def test_vllm_prefix_counters_are_read_from_metrics_text():
    text = ("# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1536.0\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2048.0\n'
            'vllm:num_requests_running{model_name="m"} 3.0\n')
    assert prefix.prefix_counters(text) == {"hits": 1536.0, "queries": 2048.0}
    assert prefix.prefix_counters("vllm:prefix_cache_hits 1\nvllm:prefix_cache_queries 4\n") == {"hits": 1.0, "queries": 4.0}
    assert prefix.prefix_counters("vllm:num_requests_running 1\n") is None


def test_the_summary_counts_turns_per_pod_the_same_pod_share_and_goals():
    T = prefix.Turn
    turns = [T(0, 0, 1, 200, 100, 900, 10, "pod-0"), T(0, 1, 5, 200, 50, 800, 10, "pod-0"),
             T(1, 0, 2, 200, 120, 950, 10, "pod-1"), T(1, 1, 6, 200, 300, 999, 10, "pod-0"),
             T(2, 0, 3, None, None, None, 0, None, "ConnectionError"), T(3, 0, 99, 200, 1, 1, 1, "pod-1")]
    s = prefix.summarise("prefix", 0.8, 1.0, turns, (0, 10), 2, [{"hits": 30, "queries": 40}, None])
    assert (s.turns, s.failed) == (5, 1)  # the turn at 99 s is outside the window
    assert [p["turns"] for p in s.pods] == [3, 1] and s.max_over_mean == 1.5
    assert [p["prefix_cache_hit_rate"] for p in s.pods] == [0.75, None]
    assert s.same_pod == 0.5  # conversation 0 stayed, conversation 1 moved
    assert s.ttft_p50_ms == 110.0 and s.turns_per_s == 0.4
    other = prefix.summarise("least_busy", 0.8, 1.0, [T(0, 0, 1, 200, 400, 900, 10, "pod-0")], (0, 10), 2)
    lines = prefix.goals([s, other], 0.8)
    assert lines[0].startswith("TTFT p50: prefix 110.0 vs least_busy 400.0 = 0.28x") and lines[0].endswith("ok")
    assert any(line.startswith("most-loaded pod: 1.5x") and line.endswith("MISSED") for line in lines)
    assert "prefix" in prefix.table([s, other]) and "75%" in prefix.table([s, other])


def test_the_driver_streams_every_turn_with_the_history_growing():
    seen: list[dict] = []
    lock = threading.Lock()
    with standin.serve(compute_ms=5) as pod:
        load = prefix.workload(seed=3, seconds=2, rate_per_s=2, think_s=0.05, answer_tokens=8)
        assert load.conversations
        session_post = prefix.requests.Session.post

        def recording_post(self, url, json=None, **kw):  # noqa: A002 - requests' own name
            with lock:
                seen.append(copy.deepcopy(json))  # the driver appends to its history after sending
            return session_post(self, url, json=json, **kw)

        prefix.requests.Session.post = recording_post
        try:
            turns, _ = prefix.drive(pod.url, ["k"], load, timeout_s=30)
        finally:
            prefix.requests.Session.post = session_post
    assert len(turns) == sum(len(c.questions) for c in load.conversations)
    assert all(t.status == 200 and t.ttft_ms is not None and t.ttft_ms <= t.e2e_ms and t.tokens > 0 for t in turns)
    by_conv: dict[str, list[int]] = {}
    for body in seen:
        assert body["stream"] is True and body["messages"][0]["role"] == "system"
        by_conv.setdefault(body["messages"][1]["content"], []).append(len(body["messages"]))
    for lengths in by_conv.values():
        assert sorted(lengths) == [2 + 2 * k for k in range(len(lengths))]  # system, then q/a pairs and the new question
    assert json.dumps(turns[0].__dict__)


def test_the_summary_counts_same_pod_across_isolates_and_the_shed_share():
    T = prefix.Turn
    turns = [T(0, 0, 1, 200, 1, 1, 1, "pod-0", isolate=0), T(0, 1, 2, 200, 1, 1, 1, "pod-0", isolate=1),
             T(0, 2, 3, 200, 1, 1, 1, "pod-0", isolate=1), T(1, 0, 1, 200, 1, 1, 1, "pod-1", isolate=2),
             T(1, 1, 2, 200, 1, 1, 1, "pod-2", isolate=3)]
    s = prefix.summarise("prefix", 0.8, 1.0, turns, (0, 10), 4, shed={"affinity": 9, "load": 1})
    assert s.same_pod == round(2 / 3, 3)  # 0.1 and 0.2 stayed, 1.1 moved
    assert (s.across_turns, s.same_pod_across) == (2, 0.5)  # 0.1 and 1.1 changed isolate; one of them stayed
    assert s.shed == 0.1
    assert prefix.summarise("random", 0.8, 1.0, turns[:1], (0, 10), 4).same_pod_across is None
    text = ('colocate_balance_picks_total{backend="pod-0",by="affinity"} 7\n'
            'colocate_balance_picks_total{backend="pod-1",by="affinity"} 2\n'
            'colocate_balance_picks_total{backend="pod-1",by="load"} 1\n'
            'colocate_requests_total{backend="pod-1"} 10\n')
    assert prefix.picks(text) == {"affinity": 9.0, "load": 1.0}


CONFIG = '''# Generated
using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = [
    (name = "edge", worker = (
  modules = [
    (name = "index.js", esModule = "export default { fetch() { return new Response(\\"(\\\\\\" ))\\") } };")
  ],
  bindings = [(name = "X", durableObjectNamespace = (className = "B", serviceName = "state-IAD"))]
)),
    (name = "state-IAD", worker = (modules = [], durableObjectStorage = (localDisk = "disk-IAD"))),
    (name = "disk-IAD", disk = (path = "/s/objects/IAD", writable = true))
  ],
  sockets = [
    (name = "http", address = "127.0.0.1:0", http = (), service = "edge")
  ]
);
'''


def test_the_isolates_config_defines_the_edge_worker_once_per_isolate_with_a_socket_each():
    from pathlib import Path

    text, names = prefix.isolates_config(CONFIG, 3, Path("/s/objects"), Path("/t/objects"))
    assert names == ["http-0", "http-1", "http-2"]
    edge = CONFIG[CONFIG.index('(name = "edge"'):CONFIG.index(',\n    (name = "state-IAD"')]
    assert text.count(edge) == 1  # byte for byte, its string's parentheses and escapes included
    for k in (1, 2):
        assert text.count(edge.replace('"edge"', f'"edge-{k}"', 1)) == 1
    assert text.count("esModule") == 3 and text.count('(name = "state-IAD"') == 1  # one object host for all
    assert '"/t/objects/IAD"' in text and "/s/objects" not in text
    for k, n in enumerate(names):
        assert f'(name = "{n}", address = "127.0.0.1:0", http = (), service = "{"edge" if k == 0 else f"edge-{k}"}")' in text
    assert '(name = "http",' not in text and text.endswith("  ]\n);\n")
    for bad in (CONFIG.replace('(name = "edge"', '(name = "front"'), CONFIG + CONFIG):
        try:
            prefix.isolates_config(bad, 2, Path("/s/objects"), Path("/t/objects"))
        except ValueError:
            continue
        raise AssertionError("a config without exactly one edge service was accepted")


@pytest.fixture(scope="module")
def shipped_cell():
    """One sandbox cell of 4 pods on the shipped stack file and the settings' defaults, for the two
    tests below: each reads only its own run's counters (after less before), and the isolates' test
    routes through an object host of its own, so neither sees the other's keys, picks or turns."""
    with prefix.fresh_cell(None, 4, {}, None) as cell:
        yield cell


@pytest.mark.slow
def test_affinity_holds_across_four_workerd_isolates_while_pods_are_under_their_bound(shipped_cell):
    """Turns after the first land on their conversation's previous pod, whichever of 4 isolates
    routes them. A few conversations at once (7, one request each at most, over 4 pods), so a pod
    reaches the bound's floor (affinity.js MIN_CAP = 4) only when 4 of them are in flight on it."""
    from colocate.cell import settings
    from colocate.pods import profiles

    # The shipped cell balances by prefix and its pods are the default profile: what this test is about.
    assert settings.WORKER_DEFAULTS["balance"] == "prefix" and "balance" not in (_shipped_worker() or {})
    assert _shipped_pod()["profile"] == profiles.DEFAULT_PROFILE
    load = prefix.workload(seed=7, seconds=8, rate_per_s=0.75, turns=(6, 6), answer_tokens=16, think_s=0.3,
                           system_tokens=(200, 400))
    assert 3 <= len(load.conversations) <= 12
    turns, hits, shed, pod_ttft = prefix.run_on(shipped_cell, 4, load, 60, isolates=4, seed=7)
    s = prefix.summarise("prefix", None, 0.0, turns, (0, 60), 4, hits, shed, pod_ttft, profiles.DEFAULT_PROFILE)
    assert s.failed == 0 and s.turns == 6 * len(load.conversations)
    assert {t.isolate for t in turns} == {0, 1, 2, 3}  # every isolate routed turns
    assert len({t.backend for t in turns}) >= 2  # the conversations spread over the pods
    assert s.across_turns >= 10  # turns another isolate routed than the previous turn's
    # Under its bound a turn stays on its pod; a turn the bound shed (rare here: it takes 4 of these
    # conversations in flight on one pod) moves, and so does the turn after it, back to its own pod.
    later = sum(1 for t in turns if t.turn > 0)
    assert shed is not None and shed["load"] <= 3, shed
    assert (1 - s.same_pod) * later - 2 * shed["load"] <= 0.1 * later, s
    assert (1 - s.same_pod_across) * s.across_turns - 2 * shed["load"] <= 0.1 * s.across_turns, s
    served = {int(t.backend[4:]) for t in turns}
    assert all(hits[i] is not None and hits[i]["queries"] > 0 for i in served)  # the pods' own counters were read
    # the pods' own first-token time is part of the client's (the hops and the router are the rest)
    assert s.pod_ttft_mean_ms is not None and 0 < s.pod_ttft_mean_ms < s.ttft_mean_ms


@pytest.mark.slow
def test_on_the_shipped_settings_nine_in_ten_later_turns_land_on_their_previous_turns_pod(shipped_cell):
    """A sandbox cell of 4 pods on the shipped stack file and the settings' defaults (nothing about
    balancing set), 24 multi-turn conversations: at least 90 % of the turns after a conversation's
    first are served by the pod that served its turn before, where its prefix is cached. (With
    `balance: load`, 27 % of them in a run here.)"""
    from colocate.cell import settings

    assert "balance" not in (_shipped_worker() or {})  # the default decides
    whole = prefix.workload(seed=11, seconds=60, rate_per_s=3, turns=(4, 6), answer_tokens=16, think_s=0.3,
                            system_tokens=(200, 400))
    load = prefix.Workload(whole.apps, whole.conversations[:24], whole.answer_tokens)
    assert len(load.conversations) == 24
    turns, _hits, shed, _ = prefix.run_on(shipped_cell, 4, load, 60)
    s = prefix.summarise(settings.WORKER_DEFAULTS["balance"], None, 0.0, turns, (0, 60), 4, shed=shed)
    later = sum(1 for t in turns if t.turn > 0)
    assert s.failed == 0 and later >= 24 * 3, s
    assert len({t.backend for t in turns}) >= 3, "the conversations spread over the pods"
    assert s.same_pod is not None and s.same_pod >= 0.9, s


def _shipped_worker() -> dict | None:
    from colocate import stackfile

    raw, _ = stackfile.read_config("sandbox")
    return raw.get("worker")


def _shipped_pod() -> dict:
    from colocate import stackfile

    raw, _ = stackfile.read_config("sandbox")
    return raw.get("pod") or {}


def test_the_ttft_breakdown_takes_the_pods_own_ttft_and_the_modelled_api_queue_from_the_clients():
    from colocate.pods import engine, profiles

    prof = profiles.get(profiles.DEFAULT_PROFILE)
    rho = 590 * prof.frontend_ms_per_token / 1000
    assert prefix.api_queue_ms(prof.name, 590) == round(prof.server.request_ms + engine.queue_ms(prof, rho), 1)
    assert prefix.api_queue_ms(prof.name, 0) == prof.server.request_ms  # the API server's own time, no queue
    assert prefix.api_queue_ms("oracle", 590) is None
    T = prefix.Turn
    turns = [T(0, 0, 1, 200, 100, 900, 100, "pod-0"), T(1, 0, 2, 200, 140, 900, 100, "pod-1")]
    pods = [{"sum": 0.08, "count": 1}, {"sum": 0.1, "count": 1}, None, {"sum": 0.0, "count": 0}]
    s = prefix.summarise("prefix", 0.8, 1.0, turns, (0, 10), 4, pod_ttft=pods, profile=prof.name)
    assert (s.ttft_mean_ms, s.pod_ttft_mean_ms) == (120.0, 90.0)  # pods without turns count for nothing
    assert s.api_queue_ms == prefix.api_queue_ms(prof.name, 20 / 4)
    row = prefix.breakdown([s]).splitlines()[1].split()
    assert row[:5] == ["prefix", "80%", "120", "30", "90"]
    assert float(row[6]) == round(90 - s.api_queue_ms)
    assert prefix.breakdown([prefix.summarise("random", 0.8, 1.0, turns, (0, 10), 4)]).count("\n") == 0  # no pod figures


def test_a_bound_goes_with_the_prefix_policy_only(capsys):
    for bad in ("random@2", "prefix@1", "prefix@x"):
        assert prefix.main(["--policies", bad, "--capacity", "1"]) == 2
        assert "prefix@2" in capsys.readouterr().err
