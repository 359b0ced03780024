"""The model zoo: torch modules for each ``ArchSpec`` kind, and their parameter layout.

Initial weights are drawn with numpy (``np.random.default_rng(seed)``), not torch's RNG, and
then loaded into the torch module. That keeps ``initial_parameters`` and ``layout_of``
torch-free and makes the seeded weights identical on every torch version, so the ORT
checkpoint, a torch-backed device and the coordinator all start from the same bits. The
distribution is torch's default for Linear/Conv1d: weight and bias ~ U(-1/sqrt(fan_in),
+1/sqrt(fan_in)).

torch is imported only inside :func:`build_model` (dependency rule: ``import models.zoo``
must not import torch).

Architectures (no BatchNorm, no Dropout: ORT 1.19.2's training rewrite mishandles both,
see field notes §1.2):

* ``mlp`` — ``{"sizes": [in, hidden..., out]}``; Linear layers ``fc0, fc1, ...`` with ReLU
  between them (not after the last).
* ``cnn1d`` — ``{"channels", "length", "classes", "filters"=[16, 32], "kernel"=5}``; input
  ``(batch, channels, length)``; ``conv0, conv1, ...`` (Conv1d, odd kernel, "same" padding)
  each followed by ReLU, global average pool over time, then a Linear ``head`` to classes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec, Layout, ParamSpec

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

CNN1D_DEFAULT_FILTERS = (16, 32)
CNN1D_DEFAULT_KERNEL = 5

_MLP_KEYS = frozenset({"sizes"})
_CNN1D_KEYS = frozenset({"channels", "length", "classes", "filters", "kernel"})


def _positive_int(arch: ArchSpec, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise LocalProtocolError(f"{arch.kind}: option {key!r} must be a positive int, got {value!r}")
    return int(value)


def _positive_ints(arch: ArchSpec, key: str, value: Any, min_len: int) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) < min_len:
        raise LocalProtocolError(
            f"{arch.kind}: option {key!r} must be a list of at least {min_len} positive ints, "
            f"got {value!r}")
    return [_positive_int(arch, key, v) for v in value]


def _check_keys(arch: ArchSpec, allowed: frozenset[str], required: frozenset[str]) -> None:
    unknown = sorted(set(arch.options) - allowed)
    if unknown:
        raise LocalProtocolError(
            f"{arch.kind}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(arch.options))
    if missing:
        raise LocalProtocolError(f"{arch.kind}: missing option(s) {missing}")


def mlp_sizes(arch: ArchSpec) -> list[int]:
    """Validated layer widths ``[in, hidden..., out]`` of an ``mlp`` architecture.

    Raises:
        LocalProtocolError: Unknown or invalid options.
    """
    _check_keys(arch, _MLP_KEYS, _MLP_KEYS)
    return _positive_ints(arch, "sizes", arch.options["sizes"], min_len=2)


def cnn1d_options(arch: ArchSpec) -> tuple[int, int, int, list[int], int]:
    """Validated ``(channels, length, classes, filters, kernel)`` of a ``cnn1d`` architecture.

    Raises:
        LocalProtocolError: Unknown, missing or invalid options (the kernel must be odd so
            that symmetric padding keeps the length).
    """
    _check_keys(arch, _CNN1D_KEYS, frozenset({"channels", "length", "classes"}))
    opts = arch.options
    channels = _positive_int(arch, "channels", opts["channels"])
    length = _positive_int(arch, "length", opts["length"])
    classes = _positive_int(arch, "classes", opts["classes"])
    filters = _positive_ints(arch, "filters", opts.get("filters", CNN1D_DEFAULT_FILTERS), 1)
    kernel = _positive_int(arch, "kernel", opts.get("kernel", CNN1D_DEFAULT_KERNEL))
    if kernel % 2 == 0:
        raise LocalProtocolError(f"cnn1d: option 'kernel' must be odd, got {kernel}")
    return channels, length, classes, filters, kernel


def _param_table(arch: ArchSpec) -> list[tuple[str, tuple[int, ...], int]]:
    """``(name, shape, fan_in)`` of every parameter, in module (= ONNX initializer) order."""
    table: list[tuple[str, tuple[int, ...], int]] = []
    if arch.kind == "mlp":
        sizes = mlp_sizes(arch)
        for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
            table.append((f"fc{i}.weight", (fan_out, fan_in), fan_in))
            table.append((f"fc{i}.bias", (fan_out,), fan_in))
        return table
    if arch.kind == "cnn1d":
        channels, _length, classes, filters, kernel = cnn1d_options(arch)
        in_ch = channels
        for i, out_ch in enumerate(filters):
            fan_in = in_ch * kernel
            table.append((f"conv{i}.weight", (out_ch, in_ch, kernel), fan_in))
            table.append((f"conv{i}.bias", (out_ch,), fan_in))
            in_ch = out_ch
        table.append(("head.weight", (classes, in_ch), in_ch))
        table.append(("head.bias", (classes,), in_ch))
        return table
    raise LocalProtocolError(f"no zoo entry for architecture kind {arch.kind!r}")


def layout_of(arch: ArchSpec) -> Layout:
    """Parameter layout of ``arch`` in training-graph order.

    The order is the torch ``state_dict`` order, which is also the exported forward model's
    initializer order and hence ORT's training-graph input order (checked by
    ``models.export`` and ``models.artifacts`` at build time).

    Args:
        arch: The architecture.

    Returns:
        The layout (float32 parameters).

    Raises:
        LocalProtocolError: Invalid architecture options.
    """
    return Layout(params=tuple(ParamSpec(name, shape) for name, shape, _ in _param_table(arch)))


def initial_parameters(arch: ArchSpec, seed: int) -> dict[str, np.ndarray]:
    """Deterministic initial weights of ``arch`` for ``seed`` (torch-free).

    Args:
        arch: The architecture.
        seed: Non-negative integer seed.

    Returns:
        float32 C-contiguous arrays keyed by parameter name, in layout order.

    Raises:
        LocalProtocolError: Invalid architecture options or seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LocalProtocolError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    params: dict[str, np.ndarray] = {}
    for name, shape, fan_in in _param_table(arch):
        bound = 1.0 / math.sqrt(fan_in)
        params[name] = np.ascontiguousarray(rng.uniform(-bound, bound, size=shape), dtype=np.float32)
    return params


def build_model(arch: ArchSpec, seed: int,
                params: "dict[str, np.ndarray] | None" = None) -> "torch.nn.Module":
    """Build the torch module for ``arch`` with the weights of :func:`initial_parameters`.

    torch's global RNG is left untouched (default inits run under ``fork_rng`` and are then
    overwritten), so building a model does not perturb anyone else's random stream.

    Args:
        arch: The architecture.
        seed: Non-negative integer seed.
        params: ``initial_parameters(arch, seed)`` when the caller has them already (a
            ``models.source.ModelSource`` does), so they are not drawn twice.

    Returns:
        A float32 CPU module in train mode whose ``state_dict`` keys and shapes equal
        :func:`layout_of`.

    Raises:
        LocalProtocolError: Invalid architecture options or seed.
    """
    import torch
    from torch import nn

    if params is None:
        params = initial_parameters(arch, seed)
    layers: list[tuple[str, nn.Module]] = []
    with torch.random.fork_rng(devices=[]):
        if arch.kind == "mlp":
            sizes = mlp_sizes(arch)
            last = len(sizes) - 2
            for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
                layers.append((f"fc{i}", nn.Linear(fan_in, fan_out, dtype=torch.float32)))
                if i != last:
                    layers.append((f"relu{i}", nn.ReLU()))
        else:
            channels, _length, classes, filters, kernel = cnn1d_options(arch)
            in_ch = channels
            for i, out_ch in enumerate(filters):
                layers.append((f"conv{i}", nn.Conv1d(in_ch, out_ch, kernel, padding=kernel // 2,
                                                     dtype=torch.float32)))
                layers.append((f"relu{i}", nn.ReLU()))
                in_ch = out_ch
            layers.append(("pool", nn.AdaptiveAvgPool1d(1)))
            layers.append(("flatten", nn.Flatten(start_dim=1)))
            layers.append(("head", nn.Linear(in_ch, classes, dtype=torch.float32)))
    model = nn.Sequential(OrderedDict(layers))
    model.load_state_dict({name: torch.from_numpy(arr) for name, arr in params.items()},
                          strict=True)
    model.train()
    return model
