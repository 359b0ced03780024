"""`fedtier data split`: a user's table becomes the shards agents read, partitioned as asked."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedtier.rollout.config import TopologyConfig
from fleet_data.split import SplitOptions, split_table
from fleet_data.tables import read_table
from device_agent.data import load_data_dir, load_eval_dir
from fedtier.cli import cli
from fedtier.errors import ConfigError

ACTIVITIES = ("walk", "run", "sit")


def write_csv(path: Path, rows: int = 600, seed: int = 0) -> Path:
    """Sensor readings: an ``id`` column (to trace rows), three readings, a text label."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(ACTIVITIES), rows)
    lines = ["id,ax,ay,az,activity"]
    for i, label in enumerate(labels):
        ax, ay, az = rng.normal(size=3) + label
        lines.append(f"{i},{ax:.5f},{ay:.5f},{az:.5f},{ACTIVITIES[label]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def split(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["data", "split", *args])
    return result.exit_code, result.output


def label_skew(out: Path, devices: list[str]) -> float:
    """Mean total-variation distance between each device's label mix and the whole table's."""
    per_device = [np.concatenate([load_data_dir(out / d).y, load_eval_dir(out / d).y]) for d in devices]
    everything = np.concatenate(per_device)
    overall = np.bincount(everything, minlength=3) / len(everything)
    return float(np.mean([0.5 * np.abs(np.bincount(y, minlength=3) / len(y) - overall).sum() for y in per_device]))


def test_a_csv_split_round_trips_through_the_agents_reader(tmp_path: Path) -> None:
    # Prepare: 600 rows with a header and text labels.
    source = write_csv(tmp_path / "readings.csv")
    # Execute
    code, output = split("--input", str(source), "--label-column", "activity", "--devices", "6", "--partition",
                         "dirichlet", "--holdout", "0.25", "--test-fraction", "0.1", "--out", str(tmp_path / "shards"))
    # Assert: the shards are named as a 2 x 3 topology names its devices, and hold every row once.
    assert code == 0, output
    devices = [d for ds in TopologyConfig(cells=2, devices_per_cell=3).layout().values() for d in ds]
    out = tmp_path / "shards"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == devices
    summary = json.loads((out / "split.json").read_text())
    assert summary["class_names"] == ["run", "sit", "walk"]  # numbered in sorted order
    seen: list[np.ndarray] = []
    for device in devices:
        train, held = load_data_dir(out / device), load_eval_dir(out / device)
        assert held is not None and len(held) >= 1
        assert (len(train), len(held)) == (summary["devices"][device]["train"], summary["devices"][device]["eval"])
        assert len(held) == round(0.25 * (len(train) + len(held)))
        seen += [train.x[:, 0], held.x[:, 0]]
    with np.load(out / "test.npz") as test:
        assert len(test["y"]) == summary["test"] == 60
        seen.append(test["x"][:, 0])
    ids = np.sort(np.concatenate(seen)).astype(int)
    np.testing.assert_array_equal(ids, np.arange(600))  # no row lost, none in two places
    # Labels travel with their rows: row i's activity, numbered run=0, sit=1, walk=2.
    truth = {int(line.split(",")[0]): ["run", "sit", "walk"].index(line.split(",")[-1])
             for line in source.read_text().splitlines()[1:]}
    train = load_data_dir(out / devices[0])
    assert [truth[int(i)] for i in train.x[:, 0]] == train.y.tolist()


def test_dirichlet_skews_the_label_mix_measurably_and_iid_does_not(tmp_path: Path) -> None:
    source = write_csv(tmp_path / "readings.csv", rows=3000)
    for partition, extra in (("iid", []), ("dirichlet", ["--alpha", "0.1"])):
        code, output = split("--input", str(source), "--label-column", "activity", "--devices", "6",
                             "--partition", partition, *extra, "--out", str(tmp_path / partition))
        assert code == 0, output
    devices = [f"dev-{i:02d}" for i in range(6)]
    assert label_skew(tmp_path / "iid", devices) < 0.06
    assert label_skew(tmp_path / "dirichlet", devices) > 0.3


def test_the_same_seed_gives_the_same_shards(tmp_path: Path) -> None:
    table = read_table(write_csv(tmp_path / "r.csv"), "activity")
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        split_table(table, SplitOptions(devices=4, partition="dirichlet", seed=seed), tmp_path / name)
    same = [np.array_equal(load_data_dir(tmp_path / "a" / d).x, load_data_dir(tmp_path / other / d).x)
            for other in ("b", "c") for d in ("dev-00",)]
    assert same == [True, False]


def test_several_label_columns_give_multi_output_targets(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("x1,x2,y1,y2\n" + "\n".join(f"{i},{i + 1},{i * 0.5},{-i}" for i in range(20)))
    table = read_table(tmp_path / "t.csv", "y1,y2")
    assert table.x.shape == (20, 2) and table.y.shape == (20, 2) and table.y.dtype == np.float32
    with pytest.raises(ConfigError, match="--partition"):
        split_table(table, SplitOptions(devices=2, partition="shards"), tmp_path / "out")


@pytest.mark.parametrize("content,args,match", [
    ("a,b,label\n1,2,0\n", ["--label-column", "class"], r"--label-column.*no column 'class'; the header has"),
    ("a,b,label\n1,2,0\n", ["--label-column", "5"], r"--label-column.*column 5 does not exist"),
    ("a,b,label\n1,oops,0\n3,4,1\n", [], r"--input.*line 2, column 'b': 'oops' is not a number"),
    ("a,b,label\n1,2,0\n3,4\n", [], r"--input.*line 3 has 2 columns"),
    ("a,b,label\n1,2,0.5\n3,4,1.5\n", ["--partition", "dirichlet"], r"--partition.*not class numbers"),
    ("a,b,label\n1,2,0\n", ["--devices", "3"], r"--devices.*1 rows cannot be spread over 3 devices"),
])
def test_bad_input_is_a_usage_error_naming_the_option_and_file(tmp_path: Path, content: str, args: list[str],
                                                              match: str) -> None:
    source = tmp_path / "data.csv"
    source.write_text(content)
    options = {"--devices": "1", **dict(zip(args[::2], args[1::2], strict=True))}
    code, output = split("--input", str(source), "--out", str(tmp_path / "out"),
                         *[x for kv in options.items() for x in kv])
    assert code == 2, output
    flat = " ".join(output.split())
    assert re.search(match, flat), flat
    if "--input" in match or "--label-column" in match:
        assert str(source) in flat


def test_an_existing_output_is_not_overwritten_without_force(tmp_path: Path) -> None:
    source = write_csv(tmp_path / "r.csv", rows=20)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, output = split("--input", str(source), "--devices", "2", "--out", str(tmp_path / "out"))
    assert code == 2 and "--force" in output
    code, _ = split("--input", str(source), "--devices", "2", "--out", str(tmp_path / "out"), "--force")
    assert code == 0 and (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_an_npz_table_splits_too(tmp_path: Path) -> None:
    np.savez(tmp_path / "t.npz", x=np.arange(40, dtype=np.float32).reshape(10, 2, 2), y=np.arange(10) % 2)
    code, output = split("--input", str(tmp_path / "t.npz"), "--devices", "2", "--holdout", "0", "--out",
                         str(tmp_path / "out"), "--json")
    assert code == 0, output
    assert sum(d["train"] for d in json.loads(output)["devices"].values()) == 10
    assert load_data_dir(tmp_path / "out" / "dev-01").x.shape[1:] == (2, 2)
    code, output = split("--input", str(tmp_path / "t.npz"), "--devices", "2", "--label-column", "y", "--out",
                         str(tmp_path / "out2"))
    assert code == 2 and "--label-column is for CSV files" in output


def test_the_help_example_runs_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the example block of `fedtier data --help` (the same text is in `data split --help`).
    runner = CliRunner()
    help_text = runner.invoke(cli, ["data", "--help"]).output
    block = help_text.split("Example (runs as printed", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    commands = " ".join(line.strip() for line in block.splitlines()).replace("\\ ", "").split("fedtier ")[1:]
    assert len(commands) == 2
    monkeypatch.chdir(tmp_path)
    # Execute
    for command in commands:
        result = runner.invoke(cli, shlex.split(command))
        assert result.exit_code == 0, (command, result.output)
    # Assert: 1797 digits, 20 % of them the central test set, the rest over 6 devices.
    summary = json.loads((tmp_path / "shards" / "split.json").read_text())
    assert summary["rows"] == 1797 and len(summary["devices"]) == 6
    assert summary["test"] + sum(d["train"] + d["eval"] for d in summary["devices"].values()) == 1797
