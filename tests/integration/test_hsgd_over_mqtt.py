"""HSGD over a real Mosquitto: every node its own MQTT connection on fedtier's topic tree; the model equals the
in-process run for the same seeds (to 1e-5), and a silent selected device does not stall an interval."""

from __future__ import annotations

from typing import Any

import numpy as np

from local_fleet import hsgd_loop
from local_fleet import hsgd_reference as ref
from fedtier.algorithms.hsgd import HsgdConfig, select
from fedtier.training import split

ARCH = split.SplitArch(x1=12, x2=8, d1=8, d2=8, classes=3)


def setup(**kw: Any) -> tuple[dict[str, hsgd_loop.HybridCell], HsgdConfig, dict[str, np.ndarray]]:
    groups, _ = ref.fixture(4, sizes=(8, 12))
    cells = hsgd_loop.make_cells(groups)
    config = HsgdConfig(global_interval=4, local_interval=2, alpha=0.5, lr=0.05, seed=4,
                        hosts={c: d.host for c, d in cells.items()}, **kw)
    return cells, config, split.init_params(ARCH, 4)


def test_mqtt_equals_the_in_process_run(mosquitto: Any) -> None:
    cells, config, init = setup()
    memory = hsgd_loop.run(cells, init, config, rounds=2, rollout="hsgd-mq")
    bus = hsgd_loop.MqttBus(mosquitto.host, mosquitto.port, "hsgd-mq", cells)
    over_mqtt = hsgd_loop.run(cells, init, config, rounds=2, rollout="hsgd-mq", bus=bus, keep_trace=True)
    assert max(float(np.abs(over_mqtt.params[k] - memory.params[k]).max()) for k in init) < 1e-5
    assert max(float(np.abs(over_mqtt.params[k] - init[k]).max()) for k in init) > 1e-3
    assert over_mqtt.bytes == memory.bytes and not over_mqtt.rejected
    kinds = {k for *_, k, _, _ in [(s, r, kind, rr, st) for s, r, kind, rr, st in over_mqtt.trace]}
    assert {"cell_task", "device_task", "hsgd_embeddings", "hsgd_partner", "device_update", "cell_update"} <= kinds


def test_a_silent_device_over_mqtt_waits_for_the_deadline_only(mosquitto: Any) -> None:
    cells, config, init = setup(deadline_s=1.0)
    silent = select(cells["cell0"].devices, 0.5, 4, "hsgd-silent", "cell0", 0, 0)[0]
    bus = hsgd_loop.MqttBus(mosquitto.host, mosquitto.port, "hsgd-silent", cells, timeout_s=2.0)
    res = hsgd_loop.run(cells, init, config, rounds=1, rollout="hsgd-silent", bus=bus, silent=[silent])
    assert len(res.rounds) == 1
    first = res.edges["cell0"].history[0]
    assert silent in first["selected"] and silent not in first["rows"]


def test_hsgd_demo_refuses_privacy_and_runs_small_on_the_embedded_broker() -> None:
    import json

    from click.testing import CliRunner

    from commands.demo import demo

    out = CliRunner().invoke(demo, ["--algorithm", "hsgd", "--privacy"])
    assert out.exit_code == 2 and "hsgd does not run under --privacy" in out.output
    out = CliRunner().invoke(demo, ["--algorithm", "hsgd", "--devices", "16", "--rounds", "3", "--broker", "embedded",
                                    "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["broker"] == "embedded" and doc["devices"] == 16 and len(doc["rounds"]) == 3
    assert doc["bytes"]["vertical"] > 0 and doc["paper_bytes"] > 0
