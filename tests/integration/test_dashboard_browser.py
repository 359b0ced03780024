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
