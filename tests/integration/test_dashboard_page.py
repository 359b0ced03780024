"""The dashboard's page in headless Chromium over a store written here (no fleet): what an ended
rollout shows, the per-device evaluation section with and without per-device values, every model
version a page at a time, and the page once its server has stopped. Chromium and Playwright as in
test_dashboard_browser.py."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, _playwright

from cloud_coordinator.observe import web
from cloud_coordinator.observe.status import StoreStatus
from cloud_coordinator.store import CoordinatorStore

ROUNDS = 24


def _store(path: Path) -> Path:
    """Two rollouts: "ended" (24 rounds, each with every device's own evaluation, finished) and "plain"
    (3 rounds with only the combined federated evaluation, running)."""
    s = CoordinatorStore(path)
    params = {"w": np.zeros(3, dtype=np.float32)}
    for name, rounds, per_device in (("ended", ROUNDS, True), ("plain", 3, False)):
        s.ensure_rollout(name, {"rollout": name, "rounds": 40 if name == "plain" else rounds, "algorithm": "fedavg",
                                "topology": {"cells": 2, "devices_per_cell": 2}}, b"m")
        s.save_initial_model(name, params)
        for rnd in range(rounds):
            acc, loss = 0.1 + 0.03 * rnd, 700.0 / (rnd + 1) + 30  # a loss of 30 to 730 beside an accuracy below 1
            federated = {"accuracy": acc - 0.05, "loss": 1.0, "examples": 400, "devices": 4, "model_version": rnd}
            if per_device:
                federated["per_device"] = {f"dev-{d:02d}": {"accuracy": acc - 0.02 * d, "loss": 1.0, "examples": 100}
                                           for d in range(4)}
            row = {"round": rnd, "accuracy": acc, "loss": loss, "devices_reported": 4, "missing": [],
                   "model_version": rnd + 1, "round_s": 1.0 + rnd % 3, "federated": federated,
                   "bytes": {"device_up": 1000, "device_down": 2000, "edge_up": 300, "cloud_down": 400}}
            s.commit_round(name, rnd, rnd + 1, params, acc, loss, row)
        s.set_status(name, "finished" if name == "ended" else "running")
    s.close()
    return path


def test_an_ended_rollouts_page_per_device_spread_paged_versions_and_a_stopped_server(tmp_path: Path) -> None:
    sync_playwright = _playwright()
    db = _store(tmp_path / "coordinator.db")
    dashboard = web.start(StoreStatus(db), "127.0.0.1", 0, poll_ms=300)
    shown: dict = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                page.goto(f"{dashboard.url}#rollout=ended")
                page.wait_for_function("() => document.querySelector('#final-accuracy') !== null", timeout=20_000)
                shown["final"] = page.inner_text("#final-accuracy")
                shown["per_device_hidden"] = page.is_hidden("#per-device-box")
                shown["spread"] = page.evaluate("""() => {
                    const u = window.fedtierCharts["chart-per-device"];
                    return {labels: u.series.map(s => s.label), last: u.data.map(d => d[d.length - 1])};
                }""")
                shown["duration"] = page.evaluate("() => window.fedtierCharts['chart-duration'].data[1].length")
                shown["page1"] = page.inner_text("#models tbody tr:first-child td:first-child")
                page.click("#models-older")
                shown["page2"] = page.inner_text("#models tbody tr:first-child td:first-child")
                shown["pager"] = page.inner_text("#models-page")
                page.click("#rollouts a >> text=plain")
                page.wait_for_function("() => document.querySelector('#rollout-name').textContent === 'plain'")
                shown["plain"] = (page.inner_text("#per-device-note"), page.is_hidden("#per-device-box"),
                                  page.is_hidden("#final"), page.is_hidden("#report"))
                dashboard.stop()
                page.wait_for_function("() => document.querySelector('#updated').textContent.includes('stopped')",
                                       timeout=10_000)
                time.sleep(0.5)
                shown["stopped"] = (page.inner_text("#updated"), page.inner_text("#rollout-name"))
            finally:
                browser.close()
    finally:
        dashboard.stop()

    status = StoreStatus(db).rollout("ended")
    assert shown["final"] == f"{status.rounds[-1].accuracy:.4f}"
    assert not shown["per_device_hidden"]
    assert shown["spread"]["labels"] == ["round", "min", "25%", "median", "75%", "max"]
    last = sorted(d["accuracy"] for d in status.rounds[-1].federated["per_device"].values())  # type: ignore[index]
    assert shown["spread"]["last"][0] == ROUNDS - 1
    assert shown["spread"]["last"][1] == last[0] and shown["spread"]["last"][5] == last[-1]
    assert shown["duration"] == ROUNDS
    assert (shown["page1"], shown["page2"]) == (str(ROUNDS), str(ROUNDS - 10))  # newest first, ten a page
    assert "25 in all; page 2 of 3" in shown["pager"]
    note, box_hidden, final_hidden, report_hidden = shown["plain"]
    assert "Not recorded yet" in note and "accuracy 0.1100" in note and box_hidden  # the combined figure, no chart
    assert final_hidden and report_hidden  # a running rollout has no final state yet
    assert "it has stopped" in shown["stopped"][0] and shown["stopped"][1] == "plain"
