"""The dashboard of ``fedtier demo --dashboard`` in a real headless Chromium while the demo runs.

The demo runs the real processes (broker, coordinator, edges, agents) over Mosquitto. The page
must show the round and accuracy advancing as rounds close, each time the values the coordinator
committed to its store; a screenshot is saved in the test's tmp dir. Chromium is Debian's
(``/usr/bin/chromium``, installed by install.sh), driven by Playwright (never ``playwright
install``); in CI (``CI=true``) a missing browser fails.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.broker

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


def test_the_dashboard_of_a_demo_shows_the_live_round_and_accuracy(tmp_path: Path) -> None:
    sync_playwright = _playwright()
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    db = tmp_path / "demo" / "coordinator" / "coordinator.db"
    seen: list[tuple[int, str]] = []
    progress = float("nan")
    output: list[str] = []
    proc, lines = _demo(tmp_path / "demo")
    try:
        # Prepare: the URL the demo prints.
        deadline = time.monotonic() + 45
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
                # Execute: watch the page until it has shown three different closed rounds.
                while len(seen) < 3 and time.monotonic() < deadline:
                    shown = page.inner_text("#round-closed")
                    if shown.isdigit() and (not seen or int(shown) > seen[-1][0]):
                        # The page renders one API answer at a time: round and accuracy belong together.
                        seen.append((int(shown), page.inner_text("#accuracy")))
                        if len(seen) == 2:  # a later round is still to come: the bar is part-way
                            progress = float(page.get_attribute("#progress", "value") or "nan")
                            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
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
    assert re.search(r"cell-a\s+\d / 2", cells), cells  # devices online / known, from the coordinator's presence
    shot = tmp_path / "dashboard.png"
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000
    print(f"rounds shown: {seen}; screenshot {shot}")
