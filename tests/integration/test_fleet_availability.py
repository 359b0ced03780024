"""``fedtier fleet emulate --availability``: the simulator's availability traces played in real time through the
test's Mosquitto. The broker sees about half a diurnal fleet at share 0.5, and exactly the devices their traces
say (up to the instants a window opens or closes); FedAvg with a quorum and FedBuff both finish under the traces,
every local training begins while its device is online, and devices offline as the rollout started train once
their windows open (their edges give them work again on their ``online`` presence)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from local_fleet.emulator import EmulatorOptions, FleetEmulator

pytestmark = [pytest.mark.broker, pytest.mark.fleet]  # fleets of worker processes: one at a time

MARGIN_S = 0.6
"""Real seconds around a window's edge where the broker may still show the device as it was (the mux acts on the
edge within its loop's pass, the broker delivers the presence after)."""


class _Presence:
    """The broker's view: every device's retained presence (``ft/v1/status/<cell>/<device>``), as it changes."""

    def __init__(self, host: str, port: int) -> None:
        self.state: dict[str, bool] = {}
        self.lock = threading.Lock()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="availability-watcher")
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.subscribe("ft/v1/status/+/+", qos=1)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        device = msg.topic.rsplit("/", 1)[1]
        online = bool(msg.payload) and json.loads(msg.payload).get("state") == "online"
        with self.lock:
            self.state[device] = online

    def online(self) -> set[str]:
        with self.lock:
            return {device for device, up in self.state.items() if up}

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _run(opts: EmulatorOptions, during: Any = None) -> tuple[FleetEmulator, Any]:
    """Run the emulator on a thread; ``during(emulator)`` runs on this one once every device is started."""
    said: list[str] = []
    emulator = FleetEmulator(opts, progress=said.append)
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = emulator.run()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    if during is not None:
        deadline = time.monotonic() + 120
        while not any(line.startswith(f"started {opts.devices} of") for line in said):
            assert thread.is_alive() and time.monotonic() < deadline, f"the devices did not start: {out}"
            time.sleep(0.05)
        during(emulator)
    thread.join(300)
    assert not thread.is_alive(), "the emulated rollout did not finish in 300 s"
    if "error" in out:
        raise out["error"]
    return emulator, out["result"]


def _check_runs_began_online(emulator: FleetEmulator) -> None:
    """Every local training began while its device's trace says it was online (a device away handles nothing)."""
    traces = emulator.traces
    assert traces is not None and emulator.runs
    for _, device, _, _, began in emulator.runs:
        assert traces.online(device, began) or traces.within(device, began, MARGIN_S), (device, began)


@pytest.mark.slow
def test_a_diurnal_fleet_at_share_half_is_half_connected_and_as_its_traces_say(mosquitto: Any,
                                                                               tmp_path: Path) -> None:
    watcher = _Presence(mosquitto.host, mosquitto.port)
    samples: list[tuple[set[str], set[str], set[str]]] = []  # (broker's online, trace's online, near an edge)

    def sample(emulator: FleetEmulator) -> None:
        traces = emulator.traces
        assert traces is not None
        time.sleep(1.0)  # the last devices' CONNACKs and presence
        for _ in range(16):
            if len(emulator.online) >= opts.rounds - 1:
                break  # the rollout is ending: its devices' closes are no trace's
            now = time.monotonic()
            seen = watcher.online()
            samples.append((seen, {d for d in traces.traces if traces.online(d, now)},
                            {d for d in traces.traces if traces.within(d, now, MARGIN_S)}))
            time.sleep(0.5)

    opts = EmulatorOptions(devices=20, cells=2, rounds=25, broker=f"{mosquitto.host}:{mosquitto.port}",
                           workdir=tmp_path / "fleet", availability="diurnal", share_online=0.5, day_s=6.0,
                           quorum=0.3, deadline_s=0.5)
    try:
        emulator, result = _run(opts, during=sample)
    finally:
        watcher.close()

    assert len(samples) >= 10
    for seen, expected, near in samples:
        assert seen ^ expected <= near, f"broker {sorted(seen)} vs trace {sorted(expected)} (near an edge: {near})"
    shares = [len(seen) / 20 for seen, _, _ in samples]
    assert 0.3 <= sum(shares) / len(shares) <= 0.7 and max(shares) < 1.0 and min(shares) > 0.0
    # over 5 s and more (most of a day) devices both came and went
    assert len({frozenset(seen) for seen, _, _ in samples}) > 2
    assert [r.round for r in result.rounds] == list(range(25))
    assert all(r.online is not None and r.online < 20 for r in result.rounds)
    _check_runs_began_online(emulator)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
def test_fedavg_and_fedbuff_finish_under_the_traces_and_late_devices_contribute(mosquitto: Any, tmp_path: Path,
                                                                                algorithm: str) -> None:
    opts = EmulatorOptions(devices=20, cells=2, rounds=6, broker=f"{mosquitto.host}:{mosquitto.port}",
                           workdir=tmp_path / "fleet", algorithm=algorithm, availability="diurnal",
                           share_online=0.5, day_s=6.0, compute_s=3600.0, quorum=0.3, deadline_s=1.0)

    emulator, result = _run(opts)

    traces, started = emulator.traces, emulator.rollout_started
    assert traces is not None and started is not None
    assert [r.round for r in result.rounds] == list(range(6))
    assert result.rounds[-1].accuracy is not None
    if algorithm == "fedbuff":
        assert all(r.devices_reported == 10 for r in result.rounds)  # k_edge 5 in each of 2 cells, unchanged
    else:
        assert all(1 <= r.devices_reported < 20 for r in result.rounds)  # rounds closed without the offline ones
    _check_runs_began_online(emulator)
    late = {d for d in traces.traces if not traces.online(d, started) and not traces.within(d, started, MARGIN_S)}
    trained = {device for _, device, _, _, began in emulator.runs if began > started}
    assert late and late & trained, f"none of the devices offline at the start ({sorted(late)}) trained"
    # a training holds its device its trace's time (an hour of the day: 6 s / 24 = 0.25 s at the median)
    for _, device, total, _, _ in emulator.runs:
        assert total >= traces.train_delay_s(device)
    assert any("availability and speed traces in real time" in note for note in result.notes)
