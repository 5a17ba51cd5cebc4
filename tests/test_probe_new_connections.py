"""pod_rtt_new: the pod hop on a new connection, counted only where its hop accepted one; pod_rtt stays
the pooled connection's, and a pod_rtt budget judges that one. Pure: hand-made runs, no cell."""

from __future__ import annotations

import socket

import pytest

from colocate.probe import budgets, connections, report, timing
from colocate.probe.errors import Unreachable
from colocate.probe.sample import Run, Sample

POD0, POD1 = "localhost:41001", "localhost:41002"


def _probe(rtt0, rtt1, ok0=True, new_ports=()):
    body = {"state_rtt_ms": 3.0, "pod_rtt_ms": rtt0, "pod_ok": ok0, "pod_status": 200 if ok0 else None,
            "pod_host": POD0, "worker_colo": "IAD", "state_colo": "IAD", "region": "us-east",
            "pods": [{"index": 0, "host": POD0, "rtt_ms": rtt0, "ok": ok0, "status": 200 if ok0 else None},
                     {"index": 1, "host": POD1, "rtt_ms": rtt1, "ok": True, "status": 200}]}
    return Sample("probe", 20.0, 200, None, timing.Timing(), body=body, new_ports=frozenset(new_ports))


def _run(probe_new):
    warm = [_probe(12.0, 13.0), _probe(11.0, 12.0), _probe(14.0, 15.0)]
    return Run("http://cell", "m", warm[0], probe=warm, probe_new=probe_new)


def _build(run, budget_list=()):
    from colocate.cell import catalogue

    return report.build(run, catalogue.region("us-east"), ["local", "local"], list(budget_list))


def test_only_checks_whose_hop_accepted_a_connection_count_as_new():
    new = [_probe(36.0, 37.0, new_ports={"41001", "41002"}),
           _probe(38.0, 13.0, new_ports={"41001"}),  # pod 1's connection was not shown new: not its number
           _probe(35.0, 36.0, ok0=False, new_ports={"41001", "41002"}),  # pod 0's check failed
           _probe(12.0, 12.0)]  # no hop accepted anything: nothing is called new
    r = _build(_run(new))
    assert r.values["pod_rtt_new"] == [36.0, 38.0] and r.values["pod_rtt"] == [12.0, 11.0, 14.0]
    assert r.segments["pod_rtt_new"]["n"] == 2 and r.segments["pod_rtt"]["p50"] == 12.0
    pod0, pod1 = r.pods
    assert pod0["pod_rtt_new"]["n"] == 2 and pod1["pod_rtt_new"]["n"] == 2 and pod1["pod_rtt_new"]["p50"] == 36.5
    assert pod0["checks"] == 3 and pod0["healthy"] == 3  # the new-connection probes are not health checks
    doc = report.to_json(r)
    assert doc["new_connections"]["measured"] is True
    assert (doc["new_connections"]["probes"], doc["new_connections"]["shown_new"]) == (4, 2)
    assert any(n.startswith("2 of 4 new-connection probes were not shown") for n in doc["notes"])
    text = report.table(r)
    assert "+ 4 probes on new pod connections" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("pod 0"))
    assert "pod_rtt p50 12.0 ms" in line and "new p50 37.0 ms, p90 37.8 ms" in line


def test_without_a_sandbox_nothing_is_called_new_and_the_report_says_why():
    r = _build(_run(None))
    assert r.values["pod_rtt_new"] == [] and r.segments["pod_rtt_new"]["p50"] is None
    assert r.pods[0]["pod_rtt_new"]["n"] == 0
    doc = report.to_json(r)
    assert doc["new_connections"] == {"measured": False, "why": connections.NOT_MEASURED}
    text = report.table(r)
    assert "new p50 n/a ms" in text and f"new: not measured: {connections.NOT_MEASURED}" in text
    assert "pod_rtt_new" in text.split("fallback rate")[0]  # its row, n/a, in the segments table
    assert not any("new-connection" in n for n in r.notes)


def test_a_pod_rtt_budget_judges_the_pooled_connection_and_pod_rtt_new_has_its_own():
    new = [_probe(36.0, 37.0, new_ports={"41001", "41002"}), _probe(40.0, 37.0, new_ports={"41001", "41002"})]
    r = _build(_run(new), [budgets.Budget("pod_rtt", 20), budgets.Budget("pod_rtt_new", 30)])
    broken = [(v["segment"], v["measured_ms"]) for v in r.violations if v["kind"] == "budget"]
    assert broken == [("pod_rtt_new", 38.0)]
    assert budgets.parse_flag("pod_rtt_new=50@p90") == budgets.Budget("pod_rtt_new", 50.0, "p90")


def test_the_floor_of_a_new_connection_is_three_round_trips():
    from colocate.cell import catalogue
    from colocate.probe import placement

    p = placement.observe([{"worker_colo": "NRT", "state_colo": "NRT"}], [], catalogue.region("apac-jp"), "US-GA-1")
    floors = p.floors()
    assert floors["pod_rtt"] > 50 and floors["pod_rtt_new"] == 3 * floors["pod_rtt"]


def test_opened_names_the_hops_whose_count_rose():
    assert connections.opened({"1": 3, "2": 5}, {"1": 4, "2": 5, "3": 1}) == {"1", "3"}
    assert connections.opened({"1": 3}, {"1": 3}) == frozenset()
    assert connections.port_of("localhost:41001") == "41001"
    assert connections.port_of("pod-g1.example.com") is None and connections.port_of(None) is None


def test_a_sandbox_control_that_does_not_answer_ends_the_run_with_the_fix():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Unreachable) as e:
        connections.HopControl(f"http://127.0.0.1:{port}", 2.0).cut()
    assert f"http://127.0.0.1:{port}/_sandbox/pod-hop/cut failed" in str(e.value)
    assert "scripts/sandbox.py status" in str(e.value)


def test_a_read_only_answer_without_hosts_counts_only_when_every_hop_took_a_new_connection():
    def hostless(new_ports, hop_ports=("41001", "41002")):
        s = _probe(36.0, 37.0, new_ports=new_ports)
        for e in s.body["pods"]:
            del e["host"]
        s.hop_ports = frozenset(hop_ports)
        return s

    every = hostless({"41001", "41002"})
    assert [report.new_rtt(every, e) for e in report.pod_entries(every)] == [36.0, 37.0]
    one = hostless({"41001"})
    assert [report.new_rtt(one, e) for e in report.pod_entries(one)] == [None, None]
