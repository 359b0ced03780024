"""``fedtier report`` and the status it plots: what the PNGs show is what the store holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloud_coordinator.observe.plots import PLOTS, figures
from cloud_coordinator.observe.status import StoreStatus
from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.cli import cli


@pytest.fixture(scope="module")
def private_store(tmp_path_factory: pytest.TempPathFactory, artifact_store: Path) -> Path:
    """A finished private rollout (3 rounds, 2 cells x 2 devices) simulated into a store on disk."""
    from fedtier.rollout.config import RolloutConfig

    tmp = tmp_path_factory.mktemp("report")
    cfg = RolloutConfig.from_mapping({
        "rollout": "rep", "rounds": 3, "seed": 7, "state_dir": str(tmp / "state"),
        "artifact_store": str(artifact_store), "model": {"kind": "mlp", "hidden": [16]},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "seed": 3},
        "topology": {"cells": 2, "devices_per_cell": 2},
        "fedavg": {"local_steps": 5, "lr": 0.1, "batch_size": 16},
        "privacy": {"epsilon": 50.0, "clip": 1.0, "noise_seed": 1}})
    simulate(cfg, workdir=tmp / "run")
    return tmp / "run" / "coordinator.db"


def test_status_reads_the_store(private_store: Path) -> None:
    status = StoreStatus(private_store).rollout("rep")
    store = CoordinatorStore(private_store)
    rows = store.rounds("rep")
    store.close()

    assert status.summary.status == "finished" and status.summary.rounds_closed == 3
    assert status.round_in_progress is None and status.progress == 1.0
    assert [r.round for r in status.rounds] == [0, 1, 2]
    assert [r.accuracy for r in status.rounds] == [row["accuracy"] for row in rows]
    assert [r.epsilon for r in status.rounds] == [row["privacy"]["epsilon_max"] for row in rows]
    assert all(sum(r.reported_per_cell.values()) == r.devices_reported == 4 for r in status.rounds)
    assert [m.version for m in status.models] == [0, 1, 2, 3] and status.models[0].round == -1
    assert [(c.devices_known, c.devices_online, c.stragglers) for c in status.cells] == [(2, 0, [])] * 2
    json.dumps(status.to_dict(), allow_nan=False)  # the dashboard's API serves it as strict JSON


def test_the_plotted_values_are_the_stores(private_store: Path) -> None:
    # Execute
    status = StoreStatus(private_store).rollout("rep")
    figs = figures(status)
    rows = CoordinatorStore(private_store).rounds("rep")

    # Assert: the last plotted accuracy, loss and epsilon, and the cumulative bytes, read back
    # from the lines matplotlib drew.
    assert set(figs) == set(PLOTS)
    ax, right = figs["accuracy_loss"].axes
    assert ax.lines[0].get_ydata()[-1] == pytest.approx(rows[-1]["accuracy"])
    assert right.lines[0].get_ydata()[-1] == pytest.approx(rows[-1]["loss"])
    assert list(ax.lines[0].get_xdata()) == [0, 1, 2]
    [eps_line] = figs["epsilon"].axes[0].lines
    assert eps_line.get_ydata()[-1] == pytest.approx(rows[-1]["privacy"]["epsilon_max"])
    bytes_ax = figs["bytes_per_tier"].axes[0]
    up = next(line for line in bytes_ax.lines if line.get_label() == "device -> edge")
    assert up.get_ydata()[-1] == pytest.approx(sum(r["bytes"]["device_up"] for r in rows) / 2**20)
    assert figs["accuracy_vs_bytes"].axes[0].lines[0].get_ydata()[-1] == pytest.approx(rows[-1]["accuracy"])
    devices = figs["devices_reporting"].axes[0]
    assert [[bar.get_height() for bar in bars] for bars in devices.containers] == [[2, 2, 2], [2, 2, 2]]
    # Readable at a glance: titled, labelled with units, a legend where lines are several.
    for stem, fig in figs.items():
        for axis in fig.axes:
            assert axis.get_ylabel() and "(" in axis.get_ylabel(), (stem, axis.get_ylabel())
        main = fig.axes[0]
        assert main.get_title().startswith(PLOTS[stem]) and main.get_xlabel()
        if len(main.lines) + len(main.containers) + sum(len(a.lines) for a in fig.axes[1:]) > 1:
            assert main.get_legend() is not None, stem


def test_fedtier_report_writes_the_pngs_and_a_summary(private_store: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["report", "rep", "--store", str(private_store), "--out", str(tmp_path / "r"),
                                      "--json"])

    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc["plots"]) == set(PLOTS) and doc["rounds"] == 3
    for path in doc["plots"].values():
        data = Path(path).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    text = Path(doc["markdown"]).read_text()
    rows = CoordinatorStore(private_store).rounds("rep")
    assert f"| final test accuracy | {rows[-1]['accuracy']:.4f} |" in text
    assert all(f"]({stem}.png)" in text for stem in PLOTS)
    assert not math.isnan(rows[-1]["accuracy"])


def test_fedtier_report_names_what_is_missing(private_store: Path, tmp_path: Path) -> None:
    runner = CliRunner()

    unknown = runner.invoke(cli, ["report", "nope", "--store", str(private_store), "--out", str(tmp_path)])
    absent = runner.invoke(cli, ["report", "rep", "--store", str(tmp_path / "none.db"), "--out", str(tmp_path)])
    both = runner.invoke(cli, ["report", "rep", "--out", str(tmp_path)])

    assert unknown.exit_code == 1 and "no rollout 'nope'" in unknown.output and "rep" in unknown.output
    assert absent.exit_code == 1 and "no coordinator store" in absent.output
    assert both.exit_code == 2 and "--store" in both.output


def test_devices_reporting_past_20_rounds_is_a_line_per_cell_under_its_legend(private_store: Path) -> None:
    """Bars of 40 rounds and more merge into one block: a step line per cell instead, the legend above them."""
    import dataclasses

    status = StoreStatus(private_store).rollout("rep")
    many = [dataclasses.replace(status.rounds[i % 3], round=i,
                                reported_per_cell={c.cell: 2 - (i % 5 == 0) for c in status.cells})
            for i in range(45)]
    fig = figures(dataclasses.replace(status, rounds=many), only="devices_reporting")["devices_reporting"]
    ax = fig.axes[0]
    fig.canvas.draw()

    assert not ax.containers and len(ax.lines) == len(status.cells)  # no bars
    for line, cell in zip(ax.lines, status.cells, strict=True):
        assert [round(y) for y in line.get_ydata()] == [r.reported_per_cell[cell.cell] for r in many]
    legend = ax.get_legend().get_window_extent()
    top = max(max(line.get_ydata()) for line in ax.lines)
    assert ax.transData.inverted().transform((0, legend.y0))[1] > top  # the legend sits above every line
