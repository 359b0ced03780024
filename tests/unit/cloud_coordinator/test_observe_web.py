"""The dashboard's JSON API and page, over Starlette's test client (the browser test drives the real thing)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from cloud_coordinator.observe import web
from cloud_coordinator.observe.status import StoreStatus
from cloud_coordinator.store import CoordinatorStore


class _Live:
    def rejects(self) -> dict[str, float]:
        return {"sha_mismatch": 2.0}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with one running rollout (2 of 5 rounds closed, one device missing from round 1)."""
    path = tmp_path / "coordinator.db"
    s = CoordinatorStore(path)
    config = {"rollout": "r1", "rounds": 5, "algorithm": "fedavg",
              "topology": {"cells": 2, "devices_per_cell": 2}}
    s.ensure_rollout("r1", config, b"manifest")
    import numpy as np

    params = {"w": np.zeros(3, dtype=np.float32)}
    s.save_initial_model("r1", params)
    for rnd, (acc, missing) in enumerate([(0.5, []), (0.625, ["dev-03"])]):
        row = {"round": rnd, "accuracy": acc, "loss": 1.0 - acc, "devices_reported": 4 - len(missing),
               "missing": missing, "model_version": rnd + 1, "round_s": 0.5,
               "bytes": {"device_up": 1000, "device_down": 2000, "edge_up": 300, "cloud_down": 400}}
        s.commit_round("r1", rnd, rnd + 1, params, acc, 1.0 - acc, row)
    s.record_presence("dev-00", {"role": "device", "cell": "cell-a", "state": "online"}, 1.0)
    s.record_presence("dev-02", {"role": "device", "cell": "cell-b", "state": "offline"}, 1.0)
    s.set_deployment("r1", ["cell-a", "cell-b"], 1)  # version 1 promoted everywhere ...
    s.add_promotion("r1", 1, None, ["cell-a"], True, [])
    s.set_deployment("r1", ["cell-a"], 2)  # ... version 2 on its canary cell, its gate failed
    s.add_promotion("r1", 2, 1, ["cell-a"], False, ["accuracy 0.62 below 0.70 - margin"])
    s.set_deployment("r1", ["cell-a"], 1)
    s.close()
    return path


def test_the_api_lists_rollouts_and_serves_one(store: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(store, live=_Live())))

    listing = client.get("/api/rollouts").json()["rollouts"]
    doc = client.get("/api/rollouts/r1").json()
    missing = client.get("/api/rollouts/nope")

    assert [(r["rollout"], r["status"], r["rounds_closed"], r["rounds_planned"], r["accuracy"]) for r in listing] == \
        [("r1", "running", 2, 5, 0.625)]
    assert doc["round_in_progress"] == 2 and doc["progress"] == pytest.approx(0.4)
    assert [r["accuracy"] for r in doc["rounds"]] == [0.5, 0.625]
    assert [r["bytes"]["edge_up"] for r in doc["rounds"]] == [300, 300]
    assert doc["cells"] == [
        {"cell": "cell-a", "devices_known": 2, "devices_online": 1, "reported_last_round": 2, "stragglers": []},
        {"cell": "cell-b", "devices_known": 2, "devices_online": 0, "reported_last_round": 1,
         "stragglers": ["dev-03"]}]
    assert [(m["version"], m["cells"], m["canary"]) for m in doc["models"]] == \
        [(0, [], None), (1, ["cell-a", "cell-b"], "promoted"), (2, [], "rejected")]
    assert doc["promotions"][-1]["reasons"] == ["accuracy 0.62 below 0.70 - margin"]
    assert doc["rejects"] == {"sha_mismatch": 2.0}
    assert missing.status_code == 404 and "nope" in missing.json()["error"]


def test_the_dashboard_is_read_only(store: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(store)))

    for path in ("/", "/api/rollouts", "/api/rollouts/r1"):
        assert client.post(path).status_code == 405
        assert client.delete(path).status_code == 405


def test_the_page_loads_nothing_from_elsewhere(store: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(store)))

    page = client.get("/")
    chart = client.get("/static/uPlot.iife.min.js")

    assert page.status_code == 200 and 'id="round-closed"' in page.text
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith("/static/") or s.startswith("#") for s in sources), sources
    assert "://" not in re.sub(r"<!--.*?-->", "", page.text.split("<script>")[-1])
    assert chart.status_code == 200 and "uPlot" in chart.text[:2000]
    assert "MIT" in (web.STATIC / "uPlot.LICENSE").read_text()


@pytest.mark.parametrize("text, expected", [("127.0.0.1:8080", ("127.0.0.1", 8080)), ("8080", ("127.0.0.1", 8080)),
                                             ("[::1]:9000", ("::1", 9000)), (":0", ("127.0.0.1", 0))])
def test_parse_bind(text: str, expected: tuple[str, int]) -> None:
    assert web.parse_bind(text) == expected


@pytest.mark.parametrize("text", ["localhost:http", "127.0.0.1:99999", "host:"])
def test_parse_bind_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        web.parse_bind(text)


def test_start_serves_on_a_free_port_and_stops(store: Path) -> None:
    import json
    import urllib.request

    dashboard = web.start(StoreStatus(store), "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"{dashboard.url}api/rollouts", timeout=5) as resp:
            listing = json.loads(resp.read())
    finally:
        dashboard.stop()

    assert listing["rollouts"][0]["rollout"] == "r1"
    assert not dashboard.thread.is_alive()


def test_no_device_gateway_or_core_module_imports_the_web_stack() -> None:
    """The dashboard's dependencies are the coordinator extra's (``fedtier[agent]``/``[edge]`` lack them)."""
    import ast

    root = Path(__file__).resolve().parents[3]
    web_stack = {"starlette", "uvicorn", "fastapi", "playwright", "matplotlib"}
    for package in ("fedtier", "device_agent", "edge_broker"):
        for path in (root / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not names & web_stack, (path, names & web_stack)


def test_the_api_carries_the_operators_status_document(store: Path) -> None:
    """One truth: the dashboard's rollout document embeds what ``fedtier rollout status --json`` prints."""
    from cloud_coordinator.status import rollout_status

    client = TestClient(web.create_app(StoreStatus(store)))
    s = CoordinatorStore(store)
    try:
        expected = rollout_status(s, "r1")
    finally:
        s.close()

    doc = client.get("/api/rollouts/r1").json()

    assert doc["operator"] == expected
    assert doc["operator"]["last_accuracy"] == doc["rounds"][-1]["accuracy"] == 0.625
    assert [c["devices_online"] for c in doc["cells"]] == [expected["cells"][c]["devices_online"]
                                                          for c in ("cell-a", "cell-b")]


def test_the_report_plots_are_served_as_png(store: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(store)))

    plot = client.get("/api/rollouts/r1/plots/accuracy_loss.png")
    again = client.get("/api/rollouts/r1/plots/accuracy_loss.png")
    unknown_plot = client.get("/api/rollouts/r1/plots/nope.png")
    unknown_rollout = client.get("/api/rollouts/nope/plots/epsilon.png")

    assert plot.status_code == 200 and plot.headers["content-type"] == "image/png"
    assert plot.content.startswith(b"\x89PNG") and again.content == plot.content  # rendered once per state
    assert unknown_plot.status_code == 404 and "accuracy_loss" in unknown_plot.json()["error"]
    assert unknown_rollout.status_code == 404


def test_before_the_store_exists_the_api_lists_no_rollout(tmp_path: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(tmp_path / "not-yet.db")))

    assert client.get("/api/rollouts").json()["rollouts"] == []
    assert not (tmp_path / "not-yet.db").exists()


def test_live_counts_belong_to_the_rollout_this_process_drives(store: Path) -> None:
    client = TestClient(web.create_app(StoreStatus(store, live_for=lambda r: _Live() if r == "other" else None)))

    doc = client.get("/api/rollouts/r1").json()

    assert doc["rejects"] == {} and doc["live"] is False


def test_the_page_draws_accuracy_and_loss_on_two_scales_and_pages_every_model_version(store: Path) -> None:
    """What the page's script sets up (the browser test reads the same options from the running chart)."""
    page = TestClient(web.create_app(StoreStatus(store))).get("/").text

    assert 'scale: "accuracy"' in page and 'scale: "loss"' in page and "side: 1" in page
    for element in ("chart-duration", "per-device", "final-facts", "models-older", "models-newer", "plots"):
        assert f'id="{element}"' in page, element
    assert "slice(-10)" not in page  # every version, paged, not the 10 newest


def test_coordinator_serve_serves_the_dashboard_before_any_rollout_and_until_it_stops(tmp_path: Path) -> None:
    import json
    import socket
    import threading
    import urllib.request

    from cloud_coordinator.service import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(serve(tmp_path / "state", stop, http=("127.0.0.1", port))))
    thread.start()
    try:
        listing = None
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rollouts", timeout=2) as resp:
                    listing = json.loads(resp.read())
                break
            except OSError:
                threading.Event().wait(0.05)
    finally:
        stop.set()
        thread.join(30)

    assert listing is not None and listing["rollouts"] == []  # an empty store: waiting for `rollout create`
    assert codes == [0]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rollouts", timeout=2)


@pytest.mark.parametrize("exit_when_done", [False, True])
def test_coordinator_run_keeps_serving_an_ended_rollout_until_told(small_rollout, store: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   exit_when_done: bool) -> None:
    """``coordinator run --http``: the page outlives the rollout (its final state stays readable) until
    Ctrl-C, or ``--exit-when-done``. The rollout's loop is stubbed: it has ended at once."""
    import json
    import socket
    import threading
    import urllib.request
    from types import SimpleNamespace

    from cloud_coordinator import run as run_module

    cfg = small_rollout(rollout="r1", state_dir=str(store.parent))
    node = SimpleNamespace(observed=_Live(), done=True, metrics=SimpleNamespace(serve=lambda port: None),
                           prepared=SimpleNamespace(cells={}, devices={}), start=None)
    monkeypatch.setattr(run_module, "build", lambda cfg, on_round: (node, None, None))
    monkeypatch.setattr(run_module.mqtt_service, "run", lambda *a, **k: 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    linger = threading.Event()
    done: list[int] = []
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_module.run(
        cfg, http=("127.0.0.1", port), exit_when_done=exit_when_done, on_done=done.append, linger=linger)))

    thread.start()
    thread.join(2 if exit_when_done else 1)
    lingering = thread.is_alive()
    doc = None
    if lingering:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rollouts/r1", timeout=5) as resp:
            doc = json.loads(resp.read())
    linger.set()
    thread.join(10)

    assert done == [0] and codes == [0] and not thread.is_alive()
    assert lingering is not exit_when_done
    if doc is not None:  # the ended rollout's page, with what its coordinator counted
        assert doc["summary"]["rounds_closed"] == 2 and doc["rejects"] == {"sha_mismatch": 2.0} and doc["live"]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/rollouts", timeout=2)
