"""colocate.workerd: configs rendered from the plan, and the workerd process lifecycle."""

import os
import socket

import pytest

from colocate import workerd
from colocate.cell.plan import worker_modules
from tests.support.workerd import SECRETS, auth, cell_plan, outbound, request, values_for

pytestmark = pytest.mark.slow  # real workerd processes


def values():
    return values_for("http://127.0.0.1:9", "https://api.example.com")


def test_config_holds_the_plan_modules_bindings_and_namespace():
    plan = cell_plan()
    text = workerd.render_config(plan.worker, values(), port=8123)
    assert f'compatibilityDate = "{plan.worker.compatibility_date}"' in text
    for m in worker_modules():
        assert f'(name = "{m.name}", esModule = ' in text
    assert text.index('"index.js"') < text.index('"admin.js"')  # main module first
    for b in plan.worker.bindings:
        assert f'(name = "{b.name}"' in text
    assert 'durableObjectNamespace = "Breaker"' in text and "enableSql = true" in text
    assert "(inMemory = void)" in text and '"127.0.0.1:8123"' in text
    assert f'(name = "POD_TOKEN", text = "{SECRETS["POD_TOKEN"]}")' in text


@pytest.mark.parametrize("missing", ["POD_TOKEN", "POD_URLS"])
def test_missing_value_names_the_binding(missing):
    vals = {k: v for k, v in values().items() if k != missing}
    with pytest.raises(workerd.BindingValueMissing, match=missing) as exc:
        workerd.render_config(cell_plan().worker, vals, port=1)
    assert exc.value.binding == missing
    assert all(v not in str(exc.value) for v in SECRETS.values())


def test_values_by_settings_key_and_output_name():
    plan = cell_plan()
    by_source = {"pod.urls": '["http://127.0.0.1:9"]', "podToken": "a", "fallbackUrl": "https://x", "fallbackApiKey": "b",
                 "probeToken": "c"}
    assert workerd.resolve_bindings(plan.worker, by_source)["POD_URLS"] == '["http://127.0.0.1:9"]'


def test_capnp_text_escapes():
    assert workerd.capnp_text('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert workerd.capnp_text("\u2500") == '"\\xe2\\x94\\x80"'


def test_storage_dir_uses_local_disk(tmp_path):
    text = workerd.render_config(cell_plan().worker, values(), port=1, storage_dir=tmp_path / "s")
    assert "localDisk" in text and str((tmp_path / "s").resolve()) in text


def test_missing_binary_says_make_setup(tmp_path):
    with pytest.raises(workerd.WorkerdNotInstalled, match="make setup"):
        workerd.workerd_binary(tmp_path)


def test_bad_config_fails_with_the_log_and_leaves_nothing(tmp_path):
    with workerd.Workerd(tmp_path) as w:
        with pytest.raises(workerd.WorkerdStartFailed):
            w.start("this is not capnp")
        assert w.proc is None


def test_stop_kills_the_process_and_frees_the_port(tmp_path):
    plan = cell_plan()
    w = workerd.Workerd(tmp_path)
    with w:
        w.start(workerd.render_config(plan.worker, values(), port=w.port))
        pid = w.proc.pid
        assert request(w.url, "GET", "/nope").status == 404
        assert (os.stat(w.config_path).st_mode & 0o777) == 0o600  # it holds secrets
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", w.port), timeout=1).close()


def test_global_outbound_shape(tmp_path):
    """How workerd delivers the Worker's subrequests to an external HTTP service: plain
    HTTP, host style (path in the request line, original host in Host), with the
    injected headers; from the Worker and from inside the Durable Object."""
    plan = cell_plan()
    with outbound(colo="TST") as world, workerd.Workerd(tmp_path) as w:
        cfg = workerd.render_config(plan.worker, values_for("http://pod.example:8000", "https://api.example.com"),
                                    port=w.port, global_outbound=("127.0.0.1", world.port),
                                    inject_headers={"x-sandbox-hop": "edge"}, storage_dir=tmp_path / "do")
        w.start(cfg)
        res = request(w.url, "GET", "/_colocate/probe", headers=auth())
        assert res.status == 200, res.body
        body = res.json()
        assert body["worker_colo"] == "TST" and body["state_colo"] == "TST"
        assert body["pod_ok"] is True and body["pod_host"] == "pod.example:8000"
        traces = [s for s in world.seen if s["path"] == "/cdn-cgi/trace"]
        # one from the Worker; from inside the object its colo() and the view's colo, learnt once
        assert 2 <= len(traces) <= 3
        assert {t["headers"]["host"] for t in traces} == {"www.cloudflare.com"}
        assert all(t["headers"]["x-sandbox-hop"] == "edge" for t in traces)
        health = [s for s in world.seen if s["path"] == "/health"]
        assert health and health[0]["headers"]["host"] == "pod.example:8000"


def test_the_pods_only_probe_checks_the_pods_and_leaves_state_alone(tmp_path):
    """``?only=pods`` (the probe's new-connection samples): the pods' health checks and
    nothing of state, so a split cell's samples do not wait on its far object."""
    plan = cell_plan()
    with outbound(colo="TST") as world, workerd.Workerd(tmp_path) as w:
        w.start(workerd.render_config(plan.worker, values_for("http://pod.example:8000", "https://api.example.com"),
                                      port=w.port, global_outbound=("127.0.0.1", world.port),
                                      storage_dir=tmp_path / "do"))
        res = request(w.url, "GET", "/_colocate/probe?only=pods", headers=auth())
        assert res.status == 200, res.body
        body = res.json()
        assert [(p["index"], p["host"], p["ok"]) for p in body["pods"]] == [(0, "pod.example:8000", True)]
        assert "state_rtt_ms" not in body and "breaker" not in body
        timing = res.headers["server-timing"]
        assert "pod_rtt" in timing and "state_rtt" not in timing
        assert [s["path"] for s in world.seen] == ["/health"]  # no trace from the object: it was not asked
        assert request(w.url, "GET", "/_colocate/probe?only=pods", headers={}).status == 401
        bad = request(w.url, "GET", "/_colocate/probe?only=state", headers=auth())
        assert bad.status == 400
        assert bad.json()["error"]["message"] == 'query "only" must be "pods" (got "state")'


def test_serve_shortcut_and_cleanup_on_exception():
    plan = cell_plan()
    with pytest.raises(RuntimeError, match="boom"), workerd.Workerd.serve(plan.worker, values()) as w:
        pid, port = w.proc.pid, w.port
        assert request(w.url, "GET", "/v1/nope").status == 404
        raise RuntimeError("boom")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_composed_config_with_a_wrapper_entry_and_a_separate_object_service(tmp_path):
    """The sandbox's shape: a wrapper main module importing the product's index.js, and
    the Breaker hosted by another worker service with its own outbound."""
    plan = cell_plan()
    vals = values()
    wrapper = ('import product from "./index.js";\nexport { Breaker } from "./index.js";\n'
               'export default { async fetch(req, env, ctx) { const res = await product.fetch(req, env, ctx);'
               ' const out = new Response(res.body, res); out.headers.set("x-wrapped", "1"); return out; } };\n')
    with workerd.Workerd(tmp_path) as w:
        edge = workerd.worker_capnp(plan.worker, vals, do_service="state-far", host_objects=False,
                                    extra_modules=[("sandbox_entry.js", wrapper)], main_module="sandbox_entry.js")
        far = workerd.worker_capnp(plan.worker, vals, namespace_key="sandbox-far-Breaker",
                                   storage_service=workerd.STORAGE_SERVICE)
        cfg = workerd.config_capnp(
            [workerd.worker_service("edge", edge), workerd.worker_service("state-far", far), workerd.network_service(),
             workerd.disk_service(workerd.STORAGE_SERVICE, tmp_path / "do")],
            [workerd.socket_capnp(workerd.SOCKET_NAME, w.port, "edge")])
        w.start(cfg)
        res = request(w.url, "PUT", "/_colocate/breaker", body={"force": "open"}, headers=auth())
        assert res.status == 200 and res.headers["x-wrapped"] == "1"
        assert res.json()["breaker"]["forced"] == "open"
    assert any(p.name.startswith("sandbox-far-Breaker") for p in (tmp_path / "do").iterdir())


def test_v8_flags_go_into_the_config_workerd_runs(tmp_path):
    plan = cell_plan()
    with workerd.Workerd(tmp_path, v8_flags=["--no-concurrent-sparkplug"]) as w:
        w.start(workerd.render_config(plan.worker, values(), port=w.port))
        assert request(w.url, "GET", "/nope").status == 404
        text = w.config_path.read_text()
        assert text.count('v8Flags = ["--no-concurrent-sparkplug"],') == 1
        assert text.index("v8Flags") < text.index("services = [")


def test_v8_flags_refuse_a_config_they_cannot_place():
    with pytest.raises(workerd.WorkerdError, match="v8 flags .* config_capnp"):
        workerd.with_v8_flags("using Workerd = import \"/workerd/workerd.capnp\";\n", ["--x"])
