"""Users' models on the portable backend: the ``fedtier init`` starter and one model per loss train like
onnxruntime-training.

In this process (the training build of onnxruntime runs the standard-op graphs too); the same
bundles train in the stock-onnxruntime environment in ``test_portable_env.py``. The per-loss models
have frozen tensors (a buffer and a parameter with ``requires_grad = False``), and an ONNX file
trains only its head (``[model] trainable``): the frozen tensors must reach the portable graph
with the values onnxruntime-training's checkpoint has, and never move.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from portable_models import FROZEN, MODELS, batches_for, build_user_bundles

from device_agent.trainers import make_trainer
from device_agent.trainers.portable import PortableTrainer
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import LocalProtocolError

STEPS = 20
LR = 0.1
TOL = 1e-5


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ArtifactBundle]:
    return build_user_bundles(tmp_path_factory.mktemp("user-models"),
                              tmp_path_factory.getbasetemp() / "fedtier-artifact-store")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_twenty_steps_give_the_weights_onnxruntime_training_gives(name: str,
                                                                  bundles: dict[str, ArtifactBundle]) -> None:
    bundle = bundles[name]
    x, y = batches_for(bundle.arch, STEPS, seed=len(name))
    trained = {}
    for kind in ("ort", "portable"):
        trainer = make_trainer(kind, bundle)
        start = trainer.get_parameters()
        stats = trainer.train_steps([(x[i], y[i]) for i in range(STEPS)], LR)
        trained[kind] = (trainer, stats, start)
    (ort, ort_stats, ort_start), (portable, portable_stats, portable_start) = trained["ort"], trained["portable"]
    assert isinstance(portable, PortableTrainer)
    for param, want in ort_start.items():  # the same initial weights, from the two checkpoints
        np.testing.assert_array_equal(portable_start[param], want)
    got, want = portable.get_parameters(), ort.get_parameters()
    assert list(got) == list(want) == list(bundle.layout.names)  # trained tensors only: frozen ones are not parameters
    for param in want:
        np.testing.assert_allclose(got[param], want[param], rtol=0, atol=TOL, err_msg=f"{name}: {param}")
    assert max(float(np.abs(want[p] - ort_start[p]).max()) for p in want) > 100 * TOL  # it did train
    assert portable_stats.mean_loss == pytest.approx(ort_stats.mean_loss, rel=TOL)

    # evaluation and prediction with the trained weights: the loss's own accuracy (none for mse)
    ours, theirs = portable.evaluate(x[0], y[0]), ort.evaluate(x[0], y[0])
    assert ours.loss == pytest.approx(theirs.loss, rel=TOL) and ours.samples == theirs.samples
    assert ours.accuracy == theirs.accuracy and (ours.accuracy is None) == (bundle.arch.loss == "mse")
    np.testing.assert_allclose(portable.predict(x[1]), ort.predict(x[1]), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_agree_and_frozen_tensors_are_not_parameters(name: str,
                                                               bundles: dict[str, ArtifactBundle]) -> None:
    bundle = bundles[name]
    x, y = batches_for(bundle.arch, 1, seed=7)
    ort, portable = make_trainer("ort", bundle), make_trainer("portable", bundle)
    (want, want_loss), (got, got_loss) = ort.compute_gradient(x[0], y[0]), portable.compute_gradient(x[0], y[0])
    assert got_loss == pytest.approx(want_loss, rel=TOL)
    for param in want:
        scale = max(1.0, float(np.abs(want[param]).max()))
        np.testing.assert_allclose(got[param], want[param], rtol=0, atol=TOL * scale, err_msg=param)
        assert np.any(got[param] != 0)  # every trained tensor gets a gradient
    for frozen in FROZEN[name]:
        for trainer in (ort, portable):
            with pytest.raises(LocalProtocolError, match="unknown parameter"):
                trainer.set_parameters({frozen: np.zeros((1,), np.float32)})


def test_a_frozen_tensor_changes_the_forward_pass_as_in_onnxruntime_training(
        bundles: dict[str, ArtifactBundle], tmp_path: Path) -> None:
    """The frozen values are fed, not zeros or defaults: a portable checkpoint whose frozen tail is zeroed
    gives other logits, while the bundle's own gives onnxruntime-training's."""
    import dataclasses

    from fedtier.artifacts.bundle import BundleFile

    bundle = bundles["cross_entropy"]
    x, _ = batches_for(bundle.arch, 1, seed=3)
    want = make_trainer("ort", bundle).predict(x[0])
    np.testing.assert_allclose(make_trainer("portable", bundle).predict(x[0]), want, rtol=0, atol=TOL)

    copy = tmp_path / "zeroed"
    copy.mkdir()
    for entry in bundle.files.values():
        (copy / entry.filename).write_bytes((bundle.directory / entry.filename).read_bytes())
    checkpoint = copy / bundle.files["portable_checkpoint"].filename
    raw = bytearray(checkpoint.read_bytes())
    tail = 4 * bundle.layout.num_parameters
    assert len(raw) > tail  # the frozen tensors follow the parameters
    raw[tail:] = bytes(len(raw) - tail)
    checkpoint.write_bytes(bytes(raw))
    zeroed = dataclasses.replace(bundle, directory=copy,
                                 files={**bundle.files, "portable_checkpoint": BundleFile.of(checkpoint)})
    assert not np.allclose(make_trainer("portable", zeroed).predict(x[0]), want, atol=1e-3)
