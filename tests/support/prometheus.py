"""A real Prometheus server (Debian's ``prometheus`` package, installed by ``make prometheus``)
scraping loopback targets, and its HTTP API's instant queries."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    # Prometheus cannot report a port it chose itself: take one the kernel hands out, then free it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusError(RuntimeError):
    pass


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen
    log: Path

    def api(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as res:  # noqa: S310 - loopback
            return json.loads(res.read())

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector; PrometheusError carries the server's error for a bad expression."""
        try:
            doc = self.api("query", query=expr)
        except urllib.error.HTTPError as exc:
            with exc:  # an HTTPError holds the connection until closed
                doc = json.loads(exc.read() or b"{}")
        if doc.get("status") != "success":
            raise PrometheusError(f"{expr}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait(self, expr: str, predicate, timeout_s: float = 30.0) -> float | None:
        """Poll ``expr`` (one scrape a second) until ``predicate(value)`` holds, for a bounded time."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.value(expr)
            if (v is not None and predicate(v)) or time.monotonic() > deadline:
                return v
            time.sleep(0.5)


@contextlib.contextmanager
def running(scrape_configs: list[dict], timeout_s: float = 30.0) -> Iterator[Prometheus]:
    """Prometheus with these scrape configs (1 s interval), its data in a temporary directory."""
    exe = binary()
    if exe is None:
        raise PrometheusError("prometheus is not installed (make prometheus)")
    with tempfile.TemporaryDirectory(prefix="colocate-prom-") as tmp:
        d = Path(tmp)
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": scrape_configs}
        (d / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
        port = _free_port()
        log = d / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=out, stderr=subprocess.STDOUT)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise PrometheusError(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as res:  # noqa: S310 - loopback
                        if res.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise PrometheusError(f"prometheus not ready after {timeout_s:.0f} s: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield prom
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
