"""The coordinator's SQLite state: exact model round trips, atomic rounds, open-round inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cloud_coordinator.store import CoordinatorStore, decode_params, encode_params

PARAMS = {"w": np.array([[0.1, -2.5]], np.float32), "b": np.array([3.0], np.float32)}


def test_params_round_trip_bit_exact() -> None:
    back = decode_params(encode_params(PARAMS, rollout="r", round=3))
    assert all(np.array_equal(back[k], v) and back[k].dtype == np.float32 for k, v in PARAMS.items())


def test_state_survives_reopening_and_rounds_commit_with_their_model(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    store = CoordinatorStore(db)
    store.ensure_rollout("r", {"rounds": 3}, b"{}")
    store.save_initial_model("r", PARAMS)
    store.record_input("r", 0, "k0", b"update-from-cell-a")
    assert store.inputs("r") == [b"update-from-cell-a"]
    newer = {k: v + 1 for k, v in PARAMS.items()}
    store.commit_round("r", 0, 1, newer, 0.5, 1.2, {"round": 0})
    store.close()

    again = CoordinatorStore(db)
    latest = again.latest_model("r")
    assert latest is not None and (latest.version, latest.round) == (1, 0)
    assert np.array_equal(latest.params["w"], newer["w"])
    assert again.inputs("r") == []  # consumed by the committed round
    assert again.rounds("r")[0]["accuracy"] == 0.5
    assert again.model("r", 0) is not None and again.model("r", 0).round == -1
    again.ensure_rollout("r", {"rounds": 99}, b"other")  # a restart keeps the original
    assert again.manifest("r") == b"{}"
    again.close()
