"""Hierarchical FedBuff hosted by the real shells (agent, edge service, coordinator) over Mosquitto.

With ``once_per_version``, ``k_edge`` = devices per cell and ``k_cloud`` = cells, every model version averages
every device once whatever order the deltas arrive in, so the rollout over MQTT must end with the model the
trace simulator computes for the same config and seed.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from fleet_threads import ThreadFleet

from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load
from local_fleet.configs import FleetPaths
from local_fleet.simulate import simulate

pytestmark = pytest.mark.broker

FEDBUFF = {"local_steps": 5, "lr": 0.1, "batch_size": 16, "k_edge": 2, "k_cloud": 2, "once_per_version": True}


def fedbuff_rollout(small_rollout, tmp_path: Path, **fedbuff: object) -> dict:
    cfg = small_rollout(algorithm="fedbuff", rounds=3, fedbuff={**FEDBUFF, **fedbuff})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain.pop("fedavg", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    return plain


@contextmanager
def coordinator_store(paths: FleetPaths) -> Iterator[tuple[CoordinatorStore, str]]:
    """The store the fleet's coordinator committed to, and its rollout id."""
    from fedtier.rollout.config import RolloutConfig

    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        yield store, cfg.rollout
    finally:
        store.close()


def test_fedbuff_over_mosquitto_equals_the_simulator(mosquitto, small_rollout, tmp_path: Path) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    # Prepare: 2 cells x 2 devices, one delta from every device per version.
    plain = fedbuff_rollout(small_rollout, tmp_path)
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})

    # Execute
    cloud = ThreadFleet.run(paths, timeout=120)

    # Assert: three versions, each from all four devices at staleness 0, and the simulator's model.
    with coordinator_store(paths) as (store, rollout):
        over_mqtt, initial = store.latest_model(rollout), store.model(rollout, 0)
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.version == 3
    assert [r["devices_reported"] for r in cloud.history] == [4, 4, 4]
    assert initial is not None
    moved = max(float(np.abs(over_mqtt.params[n] - initial.params[n]).max()) for n in initial.params)
    assert moved > 1e-2  # trained: the equality below is not of two untouched models
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)


def test_fedbuff_with_privacy_over_mosquitto_charges_every_release_once(
        mosquitto, small_rollout, tmp_path: Path) -> None:
    """cell-a trusted (its edge noises each cell update), cell-b not (its devices noise each upload): the ledger
    holds one row per release that reached the cloud, and every device's epsilon equals the trace simulator's."""
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    plain = fedbuff_rollout(small_rollout, tmp_path)
    plain["topology"] = {**plain["topology"], "trusted": {"cell-a": True}}
    plain["privacy"] = {"epsilon": 8.0, "delta": 1e-5, "clip": 1.0, "require_tls": False}
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})

    cloud = ThreadFleet.run(paths, timeout=120)

    with coordinator_store(paths) as (store, rollout):
        rows = store.privacy_releases(rollout)
    # 3 versions: cell-a's edge released once per version over its 2 devices; cell-b's 2 devices once each
    edge_rows = [r for r in rows if r["event"] == "edge"]
    device_rows = [r for r in rows if r["event"] == "device"]
    assert len(edge_rows) == 3 and {r["node"] for r in edge_rows} == {"cell-a"}
    assert len(device_rows) == 6 and all(r["parent"] == "cell-b" and r["observed"] for r in device_rows)
    assert len({(r["round"], r["node"], r["step"]) for r in rows}) == len(rows)
    live = cloud.history[-1]["privacy"]
    sim_cfg = RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")})
    simulate(sim_cfg)
    simulated = json.loads(Path(sim_cfg.metrics_path).read_text())["privacy"]
    assert simulated["releases"] == len(rows) and simulated["max_releases_per_device"] == 3
    assert set(live["epsilon"]) == {d for r in rows for d in r["protected"]}
    assert live["epsilon_max"] == pytest.approx(simulated["epsilon_max"], rel=1e-6)
    assert 0 < live["epsilon_max"] <= 8.0
    # the audit recomputes every epsilon from the rows and finds the live values and clear hops in order
    from click.testing import CliRunner

    from fedtier.cli import cli

    result = CliRunner().invoke(cli, ["privacy", "report", "--config", str(paths.coordinator), "--json",
                                       "--out", str(tmp_path / "eps.png")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["warnings"] == [] and all(d["agrees"] for d in report["devices"])
    assert report["clear_hops"]["all_to_trusted"] and report["clear_hops"]["total"] == 6
