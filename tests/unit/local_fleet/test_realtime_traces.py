"""The emulator's availability on the real clock: the simulator's traces (same spec, seed and device ids), the
day scaled to ``day_s`` real seconds and each training's time with it; and the options checked, each error naming
its ``fleet emulate`` flag."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedtier.errors import ConfigError
from fedtier.rollout.availability import AvailabilitySpec, make_traces
from fedtier.rollout.config import RolloutConfig
from local_fleet.emulator import EmulatorOptions, check_availability, rollout_mapping
from local_fleet.realtime_traces import RealTimeTraces

DEVICES = [f"dev-{i:02d}" for i in range(20)]


def test_the_simulators_traces_on_a_day_of_two_minutes() -> None:
    spec = AvailabilitySpec(availability="diurnal", share_online=0.5, compute_s=60.0, speed_sigma=1.0)
    rt = RealTimeTraces.build(spec, 7, DEVICES, real_day_s=120.0, epoch=1000.0)
    virtual = make_traces(spec, 7, DEVICES)

    assert rt.traces == virtual
    assert rt.scale == pytest.approx(120.0 / 86_400)
    for device in DEVICES:
        # a training takes train_s * day_s / 86,400 real seconds: the median device's minute is 83 ms
        assert rt.train_delay_s(device) == pytest.approx(virtual[device].train_s * 120.0 / 86_400)
        for v in (0.0, 3_600.0, 40_000.0, 86_399.0, 100_000.0):
            assert rt.online(device, 1000.0 + v * rt.scale) == virtual[device].online_at(v)
        change = rt.next_change(device, 1000.0)
        assert change == pytest.approx(1000.0 + virtual[device].next_change(0.0) * rt.scale)
        # just either side of the change, the device's state differs
        assert rt.online(device, change - 1e-3) != rt.online(device, change + 1e-3)
        # near it (for the tests that read the broker) within the margin, not beyond (a window is 60 s long)
        assert rt.within(device, change + 0.2, 0.3) and rt.within(device, change - 0.2, 0.3)
        assert not rt.within(device, change + 1.0, 0.3) and not rt.within(device, change - 1.0, 0.3)
    assert 5 <= rt.online_count(1000.0) <= 15


def test_always_never_changes() -> None:
    rt = RealTimeTraces.build(AvailabilitySpec(), 0, DEVICES, real_day_s=60.0)
    assert all(rt.online(d, rt.epoch + 1e6) for d in DEVICES)
    assert all(math.isinf(rt.next_change(d, rt.epoch)) for d in DEVICES)


def test_the_emulated_rollout_carries_its_fleet_section(tmp_path: Path) -> None:
    opts = EmulatorOptions(devices=20, cells=2, availability="diurnal", share_online=0.25, compute_s=30.0)
    mapping = rollout_mapping(opts)
    assert mapping["fleet"] == {"availability": "diurnal", "share_online": 0.25, "compute_s": 30.0}
    cfg = RolloutConfig.from_mapping(mapping)
    assert cfg.fleet is not None and cfg.fleet.spec() == AvailabilitySpec(availability="diurnal", share_online=0.25,
                                                                           compute_s=30.0)
    assert "fleet" not in rollout_mapping(EmulatorOptions(devices=20, cells=2))
    assert rollout_mapping(EmulatorOptions(quorum=0.4))["fedavg"]["quorum"] == 0.4


@pytest.mark.parametrize(("options", "key", "flag"), [
    ({"availability": "diurnal", "share_online": 1.5}, "share_online", "--share-online"),
    ({"availability": "diurnal", "share_online": 0.0}, "share_online", "--share-online"),
    ({"availability": "always", "share_online": 0.5}, "share_online", "--share-online"),
    ({"availability": "diurnal", "compute_s": -1.0}, "compute_s", "--compute-s"),
    ({"availability": "diurnal", "speed_sigma": -0.1}, "speed_sigma", "--speed-sigma"),
    ({"availability": "file"}, "trace_file", "--trace-file"),
    ({"availability": "weekly"}, "availability", "--availability"),
    ({"share_online": 0.5}, "share_online", "--share-online"),
    ({"availability": "diurnal", "day_s": 0.0}, "day_s", "--day-s"),
    ({"availability": "diurnal", "loop": "threads"}, "loop", "--loop"),
    ({"availability": "diurnal", "rollout": {"fleet": {"availability": "always"}}}, "availability", "--availability"),
])
def test_bad_availability_options_are_refused_naming_the_option(options: dict, key: str, flag: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_availability(EmulatorOptions(**options))
    assert caught.value.key == key and flag in str(caught.value)


def test_a_trace_file_is_read_and_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": {"dev-00": {"windows": [[5, 1]]}}}))
    with pytest.raises(ConfigError) as caught:
        check_availability(EmulatorOptions(availability="file", trace_file=bad))
    assert caught.value.key == "trace_file" and "--trace-file" in str(caught.value)

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"period_s": 86_400, "devices": {d: {"windows": [[0, 43_200]]} for d in DEVICES}}))
    opts = EmulatorOptions(availability="file", trace_file=good)
    check_availability(opts)
    rt = RealTimeTraces.build(RolloutConfig.from_mapping(rollout_mapping(opts)).fleet.spec(), 0, DEVICES, 10.0,
                              epoch=0.0)  # type: ignore[union-attr]
    assert rt.online_count(2.0) == 20 and rt.online_count(7.0) == 0  # online the first half of every 10 s
