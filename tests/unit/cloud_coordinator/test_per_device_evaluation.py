"""Federated evaluation per device (issue 34, item 2): each device's own held-out accuracy, loss and (binary
tasks) AUROC in the round's row, ``rollout status`` (min / median / max, the worst devices), ``fedtier report`` (a
box per round) and one Prometheus gauge (the worst device's accuracy), never a series per device."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cloud_coordinator.observe.plots import PLOTS, figures
from cloud_coordinator.observe.prom import CoordinatorMetrics
from cloud_coordinator.observe.status import StoreStatus
from cloud_coordinator.store import CoordinatorStore
from fedtier.cli import cli
from fedtier.rollout.config import RolloutConfig
from fedtier.runtime.metrics import Metrics
from local_fleet.simulate import SimulationResult, simulate

ROUNDS = 3


def _config(tmp: Path, artifact_store: Path, rollout: str, **overrides: Any) -> RolloutConfig:
    mapping: dict[str, Any] = {
        "rollout": rollout, "rounds": ROUNDS, "seed": 5, "state_dir": str(tmp / "state"),
        "artifact_store": str(artifact_store), "model": {"kind": "mlp", "hidden": [16]},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "seed": 4, "holdout": 0.25},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "fedavg": {"local_steps": 5, "lr": 0.1, "batch_size": 16},
        **overrides}
    return RolloutConfig.from_mapping(mapping)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, artifact_store: Path) -> tuple[SimulationResult, Path]:
    """A finished rollout whose 6 devices (2 cells x 3, digits: ten classes) each hold out a quarter of their rows,
    simulated into a store on disk."""
    tmp = tmp_path_factory.mktemp("per-device")
    result = simulate(_config(tmp, artifact_store, "pd"), workdir=tmp / "run")
    return result, tmp / "run" / "coordinator.db"


def _evaluations_by_hand(result: SimulationResult, db: Path, rollout: str) -> list[dict[str, Any]]:
    """Per round: every device's held-out rows evaluated here, with the model version the round started from
    (as the store keeps it), by the coordinator's trainer; and the binary scores' AUROC with scikit-learn."""
    from sklearn.metrics import roc_auc_score

    from device_agent.trainers import make_trainer
    from fedtier.training.ranking import binary_scores

    trainer = make_trainer("ort", result.prepared.model_bundle)
    store = CoordinatorStore(db)
    out = []
    try:
        for row in store.rounds(rollout):
            model = store.model(rollout, row["federated"]["model_version"])
            assert model is not None
            trainer.set_parameters(model.params)
            expected: dict[str, Any] = {}
            for device, (x, y) in result.prepared.data.holdout.items():
                got = trainer.evaluate(x, y)
                expected[device] = {"accuracy": got.accuracy, "loss": got.loss, "examples": got.samples}
                scores = binary_scores(trainer.predict(x))
                if scores is not None and len(np.unique(y)) == 2:
                    expected[device]["auroc"] = float(roc_auc_score(y, scores))
            out.append(expected)
    finally:
        store.close()
    return out


def test_each_devices_accuracy_is_the_global_models_on_its_own_held_out_rows(run: tuple[SimulationResult, Path]
                                                                               ) -> None:
    result, db = run
    store = CoordinatorStore(db)
    rows = store.rounds("pd")
    store.close()
    by_hand = _evaluations_by_hand(result, db, "pd")

    assert [r["federated"]["model_version"] for r in rows] == list(range(ROUNDS))
    for row, simulated, expected in zip(rows, result.rounds, by_hand, strict=True):
        federated = row["federated"]
        per_device = federated["per_device"]
        assert per_device == simulated["federated"]["per_device"]  # metrics.json and the store agree
        assert sorted(per_device) == sorted(result.prepared.data.holdout) and len(per_device) == 6
        for device, own in per_device.items():
            want = expected[device]
            assert set(own) == {"accuracy", "loss", "examples"}  # ten classes: no AUROC
            assert own["examples"] == want["examples"]
            assert own["accuracy"] == pytest.approx(want["accuracy"], abs=1e-9)
            assert own["loss"] == pytest.approx(want["loss"], rel=1e-5)
        # the combined figure is the devices' own, weighted by their rows
        rows_held = sum(d["examples"] for d in per_device.values())
        assert federated["examples"] == rows_held and federated["devices"] == 6
        assert federated["accuracy"] == pytest.approx(
            sum(d["accuracy"] * d["examples"] for d in per_device.values()) / rows_held, abs=1e-9)
    assert len({d["accuracy"] for d in rows[-1]["federated"]["per_device"].values()}) > 1  # they differ: a spread


def test_on_a_binary_task_each_device_ranks_its_own_held_out_rows(tmp_path: Path, artifact_store: Path) -> None:
    # Prepare: a rare-event task (two classes), 4 devices holding out 30 % of their rows.
    cfg = _config(tmp_path, artifact_store, "bin", rounds=2, model={"kind": "mlp", "hidden": []},
                  topology={"cells": 2, "devices_per_cell": 2}, fedavg={"local_steps": 5, "lr": 0.3, "batch_size": 16},
                  data={"dataset": "rare_event", "partition": "iid", "samples": 600, "features": 10, "holdout": 0.3,
                        "seed": 4})
    # Execute
    result = simulate(cfg, workdir=tmp_path / "run")
    # Assert: each device's AUROC (numpy, on the device) is scikit-learn's on its rows with the same model.
    by_hand = _evaluations_by_hand(result, tmp_path / "run" / "coordinator.db", "bin")
    ranked = 0
    for row, expected in zip(result.rounds, by_hand, strict=True):
        for device, own in row["federated"]["per_device"].items():
            assert ("auroc" in own) == ("auroc" in expected[device])  # both classes held out, or no AUROC
            if "auroc" in own:
                ranked += 1
                assert own["auroc"] == pytest.approx(expected[device]["auroc"], abs=1e-9)
            assert own["accuracy"] == pytest.approx(expected[device]["accuracy"], abs=1e-9)
    assert ranked >= 4
    assert "auroc" not in result.rounds[-1]["federated"]  # the combination has none


def _spread(per_device: dict[str, dict[str, Any]]) -> tuple[float, float, float, list[str]]:
    accuracies = [d["accuracy"] for d in per_device.values()]
    worst = sorted(per_device, key=lambda d: (per_device[d]["accuracy"], -per_device[d]["loss"], d))[:3]
    return min(accuracies), statistics.median(accuracies), max(accuracies), worst


def test_rollout_status_shows_min_median_max_and_the_worst_devices(run: tuple[SimulationResult, Path]) -> None:
    result, db = run
    runner = CliRunner()

    as_json = runner.invoke(cli, ["rollout", "status", "pd", "--store", str(db), "--json"])
    as_text = runner.invoke(cli, ["rollout", "status", "pd", "--store", str(db)], env={"COLUMNS": "250"})

    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)["federated_per_device"]
    assert [r["round"] for r in doc] == list(range(ROUNDS))
    for entry, row in zip(doc, result.rounds, strict=True):
        per_device = row["federated"]["per_device"]
        low, median, high, worst = _spread(per_device)
        assert entry["metric"] == "accuracy" and entry["devices"] == 6
        assert (entry["min"], entry["max"]) == (low, high) and entry["median"] == pytest.approx(median, abs=1e-15)
        assert [w["device"] for w in entry["worst"]] == worst
        assert entry["worst"][0] == {"device": worst[0], **per_device[worst[0]]}
        assert entry["per_device"] == per_device  # --json carries every device
        assert entry["model_version"] == row["federated"]["model_version"]
    assert as_text.exit_code == 0, as_text.output
    assert "federated evaluation per device" in as_text.output
    low, median, high, worst = _spread(result.rounds[-1]["federated"]["per_device"])
    last = next(line for line in as_text.output.splitlines() if worst[0] in line and f"{low:.4f}" in line)
    assert f"{median:.4f}" in last and f"{high:.4f}" in last
    assert all(w in last for w in worst)


def test_the_report_draws_a_box_of_device_accuracies_per_round(run: tuple[SimulationResult, Path],
                                                               tmp_path: Path) -> None:
    result, db = run
    # Execute
    fig = figures(StoreStatus(db).rollout("pd"), only="device_accuracy")["device_accuracy"]
    written = CliRunner().invoke(cli, ["report", "pd", "--store", str(db), "--out", str(tmp_path / "r"), "--json"])
    # Assert: a titled plot with labelled axes; each round's median device is the box's median line, the
    # whiskers reach the worst and the best device, and the combined accuracy is marked beside it.
    ax = fig.axes[0]
    assert ax.get_title().startswith(PLOTS["device_accuracy"]) and "pd" in ax.get_title()
    assert "round" in ax.get_xlabel() and "(fraction correct)" in ax.get_ylabel()
    assert ax.get_legend() is not None
    medians = [line for line in ax.lines if line.get_color() == "tab:blue" and len(line.get_xdata()) == 2]
    rows = [r["federated"] for r in result.rounds]
    assert [line.get_ydata()[0] for line in medians] == pytest.approx(
        [statistics.median(d["accuracy"] for d in f["per_device"].values()) for f in rows])
    ys = {float(y) for line in ax.lines for y in line.get_ydata()}
    for f in rows:
        accuracies = [d["accuracy"] for d in f["per_device"].values()]
        assert min(accuracies) in ys and max(accuracies) in ys
    (combined,) = [line for line in ax.lines if line.get_label() == "all devices' rows together"]
    assert list(combined.get_ydata()) == pytest.approx([f["accuracy"] for f in rows])
    assert written.exit_code == 0, written.output
    doc = json.loads(written.output)
    png = Path(doc["plots"]["device_accuracy"])
    assert png.name == "device_accuracy.png" and png.read_bytes().startswith(b"\x89PNG")
    text = Path(doc["markdown"]).read_text()
    low, median, high, worst = _spread(rows[-1]["per_device"])
    line = next(line for line in text.splitlines() if line.startswith(f"| device accuracy in round {ROUNDS - 1}"))
    assert f"min {low:.4f}, median {median:.4f}, max {high:.4f}; worst: {worst[0]}" in line
    assert "](device_accuracy.png)" in text


def test_the_report_says_so_when_no_device_reported_its_own(tmp_path: Path) -> None:
    store = CoordinatorStore(tmp_path / "c.db")
    store.ensure_rollout("old", {"rollout": "old", "rounds": 1, "topology": {"cells": 1, "devices_per_cell": 1}},
                         b"m")
    store.save_initial_model("old", {"w": np.zeros(2, np.float32)})
    row = {"round": 0, "accuracy": 0.5, "loss": 1.0, "devices_reported": 1, "missing": [], "model_version": 1,
           "federated": {"accuracy": 0.5, "loss": 1.0, "examples": 4, "devices": 1, "model_version": 0}}
    store.commit_round("old", 0, 1, {"w": np.zeros(2, np.float32)}, 0.5, 1.0, row)
    store.close()

    fig = figures(StoreStatus(tmp_path / "c.db").rollout("old"), only="device_accuracy")["device_accuracy"]

    ax = fig.axes[0]
    assert not ax.lines and "no device reported its own evaluation" in ax.texts[0].get_text()
    assert ax.get_title().startswith(PLOTS["device_accuracy"]) and "(" in ax.get_ylabel()


def test_prometheus_has_the_worst_devices_accuracy_and_no_series_per_device() -> None:
    m = Metrics(node="cloud", role="cloud")
    observed = CoordinatorMetrics(m, {"cell-a": ("dev-1", "dev-2"), "cell-b": ("dev-3", "dev-4")})
    per_device = {"dev-1": {"accuracy": 1.0, "loss": 0.1, "examples": 10},
                  "dev-2": {"accuracy": 1.0, "loss": 0.2, "examples": 12},
                  "dev-3": {"accuracy": 10 / 11, "loss": 0.4, "examples": 11},
                  "dev-4": {"accuracy": 0.8, "loss": 0.9, "examples": 10}}
    row = {"round": 0, "accuracy": 0.9, "loss": 0.3, "round_s": 1.0, "model_version": 1, "missing": [],
           "federated": {"accuracy": 0.93, "loss": 0.4, "examples": 43, "devices": 4, "model_version": 0,
                         "per_device": per_device}}

    observed.round_closed(row, {"cell-a": ("dev-1", "dev-2"), "cell-b": ("dev-3", "dev-4")})

    assert m.get("fedtier_federated_accuracy_min") == 0.8
    assert "dev-" not in m.render()  # device ids are no labels
