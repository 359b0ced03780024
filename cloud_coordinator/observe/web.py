"""The coordinator's read-only web dashboard: a Starlette app served by uvicorn from a daemon thread.

``fedtier coordinator serve --http 127.0.0.1:8080`` serves it for every rollout of the store, running
or ended, for as long as the service runs; ``fedtier coordinator run --http ...`` next to its rollout,
and on after the rollout ended until Ctrl-C (both off by default). Everything it shows comes from
``observe.status`` through a JSON API under ``/api/`` (documented in docs/operations.md), and the
report's plots (``observe.plots``) as PNGs; the page polls the API once a second. Only GET exists:
nothing on the dashboard changes the fleet. The charting library (uPlot, MIT, vendored in
``static/``) is served from the package: gateways and devices are often offline, and the page loads
nothing from elsewhere.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cloud_coordinator.observe import plots
from cloud_coordinator.observe.plots import PLOTS
from cloud_coordinator.observe.status import StoreStatus

log = logging.getLogger("fedtier.coordinator.dashboard")

STATIC = Path(__file__).with_name("static")
POLL_MS = 1000
"""How often the page asks the API for fresh status."""


def create_app(status: StoreStatus, poll_ms: int = POLL_MS) -> Any:
    """The dashboard as an ASGI app over ``status``; the page polls the API every ``poll_ms``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text().replace("__POLL_MS__", str(int(poll_ms))),
                            headers={"Cache-Control": "no-store"})

    async def rollouts(request: Request) -> JSONResponse:
        try:
            items = [asdict(s) for s in status.rollouts()]
        except FileNotFoundError:  # the coordinator has not created its store yet
            items = []
        return JSONResponse({"rollouts": items, "time": time.time()}, headers={"Cache-Control": "no-store"})

    async def plot(request: Request) -> Response:
        name, stem = request.path_params["rollout"], request.path_params["stem"]
        if stem not in PLOTS:
            return JSONResponse({"error": f"no plot {stem!r} (plots: {', '.join(PLOTS)})"}, status_code=404)
        try:
            png = await run_in_threadpool(plots.png, status, name, stem)
        except KeyError:
            return JSONResponse({"error": f"no rollout {name!r}"}, status_code=404)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    async def rollout(request: Request) -> JSONResponse:
        name = request.path_params["rollout"]
        try:
            doc = status.rollout(name).to_dict()
        except KeyError:
            return JSONResponse({"error": f"no rollout {name!r}"}, status_code=404)
        return JSONResponse(doc, headers={"Cache-Control": "no-store"})

    return Starlette(routes=[
        Route("/", index, methods=["GET"]),
        Route("/api/rollouts", rollouts, methods=["GET"]),
        Route("/api/rollouts/{rollout}", rollout, methods=["GET"]),
        Route("/api/rollouts/{rollout}/plots/{stem}.png", plot, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ])


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``PORT``, on 127.0.0.1) of ``--http``; ``ValueError`` naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host, int(port)


@dataclass
class Dashboard:
    """A running dashboard: its URL, and ``stop()``."""

    url: str
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def start(status: StoreStatus, host: str = "127.0.0.1", port: int = 8080, poll_ms: int = POLL_MS) -> Dashboard:
    """Serve the dashboard from a daemon thread; returns once it listens (port 0: a free one)."""
    import uvicorn

    if not _loopback(host):
        log.warning("the dashboard listens on %s, beyond this machine: it is read-only but has no login; "
                    "put it behind a reverse proxy with authentication", host)
    server = uvicorn.Server(uvicorn.Config(create_app(status, poll_ms), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="dashboard-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"the dashboard could not listen on {host}:{port} (see the log)")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{bound}/"
    log.info("dashboard on %s", url)
    return Dashboard(url=url, server=server, thread=thread)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
