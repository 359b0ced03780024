"""Import onnxruntime-training's on-device API without importing torch.

Why (field notes §0b, measured on onnxruntime-training-cpu 1.19.2):

* ``onnxruntime/training/__init__.py`` imports ``optim``, which imports torch. On a device
  without torch, ``from onnxruntime.training.api import Module`` therefore fails with
  ``No module named 'torch'``.
* On a machine *with* torch, even a plain ``import onnxruntime`` imports torch: its build
  validation tries ``onnxruntime.training.ortmodule``: about 2 s and ~290 MB peak RSS,
  versus ~0.13 s and ~58 MB for shim + API + loading a bundle (measured here).
* The training API itself (``onnxruntime/training/api/*.py``) needs neither torch nor onnx.

The shim registers, *before the first onnxruntime import*, a bare package module for
``onnxruntime.training`` whose ``__path__`` is the installed ``onnxruntime/training``
directory (so its submodules, ``api`` included, import normally from the wheel) and
``None`` for ``onnxruntime.training.ortmodule`` (so the validation's import fails fast with
``ImportError``, which it tolerates). It does nothing if ``onnxruntime.training`` is already
imported; then the real package is used as is.

Side effects in a process that also builds artifacts (coordinator): with the shim first,
``from onnxruntime.training import artifacts`` still works (it is a submodule; it imports
torch itself via ``onnxruntime.tools``); only ``onnxruntime.training.ortmodule`` (ORTModule,
not used by fedtier) and the package-level re-exports (``onnxruntime.training.optim`` as an
attribute before import, ``is_ortmodule_available``) are unavailable. With the real package
imported first, the shim is a no-op. Both orders are exercised by the tests.

Call :func:`install_shim` as early as possible in a device process (importing
``device_agent.trainers.ort`` does it); :func:`training_api` installs it and returns the API.
:func:`import_onnxruntime` imports whichever onnxruntime is installed (the portable trainer
runs on both builds), through the shim when it is the training build; :func:`installed_build`
tells which build is installed without importing it (for choosing a backend).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

_TRAINING = "onnxruntime.training"
_ORTMODULE = "onnxruntime.training.ortmodule"
_lock = threading.Lock()


def _onnxruntime_dir() -> Path:
    """Installed ``onnxruntime`` package directory, found without importing it."""
    loaded = sys.modules.get("onnxruntime")
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(list(loaded.__path__)[0])
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "onnxruntime is not installed; the ORT trainer needs onnxruntime-training-cpu==1.19.2 "
            "(or a self-built onnxruntime-training wheel on aarch64)")
    return Path(list(spec.submodule_search_locations)[0])


def install_shim() -> bool:
    """Register the torch-free ``onnxruntime.training`` package shim, if still possible.

    Idempotent and cheap: it does not import onnxruntime.

    Returns:
        True if the shim is (now or already) in place; False if the real
        ``onnxruntime.training`` package was imported before and is used instead.

    Raises:
        ImportError: onnxruntime is missing, or it is a build without the training
            package (e.g. the plain ``onnxruntime`` wheel).
    """
    with _lock:
        existing = sys.modules.get(_TRAINING)
        if existing is not None:
            return bool(getattr(existing, "__fedtier_shim__", False))
        training_dir = _onnxruntime_dir() / "training"
        if not (training_dir / "api" / "__init__.py").is_file():
            raise ImportError(
                f"{training_dir} has no 'api' package: the installed onnxruntime is not an "
                "onnxruntime-training build (install onnxruntime-training-cpu==1.19.2, and not "
                "next to the plain onnxruntime wheel)")
        spec = importlib.machinery.ModuleSpec(_TRAINING, None, is_package=True)
        spec.submodule_search_locations = [str(training_dir)]
        module = types.ModuleType(_TRAINING, "torch-free stand-in installed by fedtier "
                                             "(device_agent.trainers.ort_runtime)")
        module.__spec__ = spec
        module.__path__ = [str(training_dir)]
        module.__package__ = _TRAINING
        module.__fedtier_shim__ = True  # type: ignore[attr-defined]
        sys.modules[_TRAINING] = module
        # ``None`` makes ``import onnxruntime.training.ortmodule`` raise ImportError at once.
        sys.modules.setdefault(_ORTMODULE, None)  # type: ignore[arg-type]
        parent = sys.modules.get("onnxruntime")
        if parent is not None:
            parent.training = module  # type: ignore[attr-defined]
        logger.debug("installed torch-free onnxruntime.training shim (%s)", training_dir)
        return True


def training_api() -> types.ModuleType:
    """The ``onnxruntime.training.api`` module, imported through the shim when possible.

    Returns:
        ``onnxruntime.training.api`` (``CheckpointState``, ``Module``, ``Optimizer``, ...).

    Raises:
        ImportError: onnxruntime-training is not installed.
    """
    install_shim()
    onnxruntime = importlib.import_module("onnxruntime")
    training = sys.modules[_TRAINING]
    if getattr(onnxruntime, "training", None) is not training:
        # A module placed directly in sys.modules is not bound on its parent automatically.
        onnxruntime.training = training  # type: ignore[attr-defined]
    return importlib.import_module(f"{_TRAINING}.api")


def installed_build() -> str | None:
    """Which onnxruntime is installed, found without importing it.

    Returns:
        ``"training"`` for an onnxruntime-training build (it has ``onnxruntime/training/api``),
        ``"stock"`` for the plain ``onnxruntime`` wheel, ``None`` if there is no onnxruntime.
    """
    try:
        directory = _onnxruntime_dir()
    except (ImportError, ValueError):
        return None
    return "training" if (directory / "training" / "api" / "__init__.py").is_file() else "stock"


def import_onnxruntime() -> types.ModuleType:
    """``import onnxruntime``, through the torch-free shim when it is the training build.

    Returns:
        The ``onnxruntime`` module.

    Raises:
        ImportError: No onnxruntime is installed.
    """
    if installed_build() == "training":
        install_shim()
    try:
        return importlib.import_module("onnxruntime")
    except ImportError as exc:
        raise ImportError("onnxruntime is not installed: the portable trainer needs the stock onnxruntime "
                          "wheel (pip install 'fedtier[agent]') or an onnxruntime-training build") from exc


def module_step(module: Any, inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """One training or evaluation step of an ``onnxruntime.training.api.Module``, its outputs as numpy.

    What ``module(*inputs)`` does, without its cost: the wheel's ``Module.__call__`` turns the outputs
    into numpy with ``tuple(v.numpy() for v in fetches)``, and iterating a pybind ``OrtValueVector``
    costs tens of microseconds per element (indexing it, under one): for the MLP at batch 16 that was
    about 35 of a step's 80 µs (docs/benchmarks.md, "On-device training step"). onnxruntime-training
    1.19.2 is the package's last release, so its ``Module._model`` (the C++ module that ``__call__``
    calls) stays as it is; a module without it falls back to the public call.

    Args:
        module: The ``Module``; ``module.training`` chooses the training or the evaluation graph.
        inputs: numpy arrays in the graph's input order.

    Returns:
        The graph's outputs, in order.
    """
    model, vector = getattr(module, "_model", None), _ort_value_vector()
    if model is None or vector is None:
        outputs = module(*inputs)
        return outputs if isinstance(outputs, tuple) else (outputs,)
    fetches = vector()
    if module.training:
        model.train_step(list(inputs), fetches)
    else:
        model.eval_step(list(inputs), fetches)
    return tuple(fetches[i].numpy() for i in range(len(fetches)))


@functools.cache
def _ort_value_vector() -> Any:
    """The pybind ``OrtValueVector`` class (after the shim: importing it imports onnxruntime), or None."""
    install_shim()
    try:
        from onnxruntime.capi._pybind_state import OrtValueVector
    except ImportError:  # every onnxruntime-training build has it; the public call still works without
        return None
    return OrtValueVector
