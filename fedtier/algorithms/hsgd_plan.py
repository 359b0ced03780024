"""HSGD's communication cost model (eq. (19)) and adaptive strategies 1-3 (Sec. VI), as pure functions.

"Communication-Efficient Hybrid Federated Learning for E-health with Horizontal and Vertical Data
Partitioning" (Yu, Shen, Wang, Zhang, Zhao), Sec. VI. Sizes are numbers of values; the meter counts what
the paper counts (the theta1 upload per round, and per local interval the selected devices' theta2,
the head theta0, Z1 and Z2) and omits the downlinks — a "paper cost meter". ``bytes_round`` prices
those items as the wire carries them (float32, or the vertical path's row codec: ``qrows`` QSGD or
``topk``), which is what the edge's ``paper_bytes`` measures; ``vertical_hop_bytes`` counts the vertical
path on every hop (relays and downlinks included), which is what its ``vertical_bytes`` measures.

Strategy 2's erratum: setting eq. (20) to zero gives ``Q^2 = dF / (24 rho^2 eta^3 delta^2 T)``; the
paper prints ``eta^2``. ``strategy2`` computes both (``mode = "paper"`` is the printed form) and the
planner shows both with the difference flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedtier.errors import LocalProtocolError
from fedtier.wire import quant

MODES = ("paper", "derived")


@dataclass(frozen=True, slots=True)
class Sizes:
    """|theta0|, |theta1|, |theta2| in values, |A| selected devices per group, embedding widths d1, d2;
    ``classes`` C lays the head out as fedtier's split model does (a weight of C rows of d1 + d2, and a
    bias of C), 0 counts it as one row of |theta0| values (for sizes that are not a split model's)."""

    theta0: int
    theta1: int
    theta2: int
    selected: int
    d1: int
    d2: int
    classes: int = 0

    def vertical(self) -> int:
        """Values on the vertical path per interval: |theta0| + |Z1| + |Z2|."""
        return self.theta0 + self.selected * (self.d1 + self.d2)

    def head_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The head's tensors as they cross the wire."""
        if self.classes:
            if self.classes * (self.d1 + self.d2 + 1) != self.theta0:
                raise LocalProtocolError(f"|theta0| = {self.theta0} is not C (d1 + d2 + 1) for C = {self.classes}")
            return (self.classes, self.d1 + self.d2), (self.classes,)
        return ((self.theta0,),)


def tensor_bytes(shape: tuple[int, ...], bits: int = 32, compressor: str = "qsgd") -> int:
    """Body bytes of one vertical-path tensor on the wire: float32 (``bits = 32``), ``qrows`` QSGD (a 4-byte
    scale per row plus ``bits`` per value) or ``topk`` (per row ``ceil(width bits / 32)`` entries of an index
    and a float32 value)."""
    rows, width = quant.rows_of(shape)
    if bits == 32:
        return 4 * rows * width
    if compressor == "qsgd":
        return quant.qrows_size(shape, bits)
    if compressor == "topk":
        return quant.topk_size(shape, quant.topk_count(width, bits))
    raise LocalProtocolError(f"compressor must be 'qsgd' or 'topk', got {compressor!r}")


def _check_pq(P: int, Q: int) -> int:
    if not (isinstance(P, int) and isinstance(Q, int) and P >= 1 and Q >= 1) or P % Q:
        raise LocalProtocolError(f"P={P!r} must be a positive multiple of Q={Q!r}")
    return P // Q


def cost_round(s: Sizes, P: int, Q: int) -> int:
    """Values per group and global round: ``|theta1| + Lambda (|A||theta2| + |theta0| + |Z1| + |Z2|)``."""
    lam = _check_pq(P, Q)
    return s.theta1 + lam * (s.selected * s.theta2 + s.vertical())


def cost_total(s: Sizes, P: int, Q: int, M: int, T: int) -> float:
    """Eq. (19): ``(|theta1|/P + Lambda (|A||theta2| + |theta0| + |Z1| + |Z2|)/P) M T`` values."""
    lam = _check_pq(P, Q)
    return (s.theta1 / P + lam * (s.selected * s.theta2 + s.vertical()) / P) * M * T


def bytes_round(s: Sizes, P: int, Q: int, bits_embedding: int = 32, compressor: str = "qsgd") -> int:
    """``cost_round`` in bytes as the wire carries its items: theta1 and the devices' theta2 in float32; the
    head theta0, Z1 (host -> edge, one tensor of |A| rows) and Z2 (edge -> host, likewise) in the vertical
    path's encoding (``tensor_bytes``; 4 bytes a value in float32)."""
    lam = _check_pq(P, Q)
    horizontal = 4 * (s.theta1 + lam * s.selected * s.theta2)
    vertical = (sum(tensor_bytes(h, bits_embedding, compressor) for h in s.head_shapes())
                + tensor_bytes((s.selected, s.d1), bits_embedding, compressor)
                + tensor_bytes((s.selected, s.d2), bits_embedding, compressor))
    return horizontal + lam * vertical


def vertical_hop_bytes(s: Sizes, bits_embedding: int = 32, compressor: str = "qsgd") -> int:
    """Body bytes of the vertical path in one interval on every hop: |A| device rows of zeta2 up, Z2 to the
    host, Z1 and theta0 from it, and to each of the |A| devices its row of Z1 and theta0 (the downlink the
    paper's meter leaves out; with the edge re-encoding its relays, every hop is compressed)."""
    head = sum(tensor_bytes(h, bits_embedding, compressor) for h in s.head_shapes())
    return (s.selected * tensor_bytes((1, s.d2), bits_embedding, compressor)
            + tensor_bytes((s.selected, s.d2), bits_embedding, compressor)
            + tensor_bytes((s.selected, s.d1), bits_embedding, compressor) + head
            + s.selected * (tensor_bytes((1, s.d1), bits_embedding, compressor) + head))


def lambda_bound(*, P: int, rho: float, eta: float, delta: float, xi: float, dF: float, T: int) -> float:
    """Strategy 1 (Prop. 1): the smallest admissible Lambda = P/Q,
    ``4 sqrt(6) P rho eta delta / sqrt(Xi - 4 dF/(eta T) - 12 P rho eta delta^2)``; ``inf`` when the target
    ``xi`` cannot be met at this eta."""
    room = xi - 4 * dF / (eta * T) - 12 * P * rho * eta * delta ** 2
    if room <= 0:
        return math.inf
    return 4 * math.sqrt(6) * P * rho * eta * delta / math.sqrt(room)


def strategy2(*, F0: float, rho: float, eta: float, delta: float, T: int, mode: str = "paper") -> tuple[float, int]:
    """Strategy 2 (Prop. 2): ``P* = Q* = sqrt(F0 / (24 rho^2 eta^k delta^2 T))`` with ``k = 2`` as printed
    (``mode = "paper"``) or ``k = 3`` as eq. (20) gives (``"derived"``). Returns (value, integer >= 1)."""
    if mode not in MODES:
        raise LocalProtocolError(f"mode must be one of {MODES}, got {mode!r}")
    for name, v in (("F0", F0), ("rho", rho), ("eta", eta), ("delta", delta), ("T", T)):
        if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise LocalProtocolError(f"{name} must be positive and finite, got {v!r}")
    k = 2 if mode == "paper" else 3
    q = math.sqrt(F0 / (24 * rho ** 2 * eta ** k * delta ** 2 * T))
    return q, max(1, int(math.floor(q + 0.5)))


def strategy3(*, P: int, Q: int, rho: float, delta: float, grad_sq: float) -> tuple[float, float]:
    """Strategy 3 (Prop. 3): ``eta_2 = (-2b + sqrt(4b^2 + 12ac)) / (6a)`` with ``a = 24 Q^2 P rho^2 delta^2``,
    ``b = 3 P^2 rho delta^2``, ``c = (P/4) |grad F|^2``; returns ``(eta_2, eta* = min(eta_2, 1/(8 P rho)))``."""
    _check_pq(P, Q)
    a = 24 * Q ** 2 * P * rho ** 2 * delta ** 2
    b = 3 * P ** 2 * rho * delta ** 2
    c = P / 4 * grad_sq
    if a <= 0:
        raise LocalProtocolError("rho and delta must be positive")
    eta2 = (-2 * b + math.sqrt(4 * b * b + 12 * a * c)) / (6 * a)
    return eta2, min(eta2, 1.0 / (8 * P * rho))
