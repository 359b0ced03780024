"""fedtier.runtime.metrics: a node's counters, gauges and histograms on its prometheus_client registry."""

from __future__ import annotations

import threading
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedtier.runtime.metrics import BYTES, MESSAGES, Metrics
from fedtier.transport.base import Traffic


def test_inc_set_get_total() -> None:
    m = Metrics()

    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.inc("fedtier_rejected_total", 3, reason="truncated")
    m.set("fedtier_round", 4)
    m.set("fedtier_round", 5)

    assert m.get("fedtier_rejected_total", reason="sha_mismatch") == 2.0
    assert m.get("fedtier_rejected_total", reason="truncated") == 3.0
    assert m.get("fedtier_rejected_total") == 0.0  # the unlabelled series does not exist
    assert m.get("never_touched", reason="x") == 0.0
    assert m.total("fedtier_rejected_total") == 5.0
    assert m.total("never_touched") == 0.0
    assert m.get("fedtier_round") == 5.0


def test_label_order_does_not_matter_and_values_are_stringified() -> None:
    m = Metrics()

    m.inc("x_total", a=1, b="two")
    m.inc("x_total", b="two", a="1")

    assert m.get("x_total", a="1", b="two") == 2.0


def test_snapshot() -> None:
    m = Metrics(node="n1")
    m.inc("x_total", reason="a")
    m.set("g", 2.5)

    snap = m.snapshot()

    assert snap["x_total"] == {"reason=a": 1.0}
    assert snap["g"] == {"": 2.5}


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_render_is_the_prometheus_exposition_format() -> None:
    # Prepare: label values with every character the format escapes.
    m = Metrics(node="edge-1", role="edge")
    nasty = 'a "quoted" back\\slash\nnewline'
    m.inc("fedtier_rejected_total", reason=nasty)
    m.inc("fedtier_rejected_total", 2, reason="plain")
    m.set("fedtier_round", 3)

    # Execute: parse it back with prometheus_client's own parser.
    families = _families(m.render())

    # Assert
    assert families["fedtier_rejected"].type == "counter"
    samples = {s.labels["reason"]: s.value for s in families["fedtier_rejected"].samples
               if s.name == "fedtier_rejected_total"}
    assert samples == {nasty: 1.0, "plain": 2.0}
    [round_sample] = families["fedtier_round"].samples
    assert round_sample.labels == {"node": "edge-1", "role": "edge"} and round_sample.value == 3.0


@pytest.mark.parametrize("value", [1234567, 2**31 + 3, 98765432.0, 0.1234567])
def test_render_keeps_full_precision(value: float) -> None:
    """Byte counters pass a million quickly; a scrape must see every digit."""
    m = Metrics()
    m.inc("fedtier_test_bytes_total", value)

    [sample] = [s for s in _families(m.render())["fedtier_test_bytes"].samples if s.name.endswith("_total")]

    assert sample.value == float(value)


def test_histogram_buckets_count_and_sum() -> None:
    m = Metrics(node="cloud")
    for seconds in (0.02, 0.3, 0.3, 7.0):
        m.observe("fedtier_round_seconds", seconds)

    families = _families(m.render())

    assert families["fedtier_round_seconds"].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in families["fedtier_round_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.05"] == 1 and buckets["0.5"] == 3 and buckets["10.0"] == 4 and buckets["+Inf"] == 4
    assert m.get("fedtier_round_seconds") == 4  # a histogram's value is its count
    assert m.snapshot()["fedtier_round_seconds_sum"][""] == pytest.approx(7.62)


def test_a_name_keeps_its_kind_and_its_label_names() -> None:
    m = Metrics()
    m.inc("x_total", reason="a")

    with pytest.raises(ValueError, match="labels"):
        m.inc("x_total", cell="c1")
    with pytest.raises(ValueError, match="counter"):
        m.set("x_total", 1, reason="a")


@dataclass
class _FakeTransport:
    traffic: Traffic


def test_watched_transports_export_messages_and_bytes_per_tier_and_direction() -> None:
    # Prepare: an edge with two connections (cell side and cloud side).
    cell, cloud = Traffic(), Traffic()
    cell.count("in", "ft/v1/r/cell/c1/up/d1/device_update", 100)
    cell.count("in", "ft/v1/r/cell/c1/up/d2/device_update", 50)
    cell.count("out", "ft/v1/r/cell/c1/down/cell_task", 30)
    cloud.count("out", "ft/v1/r/edge/c1/up/cell_update", 70)
    cloud.count("in", "ft/v1/status/d1", 5)
    m = Metrics(node="c1", role="edge")
    m.watch(_FakeTransport(cell))
    shared = _FakeTransport(cloud)
    m.watch(shared)
    m.watch(shared)  # one connection watched twice is counted once

    # Assert: read back, and scraped.
    assert m.get(BYTES, tier="device_edge", direction="in") == 150
    assert m.get(MESSAGES, tier="device_edge", direction="in") == 2
    assert m.get(BYTES, tier="device_edge", direction="out") == 30
    assert m.get(BYTES, tier="edge_cloud", direction="out") == 70
    assert m.get(MESSAGES, tier="presence", direction="in") == 1
    assert m.total(BYTES) == 255
    cell.count("in", "ft/v1/r/cell/c1/up/d1/device_update", 1)  # read at scrape time, never stale
    assert m.get(BYTES, tier="device_edge", direction="in") == 151
    scraped = {(s.labels["tier"], s.labels["direction"]): s.value
               for s in _families(m.render())["fedtier_bytes"].samples if s.name == BYTES}
    assert scraped == {("device_edge", "in"): 151, ("device_edge", "out"): 30, ("edge_cloud", "out"): 70,
                       ("presence", "in"): 5}


def test_concurrent_increments_are_not_lost() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(2000):
            m.inc("x_total", k="v")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    assert m.get("x_total", k="v") == 8000.0


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Metrics, str]]:
    m = Metrics(node="edge-1")
    server = m.serve(0)  # port 0: the OS picks a free port
    host, port = server.server_address[:2]
    try:
        yield m, f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()


def test_serve_metrics_over_http(served: tuple[Metrics, str]) -> None:
    m, base = served
    m.inc("fedtier_rejected_total", reason="truncated")

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        body = resp.read().decode()
        status, ctype = resp.status, resp.headers["Content-Type"]

    assert status == 200
    assert ctype.startswith("text/plain")
    families = _families(body)
    [sample] = [s for s in families["fedtier_rejected"].samples if s.name == "fedtier_rejected_total"]
    assert sample.labels == {"node": "edge-1", "reason": "truncated"} and sample.value == 1.0
    # The process's own metrics come with the scrape.
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["process_cpu_seconds"].samples[0].value > 0


def test_serve_reflects_later_updates(served: tuple[Metrics, str]) -> None:
    m, base = served
    m.set("g", 1)
    urllib.request.urlopen(f"{base}/metrics", timeout=5).close()
    m.set("g", 2)

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        body = resp.read().decode()

    assert _families(body)["g"].samples[0].value == 2.0


def _source_metric_names() -> set[str]:
    """Every ``fedtier_*`` series name the packages' sources spell out (constants and literal names)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    names: set[str] = set()
    for package in ("fedtier", "cloud_coordinator", "edge_broker", "device_agent"):
        for path in (root / package).rglob("*.py"):
            names |= set(re.findall(r'"(fedtier_[a-z_]+)"', path.read_text()))
    return names - {"fedtier_read_only", "fedtier_user_model_"}  # a database role, a module prefix


def test_every_series_has_a_real_help_text_and_no_created_series() -> None:
    from fedtier.runtime.metrics import DOCS

    names = _source_metric_names()
    m = Metrics(node="edge-1", role="edge")
    for name in sorted(names - {MESSAGES, BYTES}):  # those two the traffic collector always exports
        if name.endswith("_total"):
            m.inc(name, reason="x")
        elif name.endswith("_seconds") and not name.endswith("_timestamp_seconds"):
            m.observe(name, 1.0)
        else:
            m.set(name, 1.0)

    families = _families(m.render())

    assert len(names) >= 20 and names <= set(DOCS), sorted(names - set(DOCS))
    for family in families.values():
        placeholder = family.name.replace("_", " ")
        assert family.documentation not in (placeholder, f"{placeholder} total"), family.name
        assert not any(s.name.endswith("_created") for s in family.samples), family.name


def test_every_series_is_in_the_operations_runbook() -> None:
    """docs/operations.md's metrics table names every series (its label column too)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[4] / "docs" / "operations.md").read_text()
    section = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(fedtier_[a-z_]+)` \|", section, re.MULTILINE))

    assert _source_metric_names() <= documented, sorted(_source_metric_names() - documented)


def test_an_included_node_is_exported_with_the_host_in_one_family_per_name() -> None:
    host = Metrics(node="cloud", role="cloud")
    hosted = Metrics(node="cloud", role="cloud", rollout="r1")
    host.inc("fedtier_rejected_total", reason="bad_magic")
    hosted.inc("fedtier_rejected_total", reason="late")
    hosted.set("fedtier_round", 3)

    host.include(hosted)
    both = _families(host.render())
    host.exclude(hosted)
    alone = _families(host.render())

    assert {tuple(sorted(s.labels.items())) for s in both["fedtier_rejected"].samples} == {
        (("node", "cloud"), ("reason", "bad_magic"), ("role", "cloud")),
        (("node", "cloud"), ("reason", "late"), ("role", "cloud"), ("rollout", "r1"))}
    assert both["fedtier_round"].samples[0].labels["rollout"] == "r1"
    assert "fedtier_round" not in alone and len(alone["fedtier_rejected"].samples) == 1
