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
