"""The runner: the process ``up`` starts (``python -m colocate.sandbox.supervisor run STATE_DIR``),
in its own session and process group. It owns every part of the cell until ``down``:

    pod        scripts/pod.py create --spec -  (provider local: a detached stand-in)
    fallback   a stand-in "external API" (child process)
    network    front proxy + outbound proxy + pin control (threads of the runner)
    workerd    the product Worker behind the sandbox entry (child process)

SIGHUP (``sandbox.py apply``) makes it re-plan from the stack file and replace the pods that
changed one at a time (``Runner.apply``); SIGTERM makes it stop its children and delete the pods.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ..cell.plan import POD_URLS_FROM_OUTPUT, CellPlan, pod_urls_text
from ..cell.rollout import ADD, REMOVE, REPLACE, rollout
from . import config as config_mod, hopcerts
from .demokey import demo_key
from .errors import StartupFailed
from .geography import Geography, Sites
from .launch import Launch, build_plan, object_sites, sites_for
from .pinning import Pins
from .pods import create_pod, create_pods, delete_pod, delete_recorded_pods, pod_control, pod_pid, record_pods, recorded_pods
from .processes import CHILD_TIMEOUT_S, http_ok, stop_child
from .proxies import Network, NetworkServers, PodHop, local_url
from .statedir import (
    APPLY_FAILED_FILE,
    EDGE_HOLDS_FILE,
    FAILED_FILE,
    LAUNCH_FILE,
    LOGS_DIR,
    OBJECTS_DIR,
    PINS_FILE,
    PURGED_FILE,
    READY_FILE,
    ROOT,
    RUN_FILE,
    WORKERD_CONFIG_FILE,
    load_secrets,
    log_line,
    log_path,
    read_json,
    write_json,
)

WORKERD = ROOT / "node_modules" / ".bin" / "workerd"
FALLBACK_COMPUTE_MS = 95
FALLBACK_MODEL = "sandbox/fallback"
# Longer than the Worker's usage flush interval (worker/src/state.js FLUSH_MAX_MS = 1 s).
WAIT_UNTIL_GRACE_S = 1.2


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


class Runner:
    """Owns every part of one running sandbox. Lives in its own process group."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.logs = self.state_dir / LOGS_DIR
        self.stop = threading.Event()
        self.children: dict[str, subprocess.Popen] = {}
        self.servers: NetworkServers | None = None
        self.network: Network | None = None
        self.reload = threading.Event()  # SIGHUP: `sandbox.py apply` asks for a deploy
        self.revision = 0
        self.fallback_url = ""
        self.key: dict = {}
        self.hops: dict[str, PodHop] = {}  # pod id -> the relay the Worker reaches it through

    def _spawn(self, name: str, argv: list[str], env: dict | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        log = open(log_path(self.state_dir, name), "ab")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=ROOT,
                                pass_fds=pass_fds)
        log.close()
        self.children[name] = proc
        return proc

    def _start_fallback(self, api_key: str) -> str:
        port_file = self.state_dir / "fallback.port"
        port_file.unlink(missing_ok=True)
        env = {**os.environ, "POD_TOKEN": api_key,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = self._spawn("fallback", [sys.executable, "-m", "colocate.pods.standin", "--host", "127.0.0.1", "--port", "0",
                                        "--compute-ms", str(FALLBACK_COMPUTE_MS), "--model", FALLBACK_MODEL,
                                        "--any-model", "--name", "fallback", "--port-file", str(port_file)], env=env)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            info = read_json(port_file)
            if info and info.get("url"):
                return info["url"]
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise StartupFailed(f"the fallback stand-in did not start; see {log_path(self.state_dir, 'fallback')}")

    def _start_workerd(self, config_path: Path) -> int:
        if not WORKERD.exists():
            raise StartupFailed(f"{WORKERD} is missing. Fix: run `make setup` (npm ci installs workerd)")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        try:
            # workerd listens on the socket we bound (port 0, real port known up front).
            self._spawn("workerd", [str(WORKERD), "serve", str(config_path), "-S",
                                    f"{config_mod.SOCKET_NAME}={sock.fileno()}"], pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            ok, code = http_ok(f"http://127.0.0.1:{port}/_colocate/probe", timeout=5)
            if code is not None:
                return port
            if self.children["workerd"].poll() is not None:
                break
            time.sleep(0.1)
        raise StartupFailed(f"workerd did not answer; see {log_path(self.state_dir, 'workerd')}")

    def start(self) -> dict:
        launch = Launch.from_json(read_json(self.state_dir / LAUNCH_FILE) or {})
        plan, _ = build_plan(launch)
        geography = Geography.from_args(launch.stretch, launch.rtt)
        secrets = load_secrets(self.state_dir)
        pins = Pins(self.state_dir / PINS_FILE)

        pods = create_pods(self.state_dir, plan, secrets["podToken"])
        sites = sites_for(plan, launch, pods[0].get("location", "local") if pods else "local")
        fallback_url = local_url(self._start_fallback(secrets["fallbackApiKey"]))
        network = Network(geography, sites, pins, targets={_hostport(fallback_url): sites.fallback})
        self.network = network
        for p in pods:
            self._hop(plan, launch, p)
        network.targets.update(self._pod_targets(plan, launch, sites, pods))
        self.fallback_url = fallback_url
        self.servers = NetworkServers(network)
        wport, state_sites = self._launch_workerd(plan, sites, pods)
        network.resume(("127.0.0.1", wport))
        self.key = demo_key(self.state_dir, f"http://127.0.0.1:{self.servers.front.port}", secrets["adminToken"])
        return self._ready(plan, launch, pods, sites, state_sites, wport)

    @staticmethod
    def _pod_targets(plan: CellPlan, launch: Launch, sites: Sites, pods: list[dict]) -> dict[str, str]:
        """The outbound proxy's routes to the pods reached over plain HTTP: by the hostname the
        Worker uses, each at its site (a mutual-TLS pod is reached through its PodHop instead)."""
        return {_hostport(p["worker_url"]): sites_for(plan, launch, p.get("location", "local")).pod for p in pods
                if not p["worker_url"].startswith("https://")}

    def _hop(self, plan: CellPlan, launch: Launch, pod: dict) -> None:
        """Put a mutual-TLS pod behind its PodHop: the Worker's URL for it becomes the relay's."""
        if not pod["worker_url"].startswith("https://"):
            return
        site = sites_for(plan, launch, pod.get("location", "local")).pod
        hop = PodHop(self.network, site, (pod.get("ip") or "127.0.0.1", int(pod["port"])))
        self.hops[pod["id"]] = hop
        pod["worker_url"] = f"https://localhost:{hop.port}"

    def _unhop(self, pod: dict) -> None:
        hop = self.hops.pop(pod.get("id"), None)
        if hop is not None:
            hop.close()

    def _launch_workerd(self, plan: CellPlan, sites: Sites, pods: list[dict]) -> tuple[int, list[str]]:
        pins = Pins(self.state_dir / PINS_FILE)
        state_sites = object_sites(plan, sites.edge, pins)
        objects = self.state_dir / OBJECTS_DIR
        # A draining pod (colocate:scale.draining) still runs but has left the Worker's POD_URLS.
        urls = [p["worker_url"].rstrip("/") for p in sorted(pods, key=lambda p: p["index"])
                if p["index"] < len(plan.pods) and plan.pods[p["index"]].in_rotation]
        values = {**load_secrets(self.state_dir), "fallbackUrl": self.fallback_url,
                  POD_URLS_FROM_OUTPUT: pod_urls_text(urls)}
        text = config_mod.compose(plan, values=values, edge_site=sites.edge, state_sites=state_sites,
                                  outbound=("127.0.0.1", self.servers.outbound.port), objects_dir=objects,
                                  pod_tls=hopcerts.load(self.state_dir).worker_client())
        config_path = config_mod.write(self.state_dir / WORKERD_CONFIG_FILE, text, objects, state_sites)
        return self._start_workerd(config_path), state_sites

    def _swap(self, plan: CellPlan, sites: Sites, pods: list[dict]) -> tuple[int, list[str]]:
        """Deploy a new Worker version with these pods, dropping no request: new requests wait
        at the edge while in-flight ones finish, then the new workerd takes them."""
        net = self.network
        if not net.pause():
            log_line("apply: in-flight requests did not finish in time; swapping anyway")
        # On Cloudflare an old version's isolates finish their ctx.waitUntil work after the
        # new version takes traffic; here both versions share the objects' disk, so the old
        # one gets that time before it stops: its batched usage reaches the object.
        time.sleep(WAIT_UNTIL_GRACE_S)
        old = self.children.pop("workerd", None)
        try:
            stop_child(old, 10)
            wport, state_sites = self._launch_workerd(plan, sites, pods)
        except BaseException:
            net.resume(net.workerd)  # never leave requests held
            raise
        net.resume(("127.0.0.1", wport), sites=sites)
        write_json(self.state_dir / EDGE_HOLDS_FILE, {"holds": [list(h) for h in net.holds]})
        return wport, state_sites

    def apply(self) -> dict:
        """The sandbox's `pulumi up` on a running cell: re-plan from the stack file and change
        the pods as ``colocate.cell.rollout`` says, the policy Pulumi carries out for ``Cell``: one
        at a time, new pod i serving and used by the Worker before old pod i is deleted."""
        launch = Launch.from_json(read_json(self.state_dir / LAUNCH_FILE) or {})
        plan, _ = build_plan(launch)
        token = load_secrets(self.state_dir)["podToken"]
        old = {p.get("index", 0): p for p in recorded_pods(self.state_dir)}
        for p in old.values():  # pods.json holds the pods' own addresses; the Worker uses their hops
            if p.get("id") in self.hops:
                p["worker_url"] = f"https://localhost:{self.hops[p['id']].port}"
        current: list[dict | None] = [old.get(i) for i in range(len(plan.pods))]
        deleted: set[str] = set()
        net = self.network

        def record() -> None:  # every pod that may bill is on file at every step
            live = [p for p in current if p]
            ids = {p["id"] for p in live} | deleted
            record_pods(self.state_dir, live + [p for p in old.values() if p["id"] not in ids])

        def retire(pod: dict, why: str) -> None:
            self._unhop(pod)
            if delete_pod(self.state_dir, pod):
                deleted.add(pod["id"])
            log_line(f"apply: deleted pod {pod.get('index', 0)} ({pod.get('name')}): {why}")
            record()

        sites = sites_for(plan, launch, (current[0] if current and current[0] else {}).get("location", "local"))
        swapped = None
        steps = rollout({i: p.get("name", "") for i, p in old.items()}, [pod.name for pod in plan.pods])
        for step in steps:
            i, before = step.index, old.get(step.index)
            if step.action not in (ADD, REPLACE):
                continue
            created = create_pod(self.state_dir, plan, token, i)  # serves before anything else happens
            self._hop(plan, launch, created)
            current[i] = created
            record()
            sites = sites_for(plan, launch, current[0].get("location", "local"))
            net.targets.update(self._pod_targets(plan, launch, sites, [created]))  # before the swap
            swapped = self._swap(plan, sites, [p for p in current if p])
            log_line(f"apply: pod {i} is now {created['name']}")
            if before:
                retire(before, "replaced")
        live = [p for p in current if p]
        removed = [old[s.index] for s in steps if s.action == REMOVE]
        if swapped is None or removed:
            swapped = self._swap(plan, sites, live)  # the new Worker version, without removed pods
        for extra in removed:
            retire(extra, f"pod.count is {len(plan.pods)}")
        self._purge_retired(plan)
        wport, state_sites = swapped
        return self._ready(plan, launch, live, sites, state_sites, wport)

    def _purge_retired(self, plan: CellPlan) -> None:
        """What the cell's purge commands do after `finish`: once per retired generation,
        through the Worker's own endpoint (as `migrate.py purge` does in the cloud)."""
        record = self.state_dir / PURGED_FILE
        done = set((read_json(record) or {}).get("purged", []))
        token = load_secrets(self.state_dir)["adminToken"]
        for gen in plan.state.purge:
            if gen in done:
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{self.servers.front.port}/_colocate/purge",
                                         data=json.dumps({"generation": gen}).encode(), method="POST",
                                         headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                log_line(f"purged {gen}: {resp.read().decode()[:200]}")
            done.add(gen)
            write_json(record, {"purged": sorted(done)})

    def _ready(self, plan: CellPlan, launch: Launch, pods: list[dict], sites: Sites, state_sites: list[str],
               wport: int) -> dict:
        self.revision += 1
        secrets = load_secrets(self.state_dir)
        pins = Pins(self.state_dir / PINS_FILE)
        first = pods[0] if pods else {"worker_url": "", "url": ""}  # a cell scaled to zero has none
        fallback_url = self.fallback_url
        geography = self.network.geography
        state = plan.state
        pod_pids = {("pod" if p["index"] == 0 else f"pod-{p['index']}"): pod_pid(self.state_dir, p) for p in pods}
        pod_pids = {name: pid for name, pid in pod_pids.items() if pid}  # a server at a url of the user's has none
        return {
            "stack": plan.stack,
            "region": plan.region.name,
            "worker_url": f"http://127.0.0.1:{self.servers.front.port}",
            "pod_url": first["worker_url"].rstrip("/") or None,
            "pod_id": first.get("id"),
            "pod_location": first.get("location"),
            "pods": [{"index": p["index"], "id": p.get("id"), "name": p.get("name"), "url": p["worker_url"].rstrip("/"),
                      "address": p["url"].rstrip("/"), "control": pod_control(self.state_dir, p),
                      "location": p.get("location"), "pid": pod_pid(self.state_dir, p)}
                     for p in pods],
            "fallback_url": fallback_url,
            "token": secrets["adminToken"],  # keys.py's; the probe and the live view take read_token
            "read_token": secrets["readToken"],
            "exchange_token": secrets["exchangeToken"],  # a fleet's front door's
            "key": self.key.get("key"),
            "key_id": self.key.get("id"),
            "state_dir": str(self.state_dir),
            "generation": state.active.name,
            "hint": state.hint,
            "draining": state.draining.name if state.draining else None,
            "force_split": launch.force_split,
            "sites": {**sites.as_json(), "objects": state_sites, "placement": sites.placement},
            "geography": geography.as_json(),
            "pins": pins.all(),
            "ports": {"front": self.servers.front.port, "outbound": self.servers.outbound.port, "workerd": wport},
            "pids": {"runner": os.getpid(), "workerd": self.children["workerd"].pid,
                     "fallback": self.children["fallback"].pid, **pod_pids},
            "logs": str(self.logs),
            "revision": self.revision,
        }

    def watch(self) -> str:
        """Wait until told to stop or a child dies; apply deploys when asked; say why it ended."""
        while not self.stop.wait(0.2):
            if self.reload.is_set():
                self.reload.clear()
                (self.state_dir / APPLY_FAILED_FILE).unlink(missing_ok=True)
                try:
                    ready = self.apply()
                    write_json(self.state_dir / READY_FILE, ready, 0o600)
                    log_line(f"applied revision {ready['revision']}: generation {ready['generation']}, "
                             f"edge {ready['sites']['edge']}")
                except Exception as exc:  # noqa: BLE001 - reported to `apply`; the old version keeps serving
                    log_line(f"apply failed: {type(exc).__name__}: {exc}")
                    write_json(self.state_dir / APPLY_FAILED_FILE, {"error": str(exc)})
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    return f"{name} exited with {proc.returncode}"
        return "stop requested"

    def cleanup(self) -> None:
        for proc in list(self.children.values())[::-1]:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.children.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self.servers:
            self.servers.close()
        for hop in self.hops.values():
            hop.close()
        delete_recorded_pods(self.state_dir)


def run(state_dir: Path) -> int:
    """The runner's main: start everything, report readiness, wait, clean up."""
    state_dir = Path(state_dir)
    runner = Runner(state_dir)

    def on_signal(signum, _frame):
        runner.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: runner.reload.set())
    write_json(state_dir / RUN_FILE, {"pid": os.getpid(), "pgid": os.getpgid(0), "started_at": time.time()})
    code = 0
    try:
        ready = runner.start()
        if runner.stop.is_set():
            return 0
        write_json(state_dir / READY_FILE, ready, 0o600)
        log_line(f"up: {ready['worker_url']} (edge {ready['sites']['edge']}, objects at {ready['sites']['objects']})")
        why = runner.watch()
        log_line(f"stopping: {why}")
        code = 0 if why == "stop requested" else 1
    except Exception as exc:  # noqa: BLE001 - reported to `up` through failed.json, then cleaned up
        log_line(f"failed: {type(exc).__name__}: {exc}")
        write_json(state_dir / FAILED_FILE, {"error": str(exc)})
        code = 1
    finally:
        runner.cleanup()
        (state_dir / READY_FILE).unlink(missing_ok=True)
        log_line("stopped")
    return code
