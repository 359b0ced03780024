"""Release records and the checks that no clear payload reaches an untrusted node.

Every noisy release travels with a record (plain data, inside the message header) saying who
added how much noise, for whom, against which sensitivity. Edges pass their devices' records
up; the cloud refuses any cell update whose noise the plan requires but whose records are
missing or weaker than planned — it may be a clear model. The coordinator writes the records
to its privacy ledger (``cloud_coordinator.privacy.ledger``).

Cell-level privacy report (``CellUpdate.privacy``)::

    {"trusted": bool,
     "steps": [[device ids that reported in edge round 0], ...],
     "releases": [record, ...],        # devices' (untrusted cell) or the edge's own (trusted)
     "clear": [{"sender": d, "receiver": cell, "step": i}, ...]}   # clear hops inside a trusted cell

Release record::

    {"node", "event": "device" | "edge", "round", "step", "sigma", "sensitivity", "z",
     "protected": [device ids],
     "inputs": {"clip", "reporters", "edge_rounds", "mode", "calibrated_sensitivity"}}

``sensitivity`` is the sound one (``fedtier.privacy.plan``) and ``z = sigma / sensitivity`` what
the ledger charges; ``calibrated_sensitivity`` is what sigma was calibrated against (Lemma 1's
``2C/n`` for a trusted edge in paper mode, else the same). The cloud refuses a record that
charges less than the sound sensitivity, claims a ``z`` its sigma does not support, or falls
below the planned multiplier.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from fedtier.errors import MissingReleaseError
from fedtier.privacy.plan import DEVICE_COUNT_SENSITIVITY, EDGE_COUNT_SENSITIVITY, NoisePlan

# A release may be stronger than planned, never weaker (beyond float rounding).
Z_TOLERANCE = 1e-9


def release_record(*, plan: NoisePlan, node: str, event: str, round: int, step: int, sigma: float,
                   sensitivity: float, protected: Iterable[str], reporters: int = 1,
                   z: float | None = None, calibrated_sensitivity: float | None = None,
                   count: tuple[float, float] | None = None) -> dict[str, Any]:
    """One release's record; ``z`` defaults to ``sigma / sensitivity`` (pass it to keep a planned value exact),
    ``calibrated_sensitivity`` to ``sensitivity``; ``count`` is adaptive clipping's noised centred count released
    with it and that noise's std (``z`` then charges both)."""
    if z is None:
        z = sigma / sensitivity if sensitivity > 0 else math.inf
    calibrated = sensitivity if calibrated_sensitivity is None else calibrated_sensitivity
    inputs: dict[str, Any] = {"clip": plan.clip, "reporters": int(reporters), "edge_rounds": plan.edge_rounds,
                              "mode": plan.mode, "calibrated_sensitivity": float(calibrated)}
    if plan.sampled and event == "edge":  # an amplified release: the ledger charges it as a sampled Gaussian
        q, population = plan.edge_event(node)
        inputs.update(sample_rate=float(q), population=int(population))
    record = {"node": node, "event": event, "round": int(round), "step": int(step), "sigma": float(sigma),
              "sensitivity": float(sensitivity), "z": float(z), "protected": sorted(protected), "inputs": inputs}
    if count is not None:
        record.update(count=float(count[0]), count_stddev=float(count[1]))
        inputs["count_stddev"] = float(count[1])  # on the ledger: this release's z also paid for a count
    return record


def _check_count(plan: NoisePlan, record: Mapping[str, Any], z: float, sensitivity: float) -> None:
    """Adaptive clipping: the release carries its noised centred count, with at least the planned noise."""
    if plan.adaptive is None:
        return
    count, stddev = _number(record, "count"), _number(record, "count_stddev")
    planned = plan.count_stddev(z, sensitivity)
    if not math.isfinite(count) or stddev < planned * (1 - Z_TOLERANCE):
        raise MissingReleaseError(f"release of {record.get('node')!r} carries a clipped count with noise std "
                                  f"{stddev:.6g}, below the planned {planned:.6g}")


def sampling_of(row: Mapping[str, Any]) -> tuple[float, int]:
    """(q, population) a ledger row is charged with: (1, 0) unless its release was amplified by sampling."""
    inputs = row.get("inputs") or {}
    return float(inputs.get("sample_rate", 1.0)), int(inputs.get("population", 0))


def _number(record: Mapping[str, Any], key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise MissingReleaseError(f"release record of {record.get('node')!r} has no valid {key}")
    return float(value)


def _z(record: Mapping[str, Any]) -> float:
    return _number(record, "z")


def _check_charge(record: Mapping[str, Any], sound: float) -> None:
    """The record charges at least the sound sensitivity, and a ``z`` its sigma supports."""
    sensitivity, sigma, z = _number(record, "sensitivity"), _number(record, "sigma"), _z(record)
    if sensitivity < sound * (1 - Z_TOLERANCE):
        raise MissingReleaseError(f"release of {record.get('node')!r} charges sensitivity {sensitivity:.6g}, below "
                                  f"the sound {sound:.6g}")
    if sensitivity <= 0 or z > sigma / sensitivity * (1 + Z_TOLERANCE):
        raise MissingReleaseError(f"release of {record.get('node')!r} claims multiplier {z:.6g}, more than its "
                                  f"sigma {sigma:.6g} / sensitivity {sensitivity:.6g} supports")


def check_device_release(plan: NoisePlan, cell: str, sender: str, round: int, step: int,
                         record: Mapping[str, Any] | None) -> None:
    """An untrusted edge's (and the cloud's) check of one device upload."""
    p = plan.cells[cell]
    if p.trusted:
        return
    if not isinstance(record, Mapping):
        raise MissingReleaseError(f"update of {sender} (round {round}, step {step}) carries no noise record, but "
                                  f"cell {cell} is untrusted: the device must add noise")
    if record.get("node") != sender or record.get("round") != round or record.get("step") != step \
            or record.get("event") != "device":
        raise MissingReleaseError(f"noise record of {sender} names {record.get('node')!r} round "
                                  f"{record.get('round')!r} step {record.get('step')!r}")
    if _z(record) < p.device_z * (1 - Z_TOLERANCE):
        raise MissingReleaseError(f"{sender} added noise with multiplier {_z(record):.6g}, "
                                  f"below the planned {p.device_z:.6g}")
    _check_charge(record, plan.device_sensitivity)
    _check_count(plan, record, p.device_z, DEVICE_COUNT_SENSITIVITY)


def check_cell_update(plan: NoisePlan, cell: str, round: int, privacy: Mapping[str, Any] | None,
                      reported: Iterable[str]) -> None:
    """The cloud's audit of one cell update: every injection the plan requires is on record.

    Raises:
        MissingReleaseError: naming what is missing.
    """
    if cell not in plan.cells:
        raise MissingReleaseError(f"cell {cell} is not in the noise plan")
    p = plan.cells[cell]
    if not isinstance(privacy, Mapping):
        raise MissingReleaseError(f"update of cell {cell} (round {round}) carries no privacy report")
    steps, releases = _report_lists(cell, privacy, reported)
    if bool(privacy.get("trusted")) != p.trusted:
        raise MissingReleaseError(f"cell {cell} says trusted={privacy.get('trusted')!r}, the plan {p.trusted}")
    if p.distributed:
        _check_distributed(plan, cell, round, privacy, steps, releases)
    elif p.trusted:
        _check_trusted_edge(plan, cell, round, steps, releases)
    else:
        by_key = {(r.get("node"), r.get("step")): r for r in releases if isinstance(r, Mapping)}
        for i, step_reporters in enumerate(steps):
            for device in step_reporters:
                check_device_release(plan, cell, device, round, i, by_key.get((device, i)))


def _report_lists(cell: str, privacy: Mapping[str, Any], reported: Iterable[str]) -> tuple[list[list[str]], list[Any]]:
    """The report's ``steps`` (device ids per edge round) and ``releases``, after checking their shape, and that
    every device whose update is in the aggregate appears in some step: an unlisted reporter escapes the audit."""
    steps = privacy.get("steps")
    releases = privacy.get("releases")
    if not isinstance(steps, list) or not isinstance(releases, list) or \
            not all(isinstance(s, list) and all(isinstance(d, str) for d in s) for s in steps):
        raise MissingReleaseError(f"privacy report of cell {cell} is malformed")
    if set(reported) - {d for s in steps for d in s}:
        raise MissingReleaseError(f"cell {cell} reports devices without a step record")
    return steps, releases


def _check_trusted_edge(plan: NoisePlan, cell: str, round: int, steps: list[list[str]], releases: list[Any]) -> None:
    """A trusted edge's own release: exactly one, for this round, covering every reporter, at no less than the
    multiplier the plan charges for the fewest reporters of any edge round."""
    own = [r for r in releases if isinstance(r, Mapping) and r.get("node") == cell and r.get("event") == "edge"]
    if len(own) != 1:
        raise MissingReleaseError(f"trusted cell {cell} sent its aggregate without exactly one noise release "
                                  f"(found {len(own)})")
    record = own[0]
    if record.get("round") != round:
        raise MissingReleaseError(f"noise record of cell {cell} is for round {record.get('round')!r}")
    covered = set(record.get("protected") or ())
    missing = {d for s in steps for d in s} - covered
    if missing:
        raise MissingReleaseError(f"noise release of cell {cell} does not cover {sorted(missing)}")
    if not steps or not all(steps):
        raise MissingReleaseError(f"trusted cell {cell} reports an edge round without reporters")
    reporters = min(len(s) for s in steps)
    planned = plan.edge_charged_z(cell, reporters)
    if _z(record) < planned * (1 - Z_TOLERANCE):
        raise MissingReleaseError(f"cell {cell} added noise with multiplier {_z(record):.6g}, below the planned "
                                  f"{planned:.6g}")
    _check_charge(record, plan.edge_sensitivity(reporters))
    _check_count(plan, record, planned, EDGE_COUNT_SENSITIVITY)


def _check_distributed(plan: NoisePlan, cell: str, round: int, privacy: Mapping[str, Any], steps: list[Any],
                       releases: list[Any]) -> None:
    """A distributed-DP cell (secure aggregation): one release for the cell, made of at least ``s_min``
    devices' noise shares, covering everyone in the sum, at no less than the planned multiplier."""
    p = plan.cells[cell]
    if privacy.get("distributed") is not True:
        raise MissingReleaseError(f"cell {cell} runs distributed DP (secure aggregation) but its report does not "
                                  "say so: its update may hold no device noise")
    own = [r for r in releases if isinstance(r, Mapping) and r.get("node") == cell and r.get("event") == "edge"]
    if len(own) != 1 or len(steps) != 1 or not steps[0]:
        raise MissingReleaseError(f"distributed-DP cell {cell} sent its sum without exactly one release over one "
                                  f"step (found {len(own)} releases, {len(steps)} steps)")
    record = own[0]
    if record.get("round") != round:
        raise MissingReleaseError(f"noise record of cell {cell} is for round {record.get('round')!r}")
    survivors = steps[0]
    if set(survivors) - set(record.get("protected") or ()):
        raise MissingReleaseError(f"noise release of cell {cell} does not cover {sorted(set(survivors))}")
    inputs = record.get("inputs") or {}
    if not isinstance(inputs, Mapping) or _number(inputs, "survivors") < p.min_survivors \
            or len(survivors) < p.min_survivors:
        raise MissingReleaseError(f"cell {cell}'s sum holds the noise of fewer than s_min = {p.min_survivors} "
                                  "devices")
    planned = plan.edge_charged_z(cell)
    if _z(record) < planned * (1 - Z_TOLERANCE):
        raise MissingReleaseError(f"cell {cell}'s sum carries noise with multiplier {_z(record):.6g}, below the "
                                  f"planned {planned:.6g}")
    _check_charge(record, plan.edge_sensitivity(p.members if plan.sampled else len(survivors)))
