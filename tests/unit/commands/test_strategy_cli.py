"""Strategy options of ``fedtier simulate`` and ``fedtier demo``: what they write into the rollout, what they refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedtier.rollout.config import RolloutConfig
from local_fleet.demo import CollectingView, Demo, DemoOptions
from commands.strategy_options import overrides
from fedtier.cli import cli
from fedtier.runtime.config import dumps_toml, read_toml

EVERY = ["--edge-aggregator", "multi_krum", "--cloud-aggregator", "median", "--trim", "0.2", "--byzantine", "1",
         "--select", "3", "--max-norm", "2", "--server-optimizer", "yogi", "--server-lr", "0.02",
         "--edge-optimizer", "momentum", "--edge-lr", "0.5",
         "--attack", "sign_flip", "--attack-fraction", "0.25", "--attack-scale", "5", "--proximal-mu", "0.01",
         "--partial-work"]


def values(**given: Any) -> dict[str, Any]:
    from commands.strategy_options import NAMES

    return {**{n: None for n in NAMES}, "partial_work": False, **given}



def test_every_option_lands_in_its_table() -> None:
    out = overrides(values(edge_aggregator="median", trim=0.2, server_optimizer="adam", server_lr=0.03,
                           attack="gaussian", attack_scale=2.0, proximal_mu=0.01, partial_work=True), "fedavg")
    assert out == {"aggregation": {"edge": "median", "trim": 0.2}, "server_optimizer": {"kind": "adam", "lr": 0.03},
                   "attack": {"kind": "gaussian", "scale": 2.0}, "fedavg": {"proximal_mu": 0.01, "partial_work": True}}
    assert overrides(values(), "fedavg") == {}


def test_the_demo_writes_every_option_into_its_fleet(tmp_path: Path) -> None:
    extra = overrides(values(edge_aggregator="multi_krum", byzantine=1, select=3, cloud_aggregator="median",
                             server_optimizer="yogi", attack="label_flip", attack_fraction=0.25, proximal_mu=0.01,
                             partial_work=True), "fedavg")
    view = CollectingView()
    demo = Demo(DemoOptions(workdir=tmp_path, devices=10, cells=2, strategy=extra), view)
    config = demo.rollout_config()
    cfg = RolloutConfig.from_mapping({**config, "state_dir": str(tmp_path / "c")})
    assert cfg.aggregation is not None and cfg.aggregation.edge == "multi_krum" and cfg.aggregation.cloud == "median"
    assert cfg.server_optimizer is not None and cfg.server_optimizer.kind == "yogi"
    assert cfg.fedavg.proximal_mu == 0.01 and cfg.fedavg.partial_work and cfg.fedavg.local_steps == 20
    paths = demo.write_configs(1883)
    attacked = {d for d, p in paths.devices.items() if "attack" in read_toml(p)}
    assert attacked == set(cfg.attackers()) and len(attacked) == 2
    table = read_toml(paths.devices[sorted(attacked)[0]])["attack"]
    assert table == {"kind": "label_flip", "scale": 10.0, "seed": 0, "classes": 10}
    out = demo.announce_strategy(paths.coordinator)
    assert out["attack"]["devices"] == sorted(attacked)
    assert any(line.startswith("ATTACK RUN: label_flip") for line in view.lines)


@pytest.mark.parametrize(("args", "message"), [
    (["--server-lr", "0.1"], "--server-lr needs --server-optimizer"),
    (["--edge-lr", "0.1"], "--edge-lr needs --edge-optimizer"),
    (["--attack-fraction", "0.1"], "--attack-fraction need --attack"),
    (["--algorithm", "qhetfed", "--proximal-mu", "0.1"], "for fedavg and hier_qsgd, not qhetfed"),
])
def test_refused_combinations_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["demo", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_simulate_takes_every_option_and_marks_the_attack_run(small_rollout, tmp_path: Path) -> None:
    cfg = small_rollout(rounds=1, topology={"cells": 2, "devices_per_cell": 5},
                        metrics_file=str(tmp_path / "m.json"))
    path = tmp_path / "rollout.toml"
    path.write_text(dumps_toml(cfg.to_dict()))
    result = CliRunner().invoke(cli, ["simulate", "--config", str(path), "--json", *EVERY])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["attack"]["kind"] == "sign_flip" and len(doc["attack"]["devices"]) == 2
    row = doc["rounds"][0]
    assert row["attack"]["kind"] == "sign_flip"
    assert row["config"]["strategy"]["edge"]["rule"] == "multi_krum"
    assert row["config"]["strategy"]["server_optimizer"] == {"kind": "yogi", "lr": 0.02, "momentum": 0.9,
                                                             "beta1": 0.9, "beta2": 0.99, "tau": 0.001}
    assert row["config"]["partial_work"] is True
    assert row["config"]["strategy"]["edge_optimizer"]["kind"] == "momentum"
    bad = CliRunner().invoke(cli, ["simulate", "--config", str(path), "--edge-aggregator", "krum", "--byzantine", "3"])
    assert bad.exit_code != 0 and "aggregation.byzantine" in bad.output
