"""Availability and speed traces: shares, windows, speeds, files, and the [fleet] config's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedtier.errors import ConfigError
from fedtier.rollout.availability import (
    AvailabilitySpec,
    DeviceTrace,
    load_trace_file,
    make_traces,
    share_online,
    speed_quantiles,
)
from fedtier.rollout.config import RolloutConfig

DEVICES = [f"dev-{i:04d}" for i in range(2000)]


@pytest.mark.parametrize("share", [0.1, 0.3])
def test_diurnal_traces_keep_the_share_online_at_any_time(share: float) -> None:
    traces = make_traces(AvailabilitySpec("diurnal", share), seed=0, devices=DEVICES)
    # 2,000 devices: the share online at any instant is binomial(2000, ~share); 4 sigma < 0.03.
    for t in np.linspace(0, 3 * 86_400, 13):
        assert abs(share_online(traces, float(t)) - share) < 0.03, t


def test_a_diurnal_window_is_share_of_the_day_long_and_repeats_daily() -> None:
    traces = make_traces(AvailabilitySpec("diurnal", 0.25), seed=3, devices=DEVICES[:200])
    for trace in traces.values():
        assert sum(e - s for s, e in trace.windows) == pytest.approx(0.25 * 86_400)
    one = next(t for t in traces.values() if len(t.windows) == 1)
    [(start, end)] = one.windows
    assert not one.online_at(start - 1) and one.online_at(start) and not one.online_at(end)
    assert one.online_at(start + 86_400) and one.next_online(end) == pytest.approx(start + 86_400)
    assert one.next_change(start) == pytest.approx(end)
    # A window across midnight wraps: online from its start through midnight, no change at midnight itself.
    wrapped = next(t for t in traces.values() if len(t.windows) == 2)
    (_, tail_end), (start, day_end) = wrapped.windows
    assert day_end == 86_400 and wrapped.online_at(86_400) and wrapped.online_at(86_400 - 1)
    assert wrapped.next_change(start) == pytest.approx(86_400 + tail_end)


def test_always_online_never_changes() -> None:
    trace = make_traces(AvailabilitySpec(), seed=0, devices=["d"])["d"]
    assert trace.online_at(0.0) and trace.online_at(1e9) and trace.next_change(5.0) == math.inf
    assert trace.next_online(7.0) == 7.0


def test_speeds_are_heavy_tailed_seeded_and_per_device() -> None:
    spec = AvailabilitySpec(compute_s=60.0, speed_sigma=1.0)
    a = make_traces(spec, seed=0, devices=DEVICES)
    median, p90, p99 = speed_quantiles(a)
    # lognormal(ln 60, 1): median 60 s, p90 60 e^1.28 = 216 s, p99 60 e^2.33 = 615 s (2,000 draws).
    assert 54 < median < 66 and 180 < p90 < 260 and 450 < p99 < 800
    assert make_traces(spec, seed=0, devices=DEVICES[:5]) == {d: a[d] for d in DEVICES[:5]}
    assert make_traces(spec, seed=1, devices=DEVICES[:5]) != {d: a[d] for d in DEVICES[:5]}
    flat = make_traces(AvailabilitySpec(speed_sigma=0.0), seed=0, devices=DEVICES[:5])
    assert {t.train_s for t in flat.values()} == {60.0}


def test_trace_file_gives_windows_and_speeds(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"period_s": 100, "devices": {"a": {"windows": [[10, 20], [50, 60]], "speed": 2.0},
                                                             "b": {"windows": [[0, 100]]}}}))
    traces = make_traces(AvailabilitySpec("file", compute_s=60.0, trace_file=path), seed=0, devices=["a", "b"])
    assert traces["a"].train_s == 30.0 and traces["a"].windows == ((10.0, 20.0), (50.0, 60.0))
    assert traces["a"].online_at(115) and not traces["a"].online_at(125) and traces["a"].next_online(125) == 150
    assert traces["b"].online_at(42)


@pytest.mark.parametrize("content, words", [
    ("not json", "cannot read"),
    (json.dumps({"devices": {"a": {"windows": [[20, 10]]}}}), "sorted, disjoint"),
    (json.dumps({"devices": {"a": {"windows": [[0, 10]], "speed": -1}}}), "speed"),
    (json.dumps({"nodes": {}}), "'devices'"),
])
def test_a_bad_trace_file_names_the_key(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_trace_file(path)
    assert info.value.key == "fleet.trace_file" and words in str(info.value)


def test_a_device_missing_from_the_trace_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": {"a": {"windows": [[0, 10]]}}}))
    with pytest.raises(ConfigError, match="'b'") as info:
        make_traces(AvailabilitySpec("file", trace_file=path), seed=0, devices=["a", "b"])
    assert info.value.key == "fleet.trace_file"


def test_windows_must_be_sorted_and_disjoint() -> None:
    with pytest.raises(ValueError):
        DeviceTrace(((0.0, 10.0), (5.0, 20.0)), 1.0)


@pytest.mark.parametrize("fleet, key", [
    ({"availability": "sometimes"}, "fleet.availability"),
    ({"availability": "always", "share_online": 0.5}, "fleet.share_online"),
    ({"availability": "file"}, "fleet.trace_file"),
    ({"availability": "diurnal", "share_online": 0.0}, "fleet.share_online"),
    ({"availability": "diurnal", "speed_sigma": -1}, "fleet.speed_sigma"),
    ({"availabilty": "diurnal"}, "fleet.availabilty"),
])
def test_fleet_config_errors_name_the_bad_key(fleet: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig.from_mapping({"fleet": fleet})
    assert f"[{key}]" in str(info.value)


def test_a_fleet_section_gives_its_spec() -> None:
    cfg = RolloutConfig.from_mapping({"fleet": {"availability": "diurnal", "share_online": 0.1, "compute_s": 30}})
    assert cfg.fleet is not None
    assert cfg.fleet.spec() == AvailabilitySpec("diurnal", 0.1, compute_s=30.0)
    assert RolloutConfig.from_mapping({}).fleet is None
