"""The dashboard of ``fedtier demo --dashboard`` in a real headless Chromium while the demo runs.

The demo runs the real processes (broker, coordinator, edges, agents) over Mosquitto. The page
must show the round and accuracy advancing as rounds close, each time the values the coordinator
committed to its store; paused by ``fedtier rollout pause``, the page and ``fedtier rollout status
--json`` must agree on the rollout's state, its last closed round and accuracy; resumed, the page
advances again. A screenshot is saved in the test's tmp dir. Chromium is Debian's
(``/usr/bin/chromium``, installed by install.sh), driven by Playwright (never ``playwright
install``); in CI (``CI=true``) a missing browser fails.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import mosquitto_binary, require

from cloud_coordinator.observe.plots import PLOTS
from cloud_coordinator.observe.status import StoreStatus
from cloud_coordinator.store import CoordinatorStore

pytestmark = [pytest.mark.broker, pytest.mark.fleet]  # a demo's whole fleet: one at a time

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


try:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright as _sync_playwright
except ImportError:
    PlaywrightError = OSError  # type: ignore[misc,assignment]
    _sync_playwright = None  # type: ignore[assignment]


def _playwright():  # type: ignore[no-untyped-def]
    sync_playwright = _sync_playwright
    require(sync_playwright is not None, "Playwright's Python package (pip install -e '.[dev]')")
    require(CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK), "Chromium at /usr/bin/chromium (install.sh)")
    return sync_playwright


def _fedtier(state_dir: Path, *args: str) -> dict:
    """``fedtier ARGS --json`` against the demo coordinator's store, as an operator would type it."""
    env = {**os.environ, "FEDTIER_STATE_DIR": str(state_dir)}
    done = subprocess.run([sys.executable, "-m", "fedtier", *args, "--json"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _stored(db: Path, rollout: str, round_: int) -> dict:
    store = CoordinatorStore(db)
    try:
        return next(r for r in store.rounds(rollout) if r["round"] == round_)
    finally:
        store.close()


def _demo(workdir: Path) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    """``fedtier demo --dashboard`` (4 devices, 200 short rounds) with its output lines on a queue.

    Rounds this small take about 0.1 s on an idle machine: 200 of them keep the rollout up long
    enough for the page (polling once a second) to show several closed rounds."""
    proc = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", "--dashboard", "--devices", "4", "--cells", "2",
                             "--rounds", "200", "--broker", "mosquitto", "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _pause_and_compare(page, state_dir: Path, deadline: float) -> tuple[dict, tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    """``fedtier rollout pause demo``; once ``rollout status --json`` says paused, wait for the page to
    show the paused rollout and return both: (status document, (round, accuracy, state) on the page)."""
    assert _fedtier(state_dir, "rollout", "pause", "demo")["desired"] == "paused"
    status: dict = {}
    while time.monotonic() < deadline:
        status = _fedtier(state_dir, "rollout", "status", "demo")
        if status["status"] == "paused":
            break
        time.sleep(0.3)
    shown = ("", "", "")
    while time.monotonic() < deadline:  # the page polls once a second
        shown = (page.inner_text("#round-closed"), page.inner_text("#accuracy"),
                 page.inner_text("#rollout-status").split(", ")[-1])
        if shown[2] == "paused" and shown[0] == str(status["rounds_closed"] - 1):
            break
        time.sleep(0.2)
    return status, shown


def test_the_dashboard_of_a_demo_shows_the_live_round_and_accuracy(tmp_path: Path) -> None:
    sync_playwright = _playwright()
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    db = tmp_path / "demo" / "coordinator" / "coordinator.db"
    seen: list[tuple[int, str]] = []
    progress = float("nan")
    output: list[str] = []
    paused: dict = {}
    page_paused: tuple[str, str, str] = ("", "", "")
    proc, lines = _demo(tmp_path / "demo")
    try:
        # Prepare: the URL the demo prints.
        deadline = time.monotonic() + 90
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                output.append(lines.get(timeout=0.2))
            except queue.Empty:
                continue
            found = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/)", output[-1])
            url = found.group(1) if found else None
        assert url is not None, "".join(output)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                while True:  # the coordinator listens once it has built the rollout's artifacts
                    try:
                        page.goto(url)
                        break
                    except PlaywrightError:
                        assert time.monotonic() < deadline and proc.poll() is None, "".join(output)
                        time.sleep(0.2)
                # Execute: watch the page until it has shown three different closed rounds; after the
                # second, pause the rollout with the operator's CLI, compare, and resume it.
                while len(seen) < 3 and time.monotonic() < deadline:
                    shown = page.inner_text("#round-closed")
                    floor = int(page_paused[0]) if page_paused[0].isdigit() else -1  # after the pause: later
                    if shown.isdigit() and (not seen or int(shown) > max(seen[-1][0], floor)):
                        # The page renders one API answer at a time: round and accuracy belong together.
                        seen.append((int(shown), page.inner_text("#accuracy")))
                        if len(seen) == 2:  # a later round is still to come: the bar is part-way
                            progress = float(page.get_attribute("#progress", "value") or "nan")
                            paused, page_paused = _pause_and_compare(page, db.parent, deadline)
                            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                            _fedtier(db.parent, "rollout", "resume", "demo")
                    time.sleep(0.1)
                cells = page.inner_text("#cells tbody")
            finally:
                browser.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()  # the demo stops every process it started
            proc.wait(timeout=30)

    # Assert: the round shown advanced, and each round's accuracy is the one the coordinator stored.
    assert len(seen) == 3, (seen, "".join(output))
    assert [r for r, _ in seen] == sorted({r for r, _ in seen}), seen
    status = StoreStatus(db).rollout("demo")
    for round_, accuracy in seen:
        assert accuracy == f"{_stored(db, 'demo', round_)['accuracy']:.4f}", (round_, accuracy)
        assert accuracy == f"{status.rounds[round_].accuracy:.4f}"
    assert 0 < progress < 1
    # Paused, the page showed what `fedtier rollout status --json` said, and the store agrees with both.
    assert paused["status"] == "paused" and paused["rounds_closed"] < 200, paused
    last_closed = paused["rounds_closed"] - 1
    assert page_paused == (str(last_closed), f"{paused['last_accuracy']:.4f}", "paused"), (page_paused, paused)
    assert paused["last_accuracy"] == _stored(db, "demo", last_closed)["accuracy"]
    assert seen[2][0] > last_closed  # resumed: later rounds closed
    assert re.search(r"cell-a\s+\d / 2", cells), cells  # devices online / known, from the coordinator's presence
    shot = tmp_path / "dashboard.png"
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000
    print(f"rounds shown: {seen}; screenshot {shot}")


def _wait(condition, timeout: float, what: str, proc: subprocess.Popen, output: list[str]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the demo ended while waiting for {what}:\n" + "".join(output)
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "".join(output)
        time.sleep(0.3)


def test_the_services_dashboard_shows_a_finished_rollout_after_its_coordinator_exited_and_a_running_one(
        tmp_path: Path) -> None:
    """``fedtier demo --keep-running --dashboard`` runs ``coordinator serve --http``: its rollout finishes, a
    second one is created and started beside it, and the service process is killed (the demo restarts it,
    as systemd would). The page lists both rollouts of the store; the finished one shows its final
    accuracy, as stored; the running one its state. Accuracy and loss are on two scales of the chart."""
    sync_playwright = _playwright()
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    from fedtier.runtime.config import dumps_toml, read_toml

    work = tmp_path / "demo"
    state = work / "coordinator"
    proc = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", "--keep-running", "--dashboard", "--devices", "4",
                             "--cells", "2", "--rounds", "3", "--broker", "mosquitto", "--workdir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()
    said = lambda text: any(text in line for line in output)  # noqa: E731
    shown: dict = {}
    try:
        # Prepare: the first rollout finished; a second one runs beside it; the service is killed once.
        _wait(lambda: said("dashboard: http://127.0.0.1:"), 120, "the dashboard's URL", proc, output)
        url = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", "".join(output)).group(1)  # type: ignore[union-attr]
        _wait(lambda: said("the fleet keeps running"), 240, "the first rollout to finish", proc, output)
        config = read_toml(work / "configs" / "coordinator.toml")
        second = tmp_path / "second.toml"
        second.write_text(dumps_toml({**config, "rollout": "second", "rounds": 500}))
        assert _fedtier(state, "rollout", "create", "--config", str(second), "--start")["rollout"] == "second"
        found = subprocess.run(["pgrep", "-f", f"coordinator serve --state-dir {state}"], capture_output=True,
                               text=True).stdout.split()
        assert len(found) == 1, found
        os.kill(int(found[0]), 9)
        _wait(lambda: said("coordinator died (exit code -9); restarted it"), 60, "the restart", proc, output)
        _wait(lambda: _fedtier(state, "rollout", "status", "second")["rounds_closed"] >= 1, 120,
              "the second rollout's first round", proc, output)

        # Execute: the page of the finished rollout, then of the running one.
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                page.goto(f"{url}#rollout=demo")
                page.wait_for_function("() => document.querySelector('#final-accuracy') !== null && "
                                       "document.querySelectorAll('#rollouts tbody tr').length === 2", timeout=30_000)
                page.wait_for_function("() => [...document.querySelectorAll('#plots img')].every(i => i.complete && "
                                       "i.naturalWidth > 0)", timeout=60_000)
                shown["listed"] = [[td.inner_text() for td in tr.query_selector_all("td")][:3]
                                   for tr in page.query_selector_all("#rollouts tbody tr")]
                shown["final"] = page.inner_text("#final-accuracy")
                shown["status"] = page.inner_text("#rollout-status")
                shown["plots"] = page.eval_on_selector_all("#plots img", "imgs => imgs.map(i => i.naturalWidth)")
                shown["chart"] = page.evaluate("""() => {
                    const u = window.fedtierCharts["chart-accuracy"];
                    return {series: u.series.map(s => [s.label, s.scale]), axes: u.axes.map(a => [a.scale, a.side]),
                            accuracy: [u.scales.accuracy.min, u.scales.accuracy.max],
                            loss: [u.scales.loss.min, u.scales.loss.max]};
                }""")
                page.screenshot(path=str(tmp_path / "finished.png"), full_page=True)
                page.click("#rollouts a >> text=second")
                page.wait_for_function("() => document.querySelector('#rollout-name').textContent === 'second'",
                                       timeout=10_000)
                shown["second"] = (page.inner_text("#rollout-status"), page.is_hidden("#final"))
            finally:
                browser.close()
    finally:
        if proc.poll() is None:
            proc.terminate()  # the demo stops every process it started
            proc.wait(timeout=60)

    # Assert: both rollouts of the store; the finished one's final accuracy as the store has it.
    status = StoreStatus(state / "coordinator.db").rollout("demo")
    assert status.summary.status == "finished" and len(status.rounds) == 3
    assert shown["listed"] == [["demo", "fedavg", "finished"], ["second", "fedavg", "running"]], shown
    assert shown["final"] == f"{status.rounds[-1].accuracy:.4f}", shown
    assert shown["status"].endswith("finished") and shown["second"] == ("fedavg, running", True), shown
    assert len(shown["plots"]) == len(PLOTS) and all(width > 300 for width in shown["plots"]), shown
    # Accuracy and loss on scales of their own: the loss axis on the right.
    chart = shown["chart"]
    assert chart["series"][1:] == [["accuracy", "accuracy"], ["loss", "loss"]], chart
    assert ["accuracy", 3] in chart["axes"] and ["loss", 1] in chart["axes"], chart
    assert chart["accuracy"] == [0, 1], chart  # a fraction, whatever the loss
    assert chart["loss"][1] >= max(r.loss for r in status.rounds if r.loss is not None), chart
    print(f"shown: {shown}; screenshot {tmp_path / 'finished.png'}")
