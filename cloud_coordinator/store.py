"""The coordinator's durable state (SQLite): rollouts, model versions, rounds, open-round inputs.

Model parameters are stored as wire envelopes (float32 tensors, sha256-checked), never
pickled. A round is committed in one transaction together with its model version, so a
coordinator killed at any point resumes either before or after the round, never between.
The cell updates accepted in the open round are kept until it closes; a restarted
coordinator replays them (like the edge) and loses nothing it had acknowledged.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedtier import wire
from fedtier.storage.sqlite import Database


def encode_params(params: Mapping[str, np.ndarray], *, rollout: str, round: int) -> bytes:
    env = wire.Envelope(type="model_snapshot", rollout=rollout, round=max(round, 0), sender="cloud",
                        key=f"model/{rollout}/{round}", tensors=dict(params))
    return wire.encode(env)


def decode_params(blob: bytes) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32) for k, v in wire.decode(blob).tensors.items()}


def encode_state(state: Mapping[str, np.ndarray]) -> bytes:
    """A strategy's state (float64 tensors: a server optimizer's moments) as an ``.npz`` (no pickle)."""
    buf = io.BytesIO()
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in state.items()}
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode_state(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


@dataclass(frozen=True)
class ModelVersion:
    version: int
    round: int
    sha256: str
    params: dict[str, np.ndarray]


SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout TEXT PRIMARY KEY, config TEXT NOT NULL, manifest BLOB NOT NULL,
    status TEXT NOT NULL, created REAL NOT NULL, finished REAL);
CREATE TABLE IF NOT EXISTS models (
    rollout TEXT NOT NULL, version INTEGER NOT NULL, round INTEGER NOT NULL,
    sha256 TEXT NOT NULL, params BLOB NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (rollout, version));
CREATE TABLE IF NOT EXISTS rounds (
    rollout TEXT NOT NULL, round INTEGER NOT NULL, closed REAL NOT NULL,
    accuracy REAL, loss REAL, metrics TEXT NOT NULL, PRIMARY KEY (rollout, round));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS inputs (
    rollout TEXT NOT NULL, round INTEGER NOT NULL, msg_key TEXT NOT NULL,
    payload BLOB NOT NULL, PRIMARY KEY (rollout, msg_key));
CREATE TABLE IF NOT EXISTS privacy_releases (
    rollout TEXT NOT NULL, round INTEGER NOT NULL, event TEXT NOT NULL, step INTEGER NOT NULL,
    node TEXT NOT NULL, parent TEXT NOT NULL, parent_trusted INTEGER NOT NULL, protected TEXT NOT NULL,
    sensitivity REAL NOT NULL, inputs TEXT NOT NULL, sigma REAL NOT NULL, noise_multiplier REAL NOT NULL,
    mode TEXT NOT NULL, observed INTEGER NOT NULL, PRIMARY KEY (rollout, round, node, step));
CREATE TABLE IF NOT EXISTS strategy_state (
    rollout TEXT NOT NULL, version INTEGER NOT NULL, state BLOB NOT NULL, PRIMARY KEY (rollout, version));
CREATE TABLE IF NOT EXISTS control (
    rollout TEXT PRIMARY KEY, desired TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS open_rounds (
    rollout TEXT PRIMARY KEY, round INTEGER NOT NULL, opened REAL NOT NULL, cells TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS presence (
    node TEXT PRIMARY KEY, role TEXT, cell TEXT, state TEXT NOT NULL, since REAL, last_seen REAL NOT NULL,
    doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS contributions (
    rollout TEXT NOT NULL, device TEXT NOT NULL, round INTEGER NOT NULL, model_version INTEGER NOT NULL,
    PRIMARY KEY (rollout, device));
CREATE TABLE IF NOT EXISTS deployments (
    rollout TEXT NOT NULL, cell TEXT NOT NULL, version INTEGER NOT NULL, since REAL NOT NULL,
    PRIMARY KEY (rollout, cell));
CREATE TABLE IF NOT EXISTS promotions (
    rollout TEXT NOT NULL, id INTEGER NOT NULL, candidate INTEGER NOT NULL, previous INTEGER,
    canary TEXT NOT NULL, passed INTEGER NOT NULL, reasons TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (rollout, id));
CREATE TABLE IF NOT EXISTS privacy_clear (
    rollout TEXT NOT NULL, round INTEGER NOT NULL, step INTEGER NOT NULL, sender TEXT NOT NULL,
    receiver TEXT NOT NULL, receiver_trusted INTEGER NOT NULL, PRIMARY KEY (rollout, round, step, sender));
"""

RELEASE_COLUMNS = ("rollout", "round", "event", "step", "node", "parent", "parent_trusted", "protected",
                   "sensitivity", "inputs", "sigma", "noise_multiplier", "mode", "observed")
CLEAR_COLUMNS = ("rollout", "round", "step", "sender", "receiver", "receiver_trusted")


def _release_values(rollout: str, r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (rollout, int(r["round"]), str(r["event"]), int(r["step"]), str(r["node"]), str(r["parent"]),
            int(bool(r["parent_trusted"])), json.dumps(sorted(r["protected"])), float(r["sensitivity"]),
            json.dumps(r.get("inputs", {}), sort_keys=True), float(r["sigma"]), float(r["noise_multiplier"]),
            str(r["mode"]), int(bool(r["observed"])))


class CoordinatorStore:
    def __init__(self, path: Path | str) -> None:
        self.db = Database(path, SCHEMA)

    # --- rollouts ---------------------------------------------------------------------------------

    def ensure_rollout(self, rollout: str, config: Mapping[str, Any], manifest: bytes) -> None:
        """Create the rollout row if it does not exist (a restart keeps the original)."""
        with self.db.locked() as db:
            db.execute("INSERT OR IGNORE INTO rollouts VALUES (?,?,?,?,?,NULL)",
                             (rollout, json.dumps(config, sort_keys=True, default=str), manifest, "running",
                              time.time()))

    def next_manifest_version(self) -> int:
        """A manifest version never issued before by this coordinator (devices refuse older ones)."""
        with self.db.transaction() as db:
            db.execute("INSERT INTO counters VALUES ('manifest_version', 1) ON CONFLICT(name) DO UPDATE SET "
                       "value = value + 1")
            return int(db.execute("SELECT value FROM counters WHERE name='manifest_version'").fetchone()[0])

    def replace_manifest(self, rollout: str, manifest: bytes) -> None:
        with self.db.locked() as db:
            db.execute("UPDATE rollouts SET manifest=? WHERE rollout=?", (manifest, rollout))

    def manifest(self, rollout: str) -> bytes | None:
        with self.db.locked() as db:
            row = db.execute("SELECT manifest FROM rollouts WHERE rollout=?", (rollout,)).fetchone()
        return bytes(row[0]) if row else None

    def set_status(self, rollout: str, status: str) -> None:
        with self.db.locked() as db:
            db.execute("UPDATE rollouts SET status=?, finished=CASE WHEN ?='finished' THEN ? ELSE finished END"
                             " WHERE rollout=?", (status, status, time.time(), rollout))

    def status(self, rollout: str) -> str | None:
        with self.db.locked() as db:
            row = db.execute("SELECT status FROM rollouts WHERE rollout=?", (rollout,)).fetchone()
        return row[0] if row else None

    # --- models and rounds ----------------------------------------------------------------------

    def save_initial_model(self, rollout: str, params: Mapping[str, np.ndarray]) -> None:
        blob = encode_params(params, rollout=rollout, round=0)
        with self.db.locked() as db:
            db.execute("INSERT OR IGNORE INTO models VALUES (?,?,?,?,?,?)",
                             (rollout, 0, -1, hashlib.sha256(blob).hexdigest(), blob, time.time()))

    def commit_round(self, rollout: str, round: int, version: int, params: Mapping[str, np.ndarray],
                     accuracy: float | None, loss: float | None, metrics: Mapping[str, Any],
                     releases: Sequence[Mapping[str, Any]] = (), clear: Sequence[Mapping[str, Any]] = (),
                     strategy_state: Mapping[str, np.ndarray] | None = None) -> None:
        """Store a closed round, its model version and its privacy-ledger rows atomically; drop the
        round's inputs. (A crash never leaves a model without its releases on the ledger.)

        ``strategy_state`` (a server optimizer's moments after this round) lands in the same
        transaction, so a restarted coordinator resumes the model and its optimizer together."""
        blob = encode_params(params, rollout=rollout, round=round)
        with self.db.transaction() as db:
            if strategy_state is not None:
                db.execute("INSERT OR REPLACE INTO strategy_state VALUES (?,?,?)",
                           (rollout, version, encode_state(strategy_state)))
            db.executemany(f"INSERT OR REPLACE INTO privacy_releases VALUES ({','.join('?' * len(RELEASE_COLUMNS))})",
                           [_release_values(rollout, r) for r in releases])
            db.executemany(f"INSERT OR REPLACE INTO privacy_clear VALUES ({','.join('?' * len(CLEAR_COLUMNS))})",
                           [(rollout, int(c["round"]), int(c["step"]), str(c["sender"]), str(c["receiver"]),
                             int(bool(c["receiver_trusted"]))) for c in clear])
            db.execute("INSERT OR REPLACE INTO models VALUES (?,?,?,?,?,?)",
                       (rollout, version, round, hashlib.sha256(blob).hexdigest(), blob, time.time()))
            db.execute("INSERT OR REPLACE INTO rounds VALUES (?,?,?,?,?,?)",
                       (rollout, round, time.time(), accuracy, loss, json.dumps(metrics, default=float)))
            db.execute("DELETE FROM inputs WHERE rollout=? AND round<=?", (rollout, round))

    def latest_model(self, rollout: str) -> ModelVersion | None:
        with self.db.locked() as db:
            row = db.execute("SELECT version, round, sha256, params FROM models WHERE rollout=?"
                                   " ORDER BY version DESC LIMIT 1", (rollout,)).fetchone()
        if row is None:
            return None
        return ModelVersion(version=row[0], round=row[1], sha256=row[2], params=decode_params(bytes(row[3])))

    def strategy_state(self, rollout: str, version: int) -> dict[str, np.ndarray] | None:
        """The strategy state committed with model ``version`` (``None`` if that round kept none)."""
        with self.db.locked() as db:
            row = db.execute("SELECT state FROM strategy_state WHERE rollout=? AND version=?",
                             (rollout, version)).fetchone()
        return None if row is None else decode_state(bytes(row[0]))

    def model(self, rollout: str, version: int) -> ModelVersion | None:
        with self.db.locked() as db:
            row = db.execute("SELECT version, round, sha256, params FROM models WHERE rollout=? AND version=?",
                                   (rollout, version)).fetchone()
        if row is None:
            return None
        return ModelVersion(version=row[0], round=row[1], sha256=row[2], params=decode_params(bytes(row[3])))

    def rounds(self, rollout: str) -> list[dict[str, Any]]:
        with self.db.locked() as db:
            rows = db.execute("SELECT round, closed, accuracy, loss, metrics FROM rounds WHERE rollout=?"
                                    " ORDER BY round", (rollout,)).fetchall()
        return [{"round": r, "closed": c, "accuracy": a, "loss": lo, **json.loads(m)} for r, c, a, lo, m in rows]

    # --- operations: desired state, open round, presence, versions (fedtier rollout / devices) ---------

    def create_rollout(self, rollout: str, config: Mapping[str, Any]) -> bool:
        """Register a rollout that no coordinator has started yet (``fedtier rollout create``).

        Returns False if the store already has a rollout of that id (nothing is changed).
        The manifest is issued by the coordinator when it first hosts the rollout.
        """
        now = time.time()
        with self.db.transaction() as db:
            cur = db.execute("INSERT OR IGNORE INTO rollouts VALUES (?,?,?,?,?,NULL)",
                             (rollout, json.dumps(config, sort_keys=True, default=str), b"", "created", now))
            if cur.rowcount == 0:
                return False
            db.execute("INSERT OR REPLACE INTO control VALUES (?,?,?)", (rollout, "created", now))
        return True

    def set_desired(self, rollout: str, desired: str) -> None:
        """What the operator asked for: ``running``, ``paused`` or ``stopped`` (the coordinator polls it)."""
        with self.db.locked() as db:
            db.execute("INSERT OR REPLACE INTO control VALUES (?,?,?)", (rollout, desired, time.time()))

    def desired(self, rollout: str) -> str | None:
        with self.db.locked() as db:
            row = db.execute("SELECT desired FROM control WHERE rollout=?", (rollout,)).fetchone()
        return row[0] if row else None

    def rollout_rows(self) -> list[dict[str, Any]]:
        """Every rollout: id, status (what the coordinator did), desired (what was asked), created, finished."""
        with self.db.locked() as db:
            rows = db.execute("SELECT r.rollout, r.status, c.desired, r.created, r.finished, r.config FROM rollouts r "
                              "LEFT JOIN control c ON c.rollout = r.rollout ORDER BY r.created, r.rollout").fetchall()
        return [{"rollout": r, "status": s, "desired": d, "created": c, "finished": f, "config": json.loads(cfg)}
                for r, s, d, c, f, cfg in rows]

    def set_open_round(self, rollout: str, round: int | None, cells: Sequence[str] = ()) -> None:
        """The round the coordinator has open (``None``: none, e.g. paused between rounds)."""
        with self.db.locked() as db:
            if round is None:
                db.execute("DELETE FROM open_rounds WHERE rollout=?", (rollout,))
            else:
                db.execute("INSERT OR REPLACE INTO open_rounds VALUES (?,?,?,?)",
                           (rollout, round, time.time(), json.dumps(sorted(cells))))

    def open_round(self, rollout: str) -> dict[str, Any] | None:
        with self.db.locked() as db:
            row = db.execute("SELECT round, opened, cells FROM open_rounds WHERE rollout=?", (rollout,)).fetchone()
        return None if row is None else {"round": row[0], "opened": row[1], "cells": json.loads(row[2])}

    def record_presence(self, node: str, doc: Mapping[str, Any], now: float) -> bool:
        """Keep the newest presence document of ``node``; ``last_seen`` moves only when it changes
        (a retained document redelivered after a reconnection is not a sighting). True if changed."""
        text = json.dumps(doc, sort_keys=True, default=str)
        since = doc.get("since")
        with self.db.transaction() as db:
            row = db.execute("SELECT doc FROM presence WHERE node=?", (node,)).fetchone()
            if row is not None and row[0] == text:
                return False
            db.execute("INSERT OR REPLACE INTO presence VALUES (?,?,?,?,?,?,?)",
                       (node, doc.get("role"), doc.get("cell"), str(doc.get("state", "unknown")),
                        float(since) if isinstance(since, (int, float)) else None, now, text))
        return True

    def presence(self) -> list[dict[str, Any]]:
        with self.db.locked() as db:
            rows = db.execute("SELECT node, last_seen, doc FROM presence ORDER BY node").fetchall()
        return [{**json.loads(doc), "node": node, "last_seen": seen} for node, seen, doc in rows]

    def record_contributions(self, rollout: str, round: int, model_version: int, devices: Sequence[str]) -> None:
        """The devices whose updates made it into ``round`` (trained from ``model_version``)."""
        with self.db.locked() as db:
            db.executemany("INSERT OR REPLACE INTO contributions VALUES (?,?,?,?)",
                           [(rollout, d, round, model_version) for d in devices])

    def contributions(self) -> dict[str, dict[str, Any]]:
        """device -> its latest contribution (rollout, round, model version) over every rollout."""
        with self.db.locked() as db:
            rows = db.execute("SELECT rollout, device, round, model_version FROM contributions "
                              "ORDER BY rollout").fetchall()
        out: dict[str, dict[str, Any]] = {}
        for rollout, device, rnd, version in rows:
            out[device] = {"rollout": rollout, "round": rnd, "model_version": version}
        return out

    def models(self, rollout: str) -> list[dict[str, Any]]:
        """The version registry: version, round, sha256, created, and the round's test accuracy."""
        with self.db.locked() as db:
            rows = db.execute("SELECT m.version, m.round, m.sha256, m.created, r.accuracy FROM models m "
                              "LEFT JOIN rounds r ON r.rollout = m.rollout AND r.round = m.round "
                              "WHERE m.rollout=? ORDER BY m.version", (rollout,)).fetchall()
        return [{"version": v, "round": r, "sha256": s, "created": c, "accuracy": a} for v, r, s, c, a in rows]

    def set_deployment(self, rollout: str, cells: Sequence[str], version: int) -> None:
        """The model version ``cells`` serve for inference (canary, promotion, rollback)."""
        now = time.time()
        with self.db.locked() as db:
            db.executemany("INSERT OR REPLACE INTO deployments VALUES (?,?,?,?)",
                           [(rollout, c, int(version), now) for c in cells])

    def clear_deployment(self, rollout: str, cell: str) -> None:
        with self.db.locked() as db:
            db.execute("DELETE FROM deployments WHERE rollout=? AND cell=?", (rollout, cell))

    def deployments(self, rollout: str) -> dict[str, int]:
        with self.db.locked() as db:
            rows = db.execute("SELECT cell, version FROM deployments WHERE rollout=?", (rollout,)).fetchall()
        return {c: int(v) for c, v in rows}

    def add_promotion(self, rollout: str, candidate: int, previous: int | None, canary: Sequence[str],
                      passed: bool, reasons: Sequence[str]) -> int:
        with self.db.transaction() as db:
            (last,) = db.execute("SELECT COALESCE(MAX(id), -1) FROM promotions WHERE rollout=?", (rollout,)).fetchone()
            db.execute("INSERT INTO promotions VALUES (?,?,?,?,?,?,?,?)",
                       (rollout, last + 1, candidate, previous, json.dumps(list(canary)), int(passed),
                        json.dumps(list(reasons)), time.time()))
        return int(last + 1)

    def promotions(self, rollout: str) -> list[dict[str, Any]]:
        with self.db.locked() as db:
            rows = db.execute("SELECT id, candidate, previous, canary, passed, reasons, created FROM promotions "
                              "WHERE rollout=? ORDER BY id", (rollout,)).fetchall()
        return [{"id": i, "candidate": c, "previous": p, "canary": json.loads(cn), "passed": bool(ok),
                 "reasons": json.loads(rs), "created": t} for i, c, p, cn, ok, rs, t in rows]

    # --- privacy ledger ------------------------------------------------------------------------

    def privacy_releases(self, rollout: str) -> list[dict[str, Any]]:
        """Every release row of ``rollout``, in round order (``protected`` and ``inputs`` decoded)."""
        with self.db.locked() as db:
            rows = db.execute(f"SELECT {','.join(RELEASE_COLUMNS)} FROM privacy_releases WHERE rollout=? "
                              "ORDER BY round, event, node, step", (rollout,)).fetchall()
        out = []
        for row in rows:
            rec = dict(zip(RELEASE_COLUMNS, row, strict=True))
            rec["protected"] = json.loads(rec["protected"])
            rec["inputs"] = json.loads(rec["inputs"])
            rec["parent_trusted"] = bool(rec["parent_trusted"])
            rec["observed"] = bool(rec["observed"])
            out.append(rec)
        return out

    def privacy_clear(self, rollout: str) -> list[dict[str, Any]]:
        with self.db.locked() as db:
            rows = db.execute(f"SELECT {','.join(CLEAR_COLUMNS)} FROM privacy_clear WHERE rollout=? "
                              "ORDER BY round, step, sender", (rollout,)).fetchall()
        return [{**dict(zip(CLEAR_COLUMNS, r, strict=True)), "receiver_trusted": bool(r[5])} for r in rows]

    # --- open-round inputs ----------------------------------------------------------------------

    def record_input(self, rollout: str, round: int, key: str, payload: bytes) -> None:
        with self.db.locked() as db:
            db.execute("INSERT OR IGNORE INTO inputs VALUES (?,?,?,?)", (rollout, round, key, payload))

    def inputs(self, rollout: str) -> list[bytes]:
        with self.db.locked() as db:
            return [bytes(p) for (p,) in db.execute(
                "SELECT payload FROM inputs WHERE rollout=? ORDER BY round, rowid", (rollout,))]

    def close(self) -> None:
        with self.db.locked() as db:
            db.close()
