"""The demo's story: its arithmetic and picture from known numbers, stateTtlMs 0 as real config,
and (slow) one whole run against the sandboxed cell."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from colocate.cell import plan, settings
from colocate.errors import ConfigError
from colocate.sandbox import demo, supervisor
from colocate.sandbox.geography import Geography
from tests.test_plan import SECRETS, raw_for

MODEL = Geography()
ROOT = Path(__file__).resolve().parent.parent


def test_the_deadline_is_the_next_round_number_above_the_slowest_request_after_the_move():
    assert demo.deadline_ms([120.0, 163.2, 150.0]) == 200
    assert demo.deadline_ms([150.0]) == 150  # met exactly is met
    assert demo.deadline_ms([]) == 0
    # One request held up by a busy machine (400 ms among eight near 150) moves the deadline by a
    # step, not past phase 1's fastest (~280 ms from Tokyo).
    assert demo.deadline_ms([146.0, 147.0, 146.0, 161.0, 165.0, 160.0, 148.0, 400.0]) == 250


def test_miss_rate_counts_requests_slower_than_the_deadline():
    assert demo.miss_rate([100.0, 199.0, 200.0, 201.0], 200) == 0.25
    assert demo.miss_rate([], 200) is None


def _result(e2e, total, state, upstream, state_rtt, pod_rtt, fallback_rate=0.0, pod_rtt_new=None):
    seg = lambda p50, p90=None: {"p10": p50, "p50": p50, "p90": p90 if p90 is not None else p50, "p99": p50,  # noqa: E731
                                 "n": 3}
    return {"segments": {"e2e": seg(*e2e), "total": seg(total), "state": seg(state), "upstream": seg(upstream),
                         "state_rtt": seg(state_rtt), "pod_rtt": seg(pod_rtt), "fallback": seg(0.0),
                         "pod_rtt_new": seg(pod_rtt_new if pod_rtt_new is not None else 3 * pod_rtt)},
            "values_ms": {"e2e": [e2e[0], e2e[0], e2e[1]]}, "fallback_rate": fallback_rate, "_exit": 0}


@pytest.fixture
def story(tmp_path):
    d = demo.Demo(tmp_path, samples=3)
    numbers = [((280, 290), 108, 0, 108, 13, 12), ((145, 147), 109, 0, 108, 198, 12),
               ((343, 344), 306, 198, 108, 197, 12), ((161, 163), 123, 13, 109, 13, 13),
               ((146, 146), 109, 0, 108, 13, 13)]
    for phase, n in zip(demo.PHASES, numbers, strict=True):
        d.results[phase.label] = _result(*n, fallback_rate=0.25 if phase.label == "1-us-east" else 0.0)
        if not phase.expect_ok:  # the split: the probe finds the state object far from the Worker
            d.results[phase.label].update(_exit=1, placement={"ran": "TPE", "state": "IAD"}, violations=[
                {"kind": "placement", "part": "state", "message": "state object runs in IAD ..."},
                {"kind": "budget", "segment": "state_rtt", "budget_ms": 40.0, "message": "..."}])
    return d


def test_table_has_every_phase_p50_p90_and_rates_in_percent(story):
    text = story.table(200)
    lines = text.splitlines()
    assert all(p.title in lines[0] for p in demo.PHASES) and "p50/p90" in lines[0]
    e2e = next(line for line in lines if line.split()[0] == "e2e").split()
    assert e2e[1:] == ["280/290", "145/147", "343/344", "161/163", "146/146"]
    miss = next(line for line in lines if line.strip().startswith("miss 200 ms"))
    assert miss.split()[3:8] == ["100", "%", "0", "%", "100"]  # phase 1 misses, phase 2 with the router meets
    routed = next(line for line in lines if line.strip().startswith("router fallbk"))
    assert "25 %" in routed and "(% of requests)" in routed  # one unit for every rate
    new = next(line for line in lines if line.split()[0] == "pod_rtt_new").split()
    assert new[1:] == ["36/36", "36/36", "36/36", "39/39", "39/39"]  # a new connection's round trips, beside pod_rtt


def test_bars_stack_to_the_e2e_p50(story):
    from colocate.sandbox import demo_plot  # matplotlib: imported where used, not at collection

    for bar in story.bars():
        parts = sum(bar[name] for name, _ in demo_plot.PARTS)
        assert parts == pytest.approx(bar["e2e"])
    split_fresh = story.bars()[2]
    assert split_fresh["state wait"] == 198 and split_fresh["network (client to Worker)"] == 343 - 306


def test_the_bars_carry_state_rtt_and_the_probes_verdict(story):
    from colocate.sandbox import demo_plot

    bars = story.bars()
    split = bars[1]  # e2e like phase 3's: only state_rtt and the probe tell the split apart
    assert split["e2e"] == pytest.approx(bars[4]["e2e"], abs=1)
    assert (split["state_rtt"], bars[4]["state_rtt"]) == (198, 13)
    assert split["probe_ok"] is False and bars[4]["probe_ok"] is True
    assert split["probe_says"] == "probe FAILS:\nstate placement,\nstate_rtt over 40 ms\n(Worker TPE, state IAD)"
    assert bars[4]["probe_says"] == "probe: all checks hold"
    assert demo_plot.tick(split).splitlines()[:2] == ["2 split", "state_rtt 198 ms"]


def test_the_readmes_copy_of_the_table_has_the_demos_rows_and_columns(story):
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index("```\nsegment ") + 4:]
    shown = shown[:shown.index("```")].splitlines()
    # The deadline row names the deadline of the run the README shows (the demo picks it per run).
    deadline = int(re.search(r"^miss (\d+) ms", "\n".join(shown), re.M).group(1))
    printed = [line[4:] for line in story.table(deadline).splitlines()]
    assert shown[0] == printed[0] and shown[1] == printed[1]  # the headings, as printed
    assert [line[:14].strip() for line in shown[2:]] == [line[:14].strip() for line in printed[2:]]  # every row


def test_plot_writes_one_png(story, tmp_path):
    path = story.plot(tmp_path / "demo.png", 200)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_state_ttl_0_is_a_real_setting_bound_to_the_worker():
    p = plan.plan_cell(settings.parse(raw_for(worker={"subdomain": "acme", "stateTtlMs": 0}), "t", secrets=SECRETS))
    assert p.worker.binding("STATE_TTL_MS").text == "0"
    with pytest.raises(ConfigError, match="colocate:worker.stateTtlMs"):
        settings.parse(raw_for(worker={"subdomain": "acme", "stateTtlMs": -1}), "t", secrets=SECRETS)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_the_whole_demo_tells_the_story_from_tokyo(tmp_path, capsys):
    state_dir = tmp_path / "demo"
    try:
        code = demo.run(state_dir=state_dir, samples=4)
    finally:
        supervisor.down(state_dir, quiet=True)
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    r = {p.label: json.loads((state_dir / "probes" / f"{p.label}.json").read_text()) for p in demo.PHASES}
    p50 = {label: {k: v["p50"] for k, v in doc["segments"].items()} for label, doc in r.items()}
    tpe_iad, nrt_iad, nrt_tpe = MODEL.rtt_ms("TPE", "IAD"), MODEL.rtt_ms("NRT", "IAD"), MODEL.rtt_ms("NRT", "TPE")
    # every phase seen from NRT: the user-to-Worker network is e2e - total
    assert p50["1-us-east"]["e2e"] - p50["1-us-east"]["total"] >= nrt_iad - 5
    assert p50["3-migrated"]["e2e"] - p50["3-migrated"]["total"] < (nrt_tpe + nrt_iad) / 2  # Taipei, not Ashburn
    # split: colocate's router does not wait, but state_rtt is the Taipei-Ashburn round trip
    assert p50["2-split"]["state"] < tpe_iad / 2 and p50["2-split"]["state_rtt"] >= tpe_iad - 2  # no round trip
    # stateTtlMs 0: every request waits one such round trip
    assert p50["2-split-fresh"]["state"] >= tpe_iad - 2
    assert r["2-split"]["ok"] is False and r["2-split-fresh"]["ok"] is False
    assert r["1-us-east"]["ok"] and r["3-migrated"]["ok"] and r["3-migrated-fresh"]["ok"]
    assert p50["3-migrated-fresh"]["state"] < tpe_iad / 2  # still waits, on an object next door
    assert all(doc["pod_path"] == "local-hostname" and doc["fallback_check"]["ok"] for doc in r.values())
    # the pod hop: a pooled connection costs the request's round trip; a new one TCP's and TLS's before it
    hop = MODEL.rtt_ms("TPE", "TPE")
    assert p50["3-migrated"]["pod_rtt"] >= hop - 1
    table = out[out.index("pod_rtt_new"):].splitlines()[0].split()
    assert all(float(cell.split("/")[0]) >= 3 * hop - 1 for cell in table[1:6]), table
    # the deadline: phase 3 meets it, phase 1 misses it
    after = r["3-migrated"]["values_ms"]["e2e"] + r["3-migrated-fresh"]["values_ms"]["e2e"]
    deadline = demo.deadline_ms(after)
    assert demo.miss_rate(r["1-us-east"]["values_ms"]["e2e"], deadline) == 1.0
    assert f"miss {deadline} ms" in out and "e2e    what the user measures" in out and "total  the Worker's own" in out
    assert (state_dir / "probes" / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert str(state_dir / "probes" / "demo.png") in out
    # the probes' keys were minted and revoked; none is printed
    assert out.count("minted client key") == len(demo.PHASES) == out.count("revoked client key")
    assert "clc_" not in out
    ready = r["3-migrated"]["url"]
    assert not _listening(int(ready.rsplit(":", 1)[1]))


def test_an_unknown_client_site_exits_2_before_anything_starts(tmp_path, capsys):
    assert demo.run(state_dir=tmp_path / "demo", client_site="XYZ") == 2
    assert "--client-site: unknown Cloudflare colo 'XYZ'" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_the_phase_1_sentence_stays_true_wherever_the_user_sits():
    assert demo.phase1([279.0, 290.0], 200, "NRT").startswith("phase 1's fastest request took 279 ms")
    assert "missed it for 50 %" in demo.phase1([150.0, 290.0], 200, "SJC")
    assert "missed it for 0 %" in demo.phase1([120.0], 200, "IAD")


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{proc.name}: {cmd}")
    return found


@pytest.mark.slow
def test_sigterm_mid_probe_stops_everything_and_revokes_the_probe_key(tmp_path):
    state_dir = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "sandbox.py"), "demo", "--state-dir",
                             str(state_dir), "--samples", "40"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    guard = threading.Timer(120, proc.kill)  # the read below is bounded even if the demo hangs
    guard.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if "5/40 samples" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        supervisor.down(state_dir, quiet=True)
    text = "".join(seen) + out
    assert proc.returncode == 130, text[-2000:]
    assert "revoked client key" in text and "clc_" not in text
    assert supervisor.status(state_dir)["running"] is False
    assert _processes_mentioning(str(state_dir)) == []
    ready = json.loads((state_dir / "ready.json").read_text()) if (state_dir / "ready.json").exists() else {}
    for port in (ready.get("ports") or {}).values():
        assert not _listening(port)
