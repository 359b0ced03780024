"""Counters and gauges with labels, rendered in the Prometheus text format.

Edges and the coordinator can serve them over HTTP (``serve``) for Prometheus to scrape;
tests and the demo read them directly. Names follow Prometheus conventions
(``fedtier_rejected_total{reason="sha_mismatch"}``).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LabelKey = tuple[tuple[str, str], ...]


class Metrics:
    """A thread-safe registry of counters (``inc``) and gauges (``set``)."""

    def __init__(self, **const_labels: str) -> None:
        self.const_labels = {k: str(v) for k, v in const_labels.items()}
        self._values: dict[str, dict[LabelKey, float]] = {}
        self._kinds: dict[str, str] = {}
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, Any]) -> LabelKey:
        return tuple(sorted((k, str(v)) for k, v in labels.items()))

    def inc(self, name: str, amount: float = 1.0, **labels: Any) -> None:
        with self._lock:
            self._kinds.setdefault(name, "counter")
            series = self._values.setdefault(name, {})
            key = self._key(labels)
            series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: Any) -> None:
        with self._lock:
            self._kinds.setdefault(name, "gauge")
            self._values.setdefault(name, {})[self._key(labels)] = float(value)

    def get(self, name: str, **labels: Any) -> float:
        with self._lock:
            return self._values.get(name, {}).get(self._key(labels), 0.0)

    def total(self, name: str) -> float:
        """Sum of a metric over all label sets."""
        with self._lock:
            return sum(self._values.get(name, {}).values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {name: {",".join(f"{k}={v}" for k, v in key): val for key, val in series.items()}
                    for name, series in self._values.items()}

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines = []
        with self._lock:
            for name in sorted(self._values):
                lines.append(f"# TYPE {name} {self._kinds[name]}")
                for key, value in sorted(self._values[name].items()):
                    labels = {**self.const_labels, **dict(key)}
                    label_str = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                    text = _number(value)
                    lines.append(f"{name}{{{label_str}}} {text}" if label_str else f"{name} {text}")
        return "\n".join(lines) + "\n"

    def serve(self, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the server."""
        registry = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.rstrip("/") != "/metrics":
                    self.send_error(404)
                    return
                body = registry.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = ThreadingHTTPServer((host, port), _Handler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


def _number(value: float) -> str:
    """Full precision: integral values as integers (counters), others as repr (shortest exact)."""
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
