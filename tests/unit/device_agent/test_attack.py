"""device_agent.attack: who attacks (seeded), what an attacking trainer sends, and how runs are marked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import pytest

from device_agent.attack import AttackingTrainer, AttackSpec, flip_labels
from fedtier.rollout.config import choose_attackers
from fedtier.errors import LocalProtocolError
from fedtier.training.trainer import TrainStats

DEVICES = [f"dev-{i:02d}" for i in range(20)]


class StepTrainer:
    """A fake trainer: every train_steps call adds ``step`` to each parameter; gradients are ``grad``."""

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.step = 0.1

    layout = None

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in params.items()}

    def get_parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def train_steps(self, batches: Iterable, lr: float) -> TrainStats:
        self.params = {k: v + np.float32(self.step) for k, v in self.params.items()}
        self.step += 0.1
        return TrainStats(mean_loss=1.0, steps=1, samples=1)

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        return {k: np.full_like(v, 0.5) for k, v in self.params.items()}, 2.0


def delta_of(trainer, params) -> np.ndarray:
    trainer.set_parameters(params)
    trainer.train_steps([], 0.1)
    return trainer.get_parameters()["w"] - params["w"]


PARAMS = {"w": np.ones((50, 40), np.float32)}


def test_attackers_are_a_seeded_share_of_the_devices() -> None:
    a = choose_attackers(DEVICES, 0.2, seed=3)
    assert len(a) == 4 and a == sorted(a) and set(a) <= set(DEVICES)
    assert choose_attackers(list(reversed(DEVICES)), 0.2, seed=3) == a  # order of the list does not matter
    assert choose_attackers(DEVICES, 0.2, seed=4) != a
    assert choose_attackers(DEVICES, 0.0, seed=3) == []
    assert len(choose_attackers(DEVICES, 0.3, seed=3)) == 6
    with pytest.raises(LocalProtocolError):
        choose_attackers(DEVICES, 1.5, seed=0)


def test_sign_flip_sends_minus_scale_times_the_honest_update() -> None:
    honest = delta_of(StepTrainer(), PARAMS)
    lied = delta_of(AttackingTrainer(StepTrainer(), AttackSpec("sign_flip", scale=10.0), "dev-00"), PARAMS)
    np.testing.assert_allclose(lied, -10.0 * honest, rtol=1e-5)
    t = AttackingTrainer(StepTrainer(), AttackSpec("sign_flip", scale=3.0), "dev-00")
    t.set_parameters(PARAMS)
    np.testing.assert_allclose(t.compute_gradient(np.zeros(1), np.zeros(1))[0]["w"], -1.5)
    t.set_parameters(PARAMS)  # without training in between, the parameters are what was set
    np.testing.assert_array_equal(t.get_parameters()["w"], PARAMS["w"])


def test_gaussian_sends_seeded_noise_of_that_deviation() -> None:
    a = delta_of(AttackingTrainer(StepTrainer(), AttackSpec("gaussian", scale=2.0, seed=1), "dev-00"), PARAMS)
    b = delta_of(AttackingTrainer(StepTrainer(), AttackSpec("gaussian", scale=2.0, seed=1), "dev-00"), PARAMS)
    c = delta_of(AttackingTrainer(StepTrainer(), AttackSpec("gaussian", scale=2.0, seed=1), "dev-01"), PARAMS)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert abs(a.std() - 2.0) < 0.1 and abs(a.mean()) < 0.15  # 2000 draws


def test_stale_replay_resends_its_first_update() -> None:
    t = AttackingTrainer(StepTrainer(), AttackSpec("stale_replay"), "dev-00")
    first = delta_of(t, PARAMS)
    later = delta_of(t, {"w": PARAMS["w"] + 5})
    np.testing.assert_allclose(first, 0.1, rtol=1e-5)
    np.testing.assert_allclose(later, first, rtol=1e-5)  # the honest one would be 0.2


def test_label_flip_flips_class_labels() -> None:
    np.testing.assert_array_equal(flip_labels(np.array([0, 1, 9, 4]), 10), [9, 8, 0, 5])
    with pytest.raises(LocalProtocolError, match="classes"):
        AttackSpec("label_flip")


def test_an_attack_run_is_marked_in_every_output_and_a_plain_run_in_none(small_rollout, tmp_path: Path) -> None:
    from local_fleet.simulate import simulate

    steps = {"local_steps": 20, "lr": 0.2}
    cfg = small_rollout(rounds=3, attack={"kind": "sign_flip", "fraction": 0.5}, fedavg=steps,
                        metrics_file=str(tmp_path / "attack.json"))
    attacked = simulate(cfg)
    doc = json.loads((tmp_path / "attack.json").read_text())
    assert doc["attack"]["kind"] == "sign_flip" and len(doc["attack"]["devices"]) == 2
    assert doc["attack"]["note"].startswith("ATTACK RUN")
    assert all(r["attack"]["kind"] == "sign_flip" for r in doc["rounds"])
    plain = simulate(small_rollout(rounds=3, fedavg=steps, metrics_file=str(tmp_path / "plain.json")))
    assert "attack" not in (tmp_path / "plain.json").read_text()
    # Half the devices send -10x their update: the mean is dragged far from the honest model.
    assert attacked.rounds[-1]["accuracy"] < plain.rounds[-1]["accuracy"] - 0.2
    from cloud_coordinator.report import round_line

    assert round_line(doc["rounds"][0], 3).startswith("ATTACK RUN")
