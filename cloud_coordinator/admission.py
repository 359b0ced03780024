"""Admission: a rollout's model is trained for a few steps on every trainer path before it ships.

A model that crashes onnxruntime natively kills every device that trains it, with nothing in
its log (the signal ends the process inside ``module_step``), and the next rollout with it
(DESIGN §9, containment). So before a rollout is created or started, each of its bundles (the
model's; HIST's per-cell submodels; HSGD's split model) is run in a **child process**, once per
trainer path a device may use:

* ``ort`` — onnxruntime-training on the bundle's artifacts (``OrtTrainer``);
* ``portable`` — the bundle's portable graph with numpy SGD (``PortableTrainer``) on the
  onnxruntime the coordinator has, when the bundle has a portable graph (a bundle without one
  is refused by name on such devices: a warning at build time, as before);
* ``split`` — HSGD's split model on onnxruntime-training (``OrtSplitTrainer``), both sides.
  HSGD devices without onnxruntime-training run the numpy split model, which has no native
  code to crash.

The trial is :data:`STEPS` SGD steps on a random batch of :data:`BATCH` rows shaped like the
model's input (uniform in [0, 1)) with labels for its loss, then an evaluation. The child dies
by a signal (a native crash), raises (its message; the op when onnxruntime names it), or
reports a non-finite loss, parameter or evaluation: any of these refuses the rollout with
:class:`ModelRefused` (a ``ConfigError`` of key ``model``: exit 2), whose message names the
trainer, the op when known and what would help. For a native crash the op is found in the
training graph among the ops known to crash (:data:`KNOWN_CRASHES`), else among the ops
fedtier's portable lowering does not know (``PortableInfo.unsupported_ops``: the unusual ones),
else the message says "somewhere in the training graph".

The child runs ``python -m cloud_coordinator.admission`` with the same interpreter, imports
numpy, fedtier and the device trainers only (no torch: about 0.7 s to start and load a small
model), and writes JSON lines on stdout: ``{"index": i, "stage": ...}`` as it goes (so the
parent knows which bundle and stage a crash hit), then ``{"index": i, "outcome": ...}`` per
bundle. One child per trainer path trials all bundles of that path; the paths run side by
side; after a crash the bundles not reached yet go to a fresh child.

Results are cached in the artifact store, ``<store>/admitted/<bundle_id>.json``, per trainer
path, runtime (distribution and version) and trial recipe: a second prepare of the same
artifacts reads a small file. Timeouts and deaths by SIGKILL/SIGTERM (out of memory, an
operator) are not cached: they may say more about the machine than about the model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np

from fedtier.artifacts.bundle import ArtifactBundle, write_text_atomic
from fedtier.artifacts.split_bundle import SplitBundle
from fedtier.errors import ConfigError
from fedtier.training.layout import PROX_UNSUPPORTED, SCORE_LOSSES

log = logging.getLogger("fedtier.admission")

Bundle = Union[ArtifactBundle, SplitBundle]

TRAINER_PATHS = ("ort", "portable")
"""The trainer paths a deployed rollout's devices may use (``device_agent.trainers.resolve_kind``)."""
STEPS = 3
BATCH = 8
LR = 0.01
SEED = 0
TIMEOUT_S = 300.0
"""A child that has not finished by then is killed and the rollout refused (not cached)."""
CACHE_DIR = "admitted"
CACHE_FORMAT = 1
UNCACHED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP")
                         if hasattr(signal, name))

KNOWN_CRASHES: dict[str, str] = {
    "AveragePoolGrad": "the gradient of an AvgPool1d/AvgPool2d layer behind a trained one, where "
                       "onnxruntime-training 1.19.2 dies with SIGFPE",
}
"""Ops of a training graph known to kill onnxruntime-training natively, with what adds them."""
LAYER_HELP: dict[str, str] = {
    "AveragePoolGrad": "replace the AvgPool layer with MaxPool1d/MaxPool2d, global average pooling "
                       "(AdaptiveAvgPool1d(1)) or a Conv with stride 2 (both trainers train those)",
}
"""What helps, per op, when the onnxruntime-training path fails in it."""
_ORT_NODE = re.compile(r"running (\w+) node")
_ORT_STATUS = re.compile(r"running (\w+) node\. Name:'([^']*)' Status Message: (.*)", re.S)
_STAGES = {"load": "while loading the model", "train": "in a training step", "evaluate": "while evaluating"}


@dataclass(frozen=True)
class Trial:
    """One bundle on one trainer path: what the child reported (or how it died)."""

    bundle_id: str
    trainer: str
    """``ort``, ``portable`` or ``split``."""
    runtime: str
    """The distribution and version that ran it, e.g. ``onnxruntime-training-cpu 1.19.2``."""
    outcome: str
    """``ok``, ``crash`` (a signal), ``error``, ``non-finite`` or ``timeout``."""
    detail: str = ""
    stage: str | None = None
    """Where it failed: ``load``, ``train`` or ``evaluate``."""
    op: str | None = None
    op_guessed: bool = False
    """A crash's op inferred as the one op of the graph without a portable lowering (not a known crash)."""
    seconds: float = 0.0
    cacheable: bool = True

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def describe(self) -> str:
        """One line: trainer, runtime, bundle, what happened, where, in which op."""
        where = _STAGES.get(self.stage or "", self.stage or "")
        what = {"crash": f"killed by {self.detail} {where}", "timeout": f"no result within {self.detail} {where}",
                "non-finite": self.detail, "error": f"failed {where}"}.get(self.outcome, self.outcome).rstrip()
        if self.op and self.op_guessed:
            what += f", probably in op {self.op} (the one op of its training graph without a portable lowering)"
        elif self.op:
            what += f", in op {self.op}" + (f" ({KNOWN_CRASHES[self.op]})" if self.op in KNOWN_CRASHES else "")
        elif self.outcome == "crash":
            what += ", somewhere in the training graph (it holds no op known to crash)"
        if self.outcome == "error":
            what += f": {self.detail}"
        return f"{self.trainer} trainer ({self.runtime}), bundle {self.bundle_id[:12]}: {what}"


@dataclass(frozen=True)
class Admission:
    """Every trial of a rollout's bundles (all passed), and what it cost."""

    trials: tuple[Trial, ...]
    seconds: float
    cached: int
    """How many trials came from the cache."""


class ModelRefused(ConfigError):
    """A trial failed: the rollout must not ship this model. ``trials`` are the failed ones."""

    def __init__(self, message: str, trials: Sequence[Trial]) -> None:
        super().__init__(message, key="model")
        self.trials = tuple(trials)


# --- the parent --------------------------------------------------------------------------------


def admit(bundles: Iterable[Bundle], store: Path | str, trainers: Sequence[str] = TRAINER_PATHS, *,
          lr: float = LR, timeout_s: float = TIMEOUT_S, labels: dict[str, str] | None = None) -> Admission:
    """Trial every bundle on every path of ``trainers`` a device may use; refuse on any failure.

    Args:
        bundles: The rollout's bundles (the model's, HIST's per cell, or HSGD's split bundle).
        store: The artifact store they are in (the cache goes to ``<store>/admitted/``).
        trainers: The paths devices may use: ``ort`` and ``portable`` for a deployment; a
            simulation pins its trainer (``ort`` always: the coordinator evaluates with it). A
            split bundle runs its ``split`` path when ``ort`` is among them.
        lr: The trial's learning rate (part of the cache key).
        timeout_s: Per child process.
        labels: bundle_id -> what the bundle is (e.g. "cell c1's submodel"), for the message.

    Returns:
        The trials, all passed.

    Raises:
        ModelRefused: A trial crashed, raised or gave a non-finite result.
    """
    started = time.perf_counter()
    unique = list({_bundle_id(b): b for b in bundles}.values())
    trials: list[Trial] = []
    todo: dict[str, list[Bundle]] = {}
    cached = 0
    for bundle in unique:
        for path in paths_for(bundle, trainers):
            hit = _cached(Path(store), _bundle_id(bundle), _key(path, lr))
            if hit is not None:
                trials.append(hit)
                cached += 1
            else:
                todo.setdefault(path, []).append(bundle)
    if todo:
        with concurrent.futures.ThreadPoolExecutor(len(todo)) as pool:
            futures = [pool.submit(_run_path, path, items, lr, timeout_s) for path, items in todo.items()]
            for future in futures:
                for trial in future.result():
                    trials.append(trial)
                    if trial.cacheable:
                        _remember(Path(store), trial, _key(trial.trainer, lr))
    seconds = time.perf_counter() - started
    failed = [t for t in trials if not t.ok]
    if failed:
        raise ModelRefused(refusal(failed, unique, labels or {}), failed)
    if todo:
        log.info("admitted %d bundle(s) on %s in %.1f s (%d trial(s) cached)", len(unique),
                 ", ".join(sorted({t.trainer for t in trials})), seconds, cached)
    return Admission(trials=tuple(trials), seconds=seconds, cached=cached)


def paths_for(bundle: Bundle, trainers: Sequence[str]) -> list[str]:
    """The trainer paths ``bundle`` is trialled on, given the paths devices may use."""
    if isinstance(bundle, SplitBundle):
        return ["split"] if "ort" in trainers else []
    paths = ["ort"] if "ort" in trainers else []
    if "portable" in trainers and bundle.has_portable_graph:
        paths.append("portable")
    return paths


def runtime(path: str) -> str:
    """The distribution a path runs on here, with its version (read without importing it)."""
    dists: tuple[str, ...] = ("onnxruntime-training-cpu", "onnxruntime-training")
    if path == "portable":  # the stock build where it is installed, else the training build's inference side
        dists = ("onnxruntime", *dists)
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "onnxruntime (not installed)"


def refusal(failed: Sequence[Trial], bundles: Sequence[Bundle], labels: dict[str, str]) -> str:
    """The refusal: every failed trial, what the portable path says, and what would help."""
    by_id = {_bundle_id(b): b for b in bundles}
    lines = ["the model crashes or fails on a trainer the devices use, so the rollout is refused before anything "
             "is published:"]
    for trial in failed:
        label = labels.get(trial.bundle_id)
        lines.append(f"  - {trial.describe()}" + (f" [{label}]" if label else ""))
    native = {t.bundle_id for t in failed if t.trainer in ("ort", "split")}
    for bundle_id in sorted(native):
        bundle = by_id.get(bundle_id)
        if isinstance(bundle, ArtifactBundle) and bundle.portable is not None and bundle.portable.unsupported_ops \
                and PROX_UNSUPPORTED not in bundle.portable.unsupported_ops:
            lines.append(f"  - portable trainer: bundle {bundle_id[:12]} has no portable training graph (no lowering "
                         f"for {', '.join(bundle.portable.unsupported_ops)}), so devices without "
                         "onnxruntime-training cannot train it either")
    lines.append(f"What would help: {_help(failed)} (docs/models.md, \"Admission\").")
    return "\n".join(lines)


def _help(failed: Sequence[Trial]) -> str:
    advice: list[str] = []
    for trial in failed:
        if trial.op in LAYER_HELP and not trial.op_guessed:
            advice.append(LAYER_HELP[trial.op])
        elif trial.outcome == "crash":
            advice.append(f"a supported layer instead of the one that adds {trial.op}" if trial.op else
                          "a supported layer instead of the one whose gradient crashes (docs/models.md lists the "
                          "layers both trainers run)")
        elif trial.outcome == "error":
            advice.append(f"fix what the error says: the trial feeds {BATCH} rows shaped like the model's input, so "
                          "a model that runs only on its example's batch size fails there as on the devices")
        elif trial.outcome == "non-finite":
            advice.append("make the model finite on inputs in [0, 1) (a log, square root or division of values "
                          "that can be <= 0 gives NaN), or check its initial weights")
        else:
            advice.append("run it again on a less loaded machine; if it times out again, the model is too big "
                          "for a few steps on one thread")
    advice = list(dict.fromkeys(advice))
    if all(t.trainer == "portable" for t in failed):
        advice.append("devices running trainer = \"ort\" (onnxruntime-training) train it, but any device on the "
                      "portable trainer would fail on every task (`fedtier simulate --trainer ort` simulates it on "
                      "onnxruntime-training only)")
    return "; ".join(advice)


def _bundle_id(bundle: Bundle) -> str:
    return bundle.bundle_id


def _key(path: str, lr: float) -> str:
    return f"{path}|{runtime(path)}|steps={STEPS},batch={BATCH},lr={lr!r},seed={SEED}"


def _cache_path(store: Path, bundle_id: str) -> Path:
    return store / CACHE_DIR / f"{bundle_id}.json"


def _read_cache(store: Path, bundle_id: str) -> dict[str, Any]:
    try:
        doc = json.loads(_cache_path(store, bundle_id).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("bundle_id") != bundle_id:
        return {}
    results = doc.get("results")
    return results if isinstance(results, dict) else {}


def _cached(store: Path, bundle_id: str, key: str) -> Trial | None:
    entry = _read_cache(store, bundle_id).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        return Trial(**entry)
    except TypeError:
        return None


def _remember(store: Path, trial: Trial, key: str) -> None:
    """Add ``trial`` to its bundle's cache file (atomic; a lost race only costs a trial later)."""
    try:
        path = _cache_path(store, trial.bundle_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        results = _read_cache(store, trial.bundle_id)
        results[key] = asdict(trial)
        write_text_atomic(path, json.dumps({"format": CACHE_FORMAT, "bundle_id": trial.bundle_id,
                                            "results": results}, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        log.debug("cannot cache the admission of %s: %s", trial.bundle_id[:12], exc)


def _run_path(path: str, bundles: Sequence[Bundle], lr: float, timeout_s: float) -> list[Trial]:
    """Trial ``bundles`` on ``path`` in child processes: one, plus a fresh one after each crash."""
    out: list[Trial] = []
    pending = list(bundles)
    where = runtime(path)
    while pending:
        done, rest = _child_run(path, pending, lr, timeout_s, where)
        out.extend(done)
        if len(rest) == len(pending):  # the child made no progress (it did not start): all pending fail
            break
        pending = rest
    return out


def _child_run(path: str, bundles: Sequence[Bundle], lr: float, timeout_s: float, where: str
               ) -> tuple[list[Trial], list[Bundle]]:
    """One child over ``bundles``: the trials it finished (or died in), and the bundles it did not reach."""
    directories = [str(b.directory) for b in bundles]
    command = [sys.executable, "-m", "cloud_coordinator.admission", "--trainer", path, "--lr", repr(lr), *directories]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the child imports this very checkout or install
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    started = time.perf_counter()
    timed_out = False
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env,
                              stdin=subprocess.DEVNULL)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        timed_out = True
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        code = None
    seconds = time.perf_counter() - started
    outcomes: dict[int, dict[str, Any]] = {}
    stage: tuple[int, str] | None = None
    for line in stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("index"), int):
            continue
        if "outcome" in doc:
            outcomes[doc["index"]] = doc
            stage = None
        elif "stage" in doc:
            stage = (doc["index"], str(doc["stage"]))
    trials: list[Trial] = []
    for index, doc in sorted(outcomes.items()):
        if 0 <= index < len(bundles):
            trials.append(Trial(bundle_id=_bundle_id(bundles[index]), trainer=path, runtime=where,
                                outcome=str(doc["outcome"]), detail=str(doc.get("detail", "")),
                                stage=doc.get("stage"), op=doc.get("op"), seconds=round(seconds, 3)))
    reached = max(outcomes, default=-1) + 1
    if reached >= len(bundles):
        if code != 0:
            log.debug("admission child (%s) exited with %s after its last trial", path, _exit(code))
        return trials, []
    tail = stderr.strip()[-2000:]
    if stage is None:
        # Nothing started: the interpreter or an import failed (or was too slow); the rest is not trialled.
        first = _bundle_id(bundles[reached])
        if timed_out:
            failed = Trial(bundle_id=first, trainer=path, runtime=where, outcome="timeout", detail=f"{timeout_s:g} s",
                           seconds=round(seconds, 3), cacheable=False)
        else:
            log.error("admission child (%s) exited with %s before a trial:\n%s", path, _exit(code), tail)
            failed = Trial(bundle_id=first, trainer=path, runtime=where, outcome="error", seconds=round(seconds, 3),
                           detail=f"the trial process exited with {_exit(code)} before training: {_last_line(tail)}",
                           cacheable=False)
        return trials + [failed], []
    index, where_stage = stage
    bundle = bundles[index]
    log.debug("admission child (%s) on %s stopped in %s with %s; stderr:\n%s", path, _bundle_id(bundle)[:12],
              where_stage, code, tail)
    if timed_out:
        trials.append(Trial(bundle_id=_bundle_id(bundle), trainer=path, runtime=where, outcome="timeout",
                            detail=f"{timeout_s:g} s", stage=where_stage, seconds=round(seconds, 3),
                            cacheable=False))
    elif code is not None and code < 0:
        number = -code
        op, guessed = _crash_op(bundle, path)
        trials.append(Trial(bundle_id=_bundle_id(bundle), trainer=path, runtime=where, outcome="crash",
                            detail=_signal_name(number), stage=where_stage, op=op, op_guessed=guessed,
                            seconds=round(seconds, 3), cacheable=number not in UNCACHED_SIGNALS))
    else:
        trials.append(Trial(bundle_id=_bundle_id(bundle), trainer=path, runtime=where, outcome="error",
                            detail=f"the trial process exited with {_exit(code)}: {_last_line(tail)}",
                            stage=where_stage, seconds=round(seconds, 3)))
    return trials, list(bundles[index + 1:])


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return _signal_name(-code)
    return f"code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def _crash_op(bundle: Bundle, path: str) -> tuple[str | None, bool]:
    """The op a native crash was in, and whether that is a guess: an op of the graph known to crash, else
    (a guess) the one op the portable lowering does not know, the unusual one. Read as bytes: op types are
    plain strings in the protobuf, and the coordinator need not parse the graph for this."""
    if isinstance(bundle, SplitBundle):
        return None, False
    try:
        raw = bundle.path("portable_model" if path == "portable" else "training_model").read_bytes()
    except OSError:
        return None, False
    known = [op for op in KNOWN_CRASHES if op.encode() in raw]
    if known:
        return known[0], False
    unsupported = [op for op in (bundle.portable.unsupported_ops if bundle.portable else ())
                   if op != PROX_UNSUPPORTED and not op.startswith("graph inputs")]
    if path == "ort" and len(unsupported) == 1:
        return unsupported[0], True
    return None, False


# --- the child ---------------------------------------------------------------------------------


def _labels(loss: str, outputs: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Labels for ``loss``: class numbers, 0/1 targets (bce), values (mse), 0/1 rows (a scorer)."""
    if loss == "cross_entropy":
        return rng.integers(0, outputs, batch).astype(np.int64)
    if loss in SCORE_LOSSES:
        return (np.arange(batch) % 2).astype(np.int64)
    if loss == "bce":
        return rng.integers(0, 2, (batch, outputs)).astype(np.float32)
    return rng.random((batch, outputs), dtype=np.float32)


def _concise(exc: Exception) -> tuple[str, str | None]:
    """An error's message without onnxruntime's source locations, and the op it names (if any)."""
    text = " ".join(str(exc).split())
    found = _ORT_STATUS.search(text)
    if found is None:
        node = _ORT_NODE.search(text)
        return f"{type(exc).__name__}: {text}"[:500], node.group(1) if node else None
    op, node_name, status = found.groups()
    status = status.split(" was false. ", 1)[-1] if status.startswith("/") else status
    return f"onnxruntime failed in node {node_name!r}: {status}"[:500], op


def _finite(value: Any) -> bool:
    return bool(np.all(np.isfinite(np.asarray(value, dtype=np.float64))))


def _nonfinite(params: dict[str, np.ndarray], when: str) -> str | None:
    bad = [name for name, value in params.items() if not _finite(value)]
    return f"non-finite parameters {', '.join(bad[:3])} {when}" if bad else None


def trial_bundle(kind: str, directory: Path, stage: Callable[[str], None], *, lr: float = LR, steps: int = STEPS,
                 batch: int = BATCH, seed: int = SEED) -> tuple[str, str]:
    """Train an ``ArtifactBundle`` for ``steps`` on a random batch and evaluate it (in this process).

    Returns:
        ``("ok", "")`` or ``("non-finite", what)``. Errors propagate.
    """
    from device_agent.trainers import make_trainer

    stage("load")
    bundle = ArtifactBundle.load(directory, verify=False)  # the parent verified it
    trainer = make_trainer(kind, bundle, threads=1)
    arch = bundle.arch
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *arch.input_shape), dtype=np.float32)
    y = _labels(arch.loss, arch.num_classes, batch, rng)
    trainer.set_parameters(trainer.get_parameters())  # FedProx: the anchor the proximal term pulls to
    stage("train")
    for step in range(1, steps + 1):
        if arch.loss in SCORE_LOSSES:
            grads, loss = trainer.score_gradient(x, rng.standard_normal(batch).astype(np.float32))
            bad = _nonfinite(grads, f"in the gradient at step {step}")
            if bad:
                return "non-finite", bad
            trainer.apply_step(grads, lr)
        else:
            loss = trainer.train_steps([(x, y)], lr).mean_loss
        if not _finite(loss):
            return "non-finite", f"the training loss is {float(loss)} at step {step}"
        bad = _nonfinite(trainer.get_parameters(), f"after step {step}")
        if bad:
            return "non-finite", bad
    stage("evaluate")
    result = trainer.evaluate(x, y)
    if not _finite(result.loss):
        return "non-finite", f"the evaluation loss is {result.loss}"
    return "ok", ""


def trial_split(directory: Path, stage: Callable[[str], None], *, lr: float = LR, steps: int = STEPS,
                batch: int = BATCH, seed: int = SEED) -> tuple[str, str]:
    """HSGD's split model: both sides train ``steps`` on random rows, and both encoders embed them."""
    from device_agent.trainers.ort_split import OrtSplitTrainer
    from fedtier.training import split

    stage("load")
    bundle = SplitBundle.load(directory)
    arch = bundle.arch
    rng = np.random.default_rng(seed)
    ids = tuple(f"r{i}" for i in range(batch))
    x1 = rng.random((batch, arch.x1), dtype=np.float32)
    x2 = rng.random((batch, arch.x2), dtype=np.float32)
    y = rng.integers(0, arch.classes, batch)
    host = OrtSplitTrainer(bundle, "host", dict(zip(ids, x1, strict=True)), dict(zip(ids, y.tolist(), strict=True)))
    device = OrtSplitTrainer(bundle, "device", {ids[0]: x2[0]}, {ids[0]: int(y[0])})
    params = split.init_params(arch, bundle.seed)
    stage("train")
    host_params = {**split.block(params, "theta0"), **split.block(params, "theta1")}
    trained, loss = host.train("host", host_params, {}, split.embed(params, "theta2", x2), ids, steps, lr)
    bad = _nonfinite(trained, "on the host") or (None if _finite(loss) else f"the host's loss is {loss}")
    if bad:
        return "non-finite", bad
    mine, loss = device.train("device", split.block(params, "theta2"), split.block(params, "theta0"),
                              split.embed(params, "theta1", x1[:1]), ids[:1], steps, lr)
    bad = _nonfinite(mine, "on a device") or (None if _finite(loss) else f"a device's loss is {loss}")
    if bad:
        return "non-finite", bad
    stage("evaluate")
    if not _finite(host.embed("theta1", trained, ids)) or not _finite(device.embed("theta2", mine, ids[:1])):
        return "non-finite", "non-finite embeddings"
    return "ok", ""


def main(argv: Sequence[str] | None = None) -> int:
    """The child: trial each bundle directory on one path, one JSON line per stage and per outcome."""
    parser = argparse.ArgumentParser(prog="python -m cloud_coordinator.admission")
    parser.add_argument("--trainer", choices=("ort", "portable", "split"), required=True)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("directories", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a native crash leaves no core file behind
    except (ImportError, ValueError, OSError):
        pass
    import faulthandler

    faulthandler.enable()  # the Python stack of a native crash, on stderr (the parent logs it at debug)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def emit(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    for index, directory in enumerate(args.directories):
        current = {"stage": "load"}

        def stage(name: str, index: int = index, current: dict[str, str] = current) -> None:
            current["stage"] = name
            emit({"index": index, "stage": name})

        try:
            if args.trainer == "split":
                outcome, detail = trial_split(directory, stage, lr=args.lr)
            else:
                outcome, detail = trial_bundle(args.trainer, directory, stage, lr=args.lr)
            op = None
        except Exception as exc:  # noqa: BLE001 - any error refuses the model, with its message
            outcome, detail, op = "error", *_concise(exc)
        doc: dict[str, Any] = {"index": index, "outcome": outcome, "detail": detail,
                               "stage": current["stage"] if outcome != "ok" else None}
        if op:
            doc["op"] = op
        emit(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
