"""An open-loop load of routed chat requests with a client key: the failover benchmark's
and the sandbox tests' load generator (Python threads: fine at tens of requests a second,
not a throughput tool; bench/router.py uses wrk for that)."""

from __future__ import annotations

from colocate.cell.settings import POD_DEFAULTS

MAX_IN_FLIGHT = 32  # the pool's threads: at most this many requests of one Load are in flight
# The model the sandbox's pods serve unless a stack names another (colocate:pod.model): a pod
# answers any other name with vLLM's 404.
MODEL = str(POD_DEFAULTS["model"])


class Load:
    """A bounded open-loop load of routed chat requests carrying a client key: one request
    every 1/rate s on a pool of MAX_IN_FLIGHT threads until stopped or ``max_s`` passed. Each result
    is (status or None, x-colocate-backend, error text); ``latencies_ms`` holds each
    request's wall time in the same order as it finished."""

    def __init__(self, url: str, key: str, rate_per_s: float = 50, max_s: float = 180,
                 headers: dict[str, str] | None = None, model: str = MODEL):
        import threading

        self.url = url + "/v1/chat/completions"
        self.key = key
        self.headers = {**(headers or {}), "Authorization": f"Bearer {key}"}
        self.rate, self.max_s, self.model = rate_per_s, max_s, model
        self.results: list[tuple[int | None, str | None, str]] = []
        self.latencies_ms: list[float] = []
        self.started: list[float] = []  # each request's start (time.monotonic()), same order
        self.cells: list[str | None] = []  # the fleet cell that served it (x-colocate-cell), same order
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, pool_local) -> None:
        import requests

        s = getattr(pool_local, "s", None) or requests.Session()
        pool_local.s = s
        import time

        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        t0 = time.monotonic()
        try:
            r = s.post(self.url, json=body, timeout=90, headers=self.headers)
            out = (r.status_code, r.headers.get("x-colocate-backend"), r.text[:200] if r.status_code != 200 else "")
            cell = r.headers.get("x-colocate-cell")
        except requests.RequestException as exc:
            out, cell = (None, None, type(exc).__name__), None
        t1 = time.monotonic()
        with self._lock:
            self.results.append(out)
            self.cells.append(cell)
            self.latencies_ms.append((t1 - t0) * 1000)
            self.started.append(t0)

    def _run(self) -> None:
        import threading
        import time
        from concurrent.futures import ThreadPoolExecutor

        local = threading.local()
        deadline = time.monotonic() + self.max_s
        with ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT) as pool:
            next_at = time.monotonic()
            while not self.stop.is_set() and time.monotonic() < deadline:
                pool.submit(self._one, local)
                next_at += 1 / self.rate
                time.sleep(max(0.0, next_at - time.monotonic()))

    def failures(self) -> list[tuple[int | None, str | None, str]]:
        return [r for r in self.results if r[0] != 200]

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(timeout=120)
