"""A device's local data directory and its durable outbox."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agent.data import LocalData, fit_to_model, load_data_dir, load_eval_dir, write_shard
from device_agent.state import DeviceState
from fedtier.errors import ConfigError
from fedtier.training.layout import ArchSpec


def test_npz_and_csv_files_are_concatenated(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.ones((2, 3)), y=np.array([0, 1]))
    (tmp_path / "b.csv").write_text("f1,f2,f3,label\n1,2,3,2\n4,5,6,0\n")
    data = load_data_dir(tmp_path)
    assert data.x.shape == (4, 3) and data.x.dtype == np.float32
    assert data.y.tolist() == [0, 1, 2, 0] and data.y.dtype == np.int64


def test_examples_are_reshaped_to_the_model_input(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.zeros((5, 8)), y=np.zeros(5))
    assert load_data_dir(tmp_path, input_shape=(2, 4)).x.shape == (5, 2, 4)
    with pytest.raises(ConfigError, match="model takes"):
        load_data_dir(tmp_path, input_shape=(3, 3))


@pytest.mark.parametrize("write,match", [
    (lambda d: None, "no .npz or .csv"),
    (lambda d: np.savez(d / "a.npz", x=np.ones((2, 1)), y=np.array([np.nan, 1])), "labels contain NaN"),
    (lambda d: np.savez(d / "a.npz", x=np.array([[np.nan], [1]]), y=np.array([0, 1])), "NaN"),
    (lambda d: np.savez(d / "a.npz", x=np.ones((3, 1)), y=np.array([0, 1])), "labels"),
    (lambda d: np.savez(d / "a.npz", features=np.ones(2)), "needs arrays"),
    (lambda d: np.savez(d / "a.npz", x=np.array([{"a": 1}], dtype=object), y=np.array([0])), "readable"),
    (lambda d: (d / "a.npz").write_bytes(b"not a zip"), "readable"),
    (lambda d: (d / "a.csv").write_text("1,2\nx,y\n"), "not numeric"),
])
def test_bad_data_is_a_config_error_naming_the_file(tmp_path: Path, write, match: str) -> None:
    write(tmp_path)
    with pytest.raises(ConfigError, match=match):
        load_data_dir(tmp_path)


def test_fractional_labels_load_as_float_targets(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.ones((2, 1)), y=np.array([0.5, -1.0]))
    data = load_data_dir(tmp_path)
    assert data.y.dtype == np.float32 and data.y.tolist() == [0.5, -1.0]


def _custom(loss: str, outputs: int) -> ArchSpec:
    return ArchSpec("onnx", {"sha256": "0" * 64, "input_shape": [2, 2], "outputs": outputs, "loss": loss})


def test_fit_to_model_lays_out_examples_and_labels_for_each_loss() -> None:
    # Prepare: 3 flat examples of 4 values with whole-number labels, as load_data_dir returns them.
    data = LocalData(x=np.arange(12, dtype=np.float32).reshape(3, 4), y=np.array([0, 1, 1]))
    # Execute / Assert: examples take the model's shape; labels the loss's form.
    ce = fit_to_model(data, _custom("cross_entropy", 2))
    assert ce.x.shape == (3, 2, 2) and ce.y.dtype == np.int64 and ce.y.tolist() == [0, 1, 1]
    bce = fit_to_model(data, _custom("bce", 1))
    assert bce.y.shape == (3, 1) and bce.y.dtype == np.float32
    mse = fit_to_model(LocalData(x=data.x, y=np.array([[0.5, 2.0]] * 3, np.float32)), _custom("mse", 2))
    assert mse.y.shape == (3, 2)


@pytest.mark.parametrize("y,arch,match", [
    (np.array([0.5, 1, 0]), _custom("cross_entropy", 2), "class numbers"),
    (np.array([-1, 1, 0]), _custom("cross_entropy", 2), "non-negative integers"),
    (np.array([0, 1, 2]), _custom("cross_entropy", 2), "2 classes"),
    (np.array([0, 2, 1]), _custom("bce", 1), r"\[0, 1\]"),
    (np.array([0.1, 0.2, 0.3]), _custom("mse", 2), "2 output"),
])
def test_labels_that_do_not_fit_the_loss_are_a_config_error(y: np.ndarray, arch: ArchSpec, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        fit_to_model(LocalData(x=np.ones((3, 4), np.float32), y=y), arch)


def test_a_shard_round_trips_and_keeps_held_out_rows_out_of_training(tmp_path: Path) -> None:
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10) % 3
    write_shard(tmp_path / "dev-00", (x[:7], y[:7]), (x[7:], y[7:]))
    train, held = load_data_dir(tmp_path / "dev-00"), load_eval_dir(tmp_path / "dev-00")
    assert held is not None
    np.testing.assert_array_equal(train.x, x[:7])
    np.testing.assert_array_equal(held.y, y[7:])
    write_shard(tmp_path / "dev-00", (x, y))  # rewritten without held-out rows: the stale ones go
    assert load_eval_dir(tmp_path / "dev-00") is None and len(load_data_dir(tmp_path / "dev-00")) == 10


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_data_dir(tmp_path / "nope")


def test_outbox_survives_a_restart_and_tracks_the_last_round(tmp_path: Path) -> None:
    state = DeviceState(tmp_path / "agent.db")
    state.put_update("k1", "t/1", b"update-1", "r", 1, 1.0)
    state.put_update("k2", "t/2", b"update-2", "r", 2, 2.0)
    state.delete("k1")
    state.close()
    again = DeviceState(tmp_path / "agent.db")
    assert again.pending() == [("k2", "t/2", b"update-2")]
    assert again.last_round("r") == 2 and again.last_round("other") == -1
    again.put_update("k0", "t/0", b"old", "r", 0, 3.0)  # an older round never lowers progress
    assert again.last_round("r") == 2


def test_the_newest_upload_step_survives_a_restart_and_never_moves_back(tmp_path: Path) -> None:
    state = DeviceState(tmp_path / "agent.db")
    assert state.last_sent("r") is None
    state.put_update("k1", "t/1", b"u", "r", 0, 1.0, sent=(1, 0))  # mid-round: last_round stays at 0
    state.put_update("k2", "t/2", b"u", "r", 0, 2.0, sent=(1, 1))
    state.put_update("k3", "t/3", b"u", "r", 0, 3.0, sent=(0, 4))  # older: ignored
    state.put_update("k4", "t/4", b"u", "other", 5, 4.0, sent=(5, 0))
    state.close()
    again = DeviceState(tmp_path / "agent.db")
    assert again.last_sent("r") == (1, 1) and again.last_sent("other") == (5, 0)
    assert again.last_round("r") == 0
