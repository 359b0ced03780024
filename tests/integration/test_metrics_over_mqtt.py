"""Prometheus scrapes of every node during a private rollout through a real Mosquitto.

Every metric docs/operations.md documents is exported by the nodes its "on" column names, and
messages and bytes flow in both directions on every tier a node sits on. The scrape is HTTP
(``prometheus_client``'s server on a free port), parsed with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
from fleet_threads import ThreadFleet
from mqtt_helpers import RawClient
from prometheus_client.parser import text_string_to_metric_families

from local_fleet.configs import write_fleet
from fedtier.transport import topics

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"cloud": "cloud", "edge": "edge", "all": None}


def documented() -> list[tuple[str, str]]:
    """(name, on) of every row of the table under "### Metrics" in docs/operations.md."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = re.split(r"\n#{1,3} ", text.split("### Metrics", 1)[1], maxsplit=1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| \w+ \|[^|]*\| ([^|]+) \|", section, re.MULTILINE)
    assert len(rows) >= 15, rows
    return [(name, on.strip()) for name, on in rows]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exported(samples: dict, name: str) -> bool:
    names = {n for n, _ in samples}
    return bool({name, f"{name}_count", f"{name}_total"} & names)


def traffic(samples: dict, what: str, tier: str, direction: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == what and dict(labels).get("tier") == tier and dict(labels).get("direction") == direction)


def test_a_scrape_during_a_run_has_every_documented_metric(mosquitto, small_rollout, tmp_path: Path) -> None:
    # Prepare: a private 2x2 rollout (so the ledger's epsilon is exported), nodes as threads, each
    # serving its registry on a free port.
    cfg = small_rollout(rounds=4, privacy={"epsilon": 20.0, "clip": 1.0},
                        fedavg={"local_steps": 3, "lr": 0.1, "batch_size": 16})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    ports: dict[str, int] = {}
    raw = RawClient(mosquitto.host, mosquitto.port, "intruder")
    try:
        fleet.start_all()
        for name, running in fleet.nodes.items():
            ports[name] = running.node.metrics.serve(0).server_address[1]
        coordinator = fleet.nodes["coordinator"].node
        cells = sorted(coordinator.prepared.cells)

        # Execute: once a round closed, a malformed cell update (the coordinator counts it by
        # reason); scrape once two rounds closed, while the rollout still runs.
        deadline = time.monotonic() + 90
        while len(coordinator.history) < 1 and time.monotonic() < deadline:
            fleet.check()
            time.sleep(0.05)
        raw.publish(topics.edge_up("t", cells[0], "cell_update"), b"not an envelope")
        while (len(coordinator.history) < 2 or coordinator.metrics.total("fedtier_rejected_total") < 1) \
                and time.monotonic() < deadline:
            fleet.check()
            time.sleep(0.05)
        assert len(coordinator.history) >= 2, coordinator.history
        scraped = {name: scrape(port) for name, port in ports.items()}
        during = not coordinator.finished
        fleet.wait_finished(timeout=90)
    finally:
        raw.close()
        fleet.stop()

    # Assert: every documented name where the docs say it is.
    roles = {name: running.node.metrics.const_labels["role"] for name, running in fleet.nodes.items()}
    assert sorted(set(roles.values())) == ["cloud", "device", "edge"]
    for metric, on in documented():
        condition = on.partition("(")[2].rstrip(")")
        if condition in ("federated evaluation", "binary task"):
            continue  # another kind of run: privacy is on (no federated evaluation), digits has 10 classes
        if condition == "first event" and metric != "fedtier_rejected_total":
            continue  # a clean run drops nothing and has no copied identity
        wanted = [n for n, role in roles.items()
                  if on.startswith("all") or role in re.findall(r"cloud|edge|device", on.split("(")[0])]
        if condition == "first event":
            wanted = ["coordinator"]  # only the coordinator was sent a bad message
        assert wanted, (metric, on)
        for node in wanted:
            assert exported(scraped[node], metric), f"{metric} not exported by {node} ({on})"
    # Messages and bytes in both directions on every tier of each node.
    tiers = {"cloud": ["edge_cloud"], "edge": ["device_edge", "edge_cloud"], "device": ["device_edge"]}
    for node, role in roles.items():
        for tier in tiers[role]:
            for direction in ("in", "out"):
                for what in ("fedtier_messages_total", "fedtier_bytes_total"):
                    assert traffic(scraped[node], what, tier, direction) > 0, (node, tier, direction, what)
    cloud = scraped["coordinator"]
    assert cloud[("fedtier_rejected_total", (("node", "cloud"), ("reason", "bad_magic"), ("role", "cloud")))] == 1
    # The series agree with the rollout's own records at the time of the scrape.
    closed = int(cloud[("fedtier_round", (("node", "cloud"), ("role", "cloud")))])
    row = coordinator.history[closed]
    assert cloud[("fedtier_accuracy", (("node", "cloud"), ("role", "cloud")))] == pytest.approx(row["accuracy"])
    assert cloud[("fedtier_round_seconds_count", (("node", "cloud"), ("role", "cloud")))] == closed + 1
    epsilon = cloud[("fedtier_epsilon_spent_max", (("node", "cloud"), ("role", "cloud")))]
    assert epsilon == pytest.approx(row["privacy"]["epsilon_max"]) and epsilon > 0
    for cell in cells:
        labels = (("cell", cell), ("node", "cloud"), ("role", "cloud"))
        assert cloud[("fedtier_devices_known", labels)] == 2
        assert cloud[("fedtier_devices_online", labels)] == 2
        assert cloud[("fedtier_model_version", labels)] == row["model_version"]
    print(f"scraped during the run: {during}; round {closed} closed; cloud bytes in "
          f"{traffic(cloud, 'fedtier_bytes_total', 'edge_cloud', 'in'):.0f}")
