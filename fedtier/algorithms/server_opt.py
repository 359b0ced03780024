"""Server optimizers: the aggregated change as a pseudo-gradient (Reddi et al., Algorithm 2).

S. J. Reddi, Z. Charles, M. Zaheer, Z. Garrett, K. Rush, J. Konečný, S. Kumar, H. B. McMahan,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 2. With the round's aggregated change
``Δ_t = aggregate_i (x_i - x_t)`` (this is ``-`` a gradient, so steps are added):

    sgd       x_{t+1} = x_t + η Δ_t                          (η = 1: FedAvg, today's rule)
    momentum  m_t = μ m_{t-1} + Δ_t ;  x_{t+1} = x_t + η m_t  (FedAvgM, Hsu et al. 2019)
    adagrad   m_t = β1 m_{t-1} + (1 - β1) Δ_t ;  v_t = v_{t-1} + Δ_t²
    yogi      m_t as adagrad ;  v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)
    adam      m_t as adagrad ;  v_t = β2 v_{t-1} + (1 - β2) Δ_t²
              adaptive: x_{t+1} = x_t + η m_t / (sqrt(v_t) + τ)

as in the paper: no bias correction, ``m_{-1} = 0`` and ``v_{-1} = τ²`` (Algorithm 2 asks for
``v_{-1} >= τ²``). State (``m``, ``v``, the step count) is float64, named tensors that the
coordinator persists with each model version, so a restarted coordinator continues the same
sequence. Sans-I/O and pure apart from the state it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fedtier.algorithms import aggregate
from fedtier.errors import LocalProtocolError

Tensors = Mapping[str, np.ndarray]

KINDS = ("sgd", "momentum", "adam", "yogi", "adagrad")
DEFAULT_LR = {"sgd": 1.0, "momentum": 1.0, "adam": 0.01, "yogi": 0.01, "adagrad": 0.01}
"""η when ``lr`` is not given: 1 for sgd/momentum (sgd then is plain FedAvg), 10^-2 for the adaptive
ones (the order of the server rates Reddi et al. report for them)."""
OPT_KEYS = ("kind", "lr", "momentum", "beta1", "beta2", "tau")


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """``[server_optimizer]``: the rule and its hyper-parameters (``lr = None``: ``DEFAULT_LR``)."""

    kind: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LocalProtocolError(f"server optimizer kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.lr is not None and not (_finite(self.lr) and self.lr > 0):
            raise LocalProtocolError(f"server optimizer lr must be finite and > 0, got {self.lr!r}")
        for name in ("momentum", "beta1", "beta2"):
            value = getattr(self, name)
            if not (_finite(value) and 0 <= value < 1):
                raise LocalProtocolError(f"server optimizer {name} must be in [0, 1), got {value!r}")
        if not (_finite(self.tau) and self.tau > 0):
            raise LocalProtocolError(f"server optimizer tau must be finite and > 0, got {self.tau!r}")

    @property
    def eta(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.kind]

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "momentum": self.momentum, "beta1": self.beta1, "beta2": self.beta2,
               "tau": self.tau}
        if self.lr is not None:
            out["lr"] = self.lr
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OptimizerSpec":
        if not isinstance(data, Mapping):
            raise LocalProtocolError(f"a server optimizer spec is a table, got {data!r}")
        unknown = set(data) - set(OPT_KEYS)
        if unknown:
            raise LocalProtocolError(f"unknown server optimizer keys {sorted(unknown)}; known: {', '.join(OPT_KEYS)}")
        return cls(**dict(data))

    @property
    def is_plain(self) -> bool:
        """``sgd`` with η = 1: exactly today's ``x + Δ`` (no optimizer object needed)."""
        return self.kind == "sgd" and self.eta == 1.0


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class ServerOptimizer:
    """Applies one rule of Algorithm 2 per round; holds its state."""

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.steps = 0

    def step(self, params: Tensors, delta: Tensors) -> dict[str, np.ndarray]:
        """``x_{t+1}`` from ``x_t = params`` and the pseudo-gradient ``Δ_t = delta``; updates the state."""
        s = self.spec
        if set(params) != set(delta):
            raise LocalProtocolError("server optimizer: tensor names of the model and the change differ")
        if s.is_plain:
            self.steps += 1
            return aggregate.add(params, delta)
        eta = s.eta
        out: dict[str, np.ndarray] = {}
        for name in params:
            d = np.asarray(delta[name], dtype=np.float64)
            x = np.asarray(params[name], dtype=np.float64)
            if s.kind == "sgd":
                new = x + eta * d
            elif s.kind == "momentum":
                m = s.momentum * self.m.get(name, np.zeros_like(d)) + d
                self.m[name] = m
                new = x + eta * m
            else:
                m = s.beta1 * self.m.get(name, np.zeros_like(d)) + (1.0 - s.beta1) * d
                v_prev = self.v.get(name, np.full_like(d, s.tau * s.tau))
                d2 = d * d
                if s.kind == "adagrad":
                    v = v_prev + d2
                elif s.kind == "yogi":
                    v = v_prev - (1.0 - s.beta2) * d2 * np.sign(v_prev - d2)
                else:
                    v = s.beta2 * v_prev + (1.0 - s.beta2) * d2
                self.m[name], self.v[name] = m, v
                new = x + eta * m / (np.sqrt(v) + s.tau)
            out[name] = new.astype(np.float32)
        self.steps += 1
        return out

    # --- persistence (the coordinator stores these with each model version) ---------------------

    def state(self) -> dict[str, np.ndarray]:
        """Named float64 tensors: ``m/<name>``, ``v/<name>`` and ``steps``."""
        out = {f"m/{n}": a.copy() for n, a in self.m.items()}
        out.update({f"v/{n}": a.copy() for n, a in self.v.items()})
        out["steps"] = np.array([self.steps], dtype=np.float64)
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.m = {k[2:]: np.array(v, dtype=np.float64) for k, v in state.items() if k.startswith("m/")}
        self.v = {k[2:]: np.array(v, dtype=np.float64) for k, v in state.items() if k.startswith("v/")}
        self.steps = int(np.asarray(state.get("steps", [0])).reshape(-1)[0])
