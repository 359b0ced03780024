"""The coordinator's durable state (SQLite or PostgreSQL): rollouts, model versions, rounds, open-round inputs.

Model parameters are stored as wire envelopes (float32 tensors, sha256-checked), never
pickled. A round is committed in one transaction together with its model version, so a
coordinator killed at any point resumes either before or after the round, never between.
The cell updates accepted in the open round are kept until it closes; a restarted
coordinator replays them (like the edge) and loses nothing it had acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from fedtier import wire
from fedtier.errors import ConfigError
from fedtier.storage import npz as npz_file
from cloud_coordinator import store_backend as backend


def encode_params(params: Mapping[str, np.ndarray], *, rollout: str, round: int) -> bytes:
    env = wire.Envelope(type="model_snapshot", rollout=rollout, round=max(round, 0), sender="cloud",
                        key=f"model/{rollout}/{round}", tensors=dict(params))
    return wire.encode(env)


def decode_params(blob: bytes) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32) for k, v in wire.decode(blob).tensors.items()}


@dataclass(frozen=True)
class ModelVersion:
    version: int
    round: int
    sha256: str
    params: dict[str, np.ndarray]


metadata = sa.MetaData()
_str, _int, _real, _blob = sa.Text, sa.Integer, sa.Double, sa.LargeBinary


def _table(name: str, *columns: sa.Column, key: Sequence[str]) -> sa.Table:
    return sa.Table(name, metadata, *columns, sa.PrimaryKeyConstraint(*key))


def _col(name: str, kind: Any, null: bool = False) -> sa.Column:
    return sa.Column(name, kind, nullable=null)


rollouts = _table("rollouts", _col("rollout", _str), _col("config", _str), _col("manifest", _blob),
                  _col("status", _str), _col("created", _real), _col("finished", _real, True), key=["rollout"])
models = _table("models", _col("rollout", _str), _col("version", _int), _col("round", _int), _col("sha256", _str),
                _col("params", _blob), _col("created", _real), key=["rollout", "version"])
rounds_t = _table("rounds", _col("rollout", _str), _col("round", _int), _col("closed", _real),
                  _col("accuracy", _real, True), _col("loss", _real, True), _col("metrics", _str),
                  key=["rollout", "round"])
counters = _table("counters", _col("name", _str), _col("value", _int), key=["name"])
inputs_t = _table("inputs", _col("rollout", _str), _col("round", _int), _col("msg_key", _str),
                  _col("payload", _blob), _col("seq", _int), key=["rollout", "msg_key"])
releases_t = _table("privacy_releases", _col("rollout", _str), _col("round", _int), _col("event", _str),
                    _col("step", _int), _col("node", _str), _col("parent", _str), _col("parent_trusted", _int),
                    _col("protected", _str), _col("sensitivity", _real), _col("inputs", _str), _col("sigma", _real),
                    _col("noise_multiplier", _real), _col("mode", _str), _col("observed", _int),
                    key=["rollout", "round", "node", "step"])
strategy_t = _table("strategy_state", _col("rollout", _str), _col("version", _int), _col("state", _blob),
                    key=["rollout", "version"])
control = _table("control", _col("rollout", _str), _col("desired", _str), _col("updated", _real), key=["rollout"])
open_rounds = _table("open_rounds", _col("rollout", _str), _col("round", _int), _col("opened", _real),
                     _col("cells", _str), key=["rollout"])
presence_t = _table("presence", _col("node", _str), _col("role", _str, True), _col("cell", _str, True),
                    _col("state", _str), _col("since", _real, True), _col("last_seen", _real), _col("doc", _str),
                    key=["node"])
contributions_t = _table("contributions", _col("rollout", _str), _col("device", _str), _col("round", _int),
                         _col("model_version", _int), key=["rollout", "device"])
deployments_t = _table("deployments", _col("rollout", _str), _col("cell", _str), _col("version", _int),
                       _col("since", _real), key=["rollout", "cell"])
promotions_t = _table("promotions", _col("rollout", _str), _col("id", _int), _col("candidate", _int),
                      _col("previous", _int, True), _col("canary", _str), _col("passed", _int), _col("reasons", _str),
                      _col("created", _real), key=["rollout", "id"])
clear_t = _table("privacy_clear", _col("rollout", _str), _col("round", _int), _col("step", _int),
                 _col("sender", _str), _col("receiver", _str), _col("receiver_trusted", _int),
                 key=["rollout", "round", "step", "sender"])
leases = _table("leases", _col("rollout", _str), _col("holder", _str), _col("host", _str), _col("pid", _int),
                _col("acquired", _real), key=["rollout"])
schema_version = sa.Table("schema_version", metadata, _col("version", _int), _col("applied", _real))

ENDED = ("finished", "stopped")
"""Statuses of a rollout no coordinator drives any more (its lease is released)."""

RELEASE_COLUMNS = ("rollout", "round", "event", "step", "node", "parent", "parent_trusted", "protected",
                   "sensitivity", "inputs", "sigma", "noise_multiplier", "mode", "observed")
CLEAR_COLUMNS = ("rollout", "round", "step", "sender", "receiver", "receiver_trusted")


def _release_row(rollout: str, r: Mapping[str, Any]) -> dict[str, Any]:
    values = (rollout, int(r["round"]), str(r["event"]), int(r["step"]), str(r["node"]), str(r["parent"]),
              int(bool(r["parent_trusted"])), json.dumps(sorted(r["protected"])), float(r["sensitivity"]),
              json.dumps(r.get("inputs", {}), sort_keys=True), float(r["sigma"]), float(r["noise_multiplier"]),
              str(r["mode"]), int(bool(r["observed"])))
    return dict(zip(RELEASE_COLUMNS, values, strict=True))


class CoordinatorStore:
    """The coordinator's state in SQLite or PostgreSQL (``store_backend`` has what differs).

    Args:
        location: a SQLite file (``Path`` or path string), ``":memory:"``, or a URL
            (``sqlite:///PATH``, ``postgresql://USER@HOST:PORT/DB``).
        read_only: for commands that only read (``rollout status``, ``report``, ...): the store is
            read as it is, never created or migrated (a coordinator of an older fedtier may still
            run on it). ``schema_found`` says which version it has; ``migration_due`` whether it is
            older than this fedtier's (``store_backend.migration_due`` words it). Writing raises.

    Raises:
        ConfigError(key="store"): a URL of another database, a server that cannot be reached,
            or a store written by a newer fedtier.
    """

    def __init__(self, location: Path | str, *, read_only: bool = False) -> None:
        self.url = backend.parse_url(location)
        self.where = backend.display(self.url)
        self.read_only = read_only
        self.engine = backend.make_engine(self.url, read_only=read_only)
        self.dialect = self.engine.dialect.name
        # One user at a time in this process (node thread, paho callbacks, the dashboard): the
        # transactions below are short, and SQLite allows one writer anyway.
        self._lock = threading.RLock()
        try:
            if read_only:
                self.schema_found = backend.read_schema(self.engine, self.url)
            else:
                backend.ensure_schema(self.engine, metadata, self.url)
                self.schema_found = backend.SCHEMA_VERSION
        except sa.exc.OperationalError as exc:
            self.engine.dispose()
            raise backend.connect_error(self.url, exc) from None
        except BaseException:
            self.engine.dispose()
            raise
        self._locks = backend.RolloutLocks(self.engine, self.url)

    @property
    def migration_due(self) -> bool:
        """Whether this (read-only) store has an older schema than this fedtier writes."""
        return 0 < self.schema_found < backend.SCHEMA_VERSION

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        """One transaction: everything inside commits together, or nothing if it raises."""
        if self.read_only:
            raise RuntimeError(f"store {self.where} was opened read-only: a command that reads must not write")
        with self._lock, self.engine.begin() as conn:
            yield conn

    def _insert(self, table: sa.Table) -> Any:
        return (pg_insert if self.dialect == "postgresql" else sqlite_insert)(table)

    def _upsert(self, conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert ``rows``, replacing any row with the same primary key."""
        if not rows:
            return
        keys = [c.name for c in table.primary_key.columns]
        stmt = self._insert(table)
        stmt = stmt.on_conflict_do_update(index_elements=keys,
                                          set_={c.name: stmt.excluded[c.name] for c in table.c if c.name not in keys})
        conn.execute(stmt, list(rows))

    def _insert_new(self, conn: Connection, table: sa.Table, row: Mapping[str, Any]) -> bool:
        """Insert ``row`` unless its primary key exists; True if it was inserted."""
        stmt = self._insert(table).values(dict(row)).on_conflict_do_nothing()
        if self.dialect == "sqlite":  # rowcount is exact there (and RETURNING needs SQLite 3.35)
            return conn.execute(stmt).rowcount > 0
        key = table.primary_key.columns.values()[0]
        return conn.execute(stmt.returning(key)).first() is not None  # psycopg reports no rowcount here

    def _rows(self, stmt: Any) -> list[Any]:
        """The rows of one query, read in a transaction of its own that takes no write lock.

        Raises:
            ConfigError(key="store"): a read-only store of an older schema lacks what the query reads.
        """
        with self._lock, self.engine.connect() as conn:
            conn.execution_options(**{backend.READ_ONLY: True})
            try:
                rows = list(conn.execute(stmt).all())
            except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
                if not self.migration_due:
                    raise
                detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                raise ConfigError(f"cannot read store {self.where} as it is ({detail}): "
                                  f"{backend.migration_due(self.url, self.schema_found)}", key="store") from None
            conn.rollback()
        return rows

    # --- one coordinator per rollout -------------------------------------------------------------

    def hold_rollout(self, rollout: str, holder: str) -> None:
        """Become the one coordinator of ``rollout`` until ``close`` (or this process dies).

        Raises:
            RolloutHeldError: another coordinator holds it; the message names that one.
        """
        with self._lock:
            if not self._locks.try_acquire(rollout):
                raise backend.RolloutHeldError(rollout, self.lease(rollout), self.where)
        with self._tx() as conn:
            self._upsert(conn, leases, [{"rollout": rollout, **backend.holder_identity(holder)}])

    def lease(self, rollout: str) -> dict[str, Any] | None:
        """Who last took ``rollout``'s lock (holder, host, pid, acquired), or ``None``."""
        rows = self._rows(sa.select(leases.c.holder, leases.c.host, leases.c.pid, leases.c.acquired)
                          .where(leases.c.rollout == rollout))
        return dict(rows[0]._mapping) if rows else None

    # --- rollouts ---------------------------------------------------------------------------------

    def ensure_rollout(self, rollout: str, config: Mapping[str, Any], manifest: bytes) -> None:
        """Create the rollout row if it does not exist (a restart keeps the original)."""
        with self._tx() as conn:
            self._insert_new(conn, rollouts, {"rollout": rollout, "manifest": manifest, "status": "running",
                                              "config": json.dumps(config, sort_keys=True, default=str),
                                              "created": time.time(), "finished": None})

    def next_manifest_version(self) -> int:
        """A manifest version never issued before by this coordinator (devices refuse older ones)."""
        stmt = self._insert(counters).values(name="manifest_version", value=1)
        stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={"value": counters.c.value + 1})
        with self._tx() as conn:
            conn.execute(stmt)
            value = conn.execute(sa.select(counters.c.value).where(counters.c.name == "manifest_version"))
            return int(value.scalar_one())

    def replace_manifest(self, rollout: str, manifest: bytes) -> None:
        with self._tx() as conn:
            conn.execute(sa.update(rollouts).where(rollouts.c.rollout == rollout).values(manifest=manifest))

    def manifest(self, rollout: str) -> bytes | None:
        rows = self._rows(sa.select(rollouts.c.manifest).where(rollouts.c.rollout == rollout))
        return bytes(rows[0][0]) if rows else None

    def set_status(self, rollout: str, status: str) -> None:
        """What the coordinator did with ``rollout``. A rollout that ended (``finished``, ``stopped``) releases its
        lease: the lease row goes with the status change, and the lock this store held on it is given up."""
        values: dict[str, Any] = {"status": status}
        if status == "finished":
            values["finished"] = time.time()
        with self._tx() as conn:
            conn.execute(sa.update(rollouts).where(rollouts.c.rollout == rollout).values(**values))
            if status in ENDED:
                conn.execute(sa.delete(leases).where(leases.c.rollout == rollout))
        if status in ENDED:
            with self._lock:
                self._locks.release(rollout)

    def status(self, rollout: str) -> str | None:
        rows = self._rows(sa.select(rollouts.c.status).where(rollouts.c.rollout == rollout))
        return rows[0][0] if rows else None

    # --- models and rounds ----------------------------------------------------------------------

    def save_initial_model(self, rollout: str, params: Mapping[str, np.ndarray]) -> None:
        blob = encode_params(params, rollout=rollout, round=0)
        with self._tx() as conn:
            self._insert_new(conn, models, {"rollout": rollout, "version": 0, "round": -1,
                                            "sha256": hashlib.sha256(blob).hexdigest(), "params": blob,
                                            "created": time.time()})

    def commit_round(self, rollout: str, round: int, version: int, params: Mapping[str, np.ndarray],
                     accuracy: float | None, loss: float | None, metrics: Mapping[str, Any],
                     releases: Sequence[Mapping[str, Any]] = (), clear: Sequence[Mapping[str, Any]] = (),
                     strategy_state: Mapping[str, np.ndarray] | None = None) -> None:
        """Store a closed round, its model version and its privacy-ledger rows atomically; drop the
        round's inputs. (A crash never leaves a model without its releases on the ledger.)

        ``strategy_state`` (a server optimizer's moments after this round) lands in the same
        transaction, so a restarted coordinator resumes the model and its optimizer together."""
        blob = encode_params(params, rollout=rollout, round=round)
        now = time.time()
        with self._tx() as conn:
            if strategy_state is not None:
                self._upsert(conn, strategy_t, [{"rollout": rollout, "version": version,
                                                 "state": npz_file.encode_arrays(strategy_state)}])
            self._upsert(conn, releases_t, [_release_row(rollout, r) for r in releases])
            self._upsert(conn, clear_t, [{"rollout": rollout, "round": int(c["round"]), "step": int(c["step"]),
                                          "sender": str(c["sender"]), "receiver": str(c["receiver"]),
                                          "receiver_trusted": int(bool(c["receiver_trusted"]))} for c in clear])
            self._upsert(conn, models, [{"rollout": rollout, "version": version, "round": round,
                                         "sha256": hashlib.sha256(blob).hexdigest(), "params": blob, "created": now}])
            self._upsert(conn, rounds_t, [{"rollout": rollout, "round": round, "closed": now, "accuracy": accuracy,
                                           "loss": loss, "metrics": json.dumps(metrics, default=float)}])
            conn.execute(sa.delete(inputs_t).where(inputs_t.c.rollout == rollout, inputs_t.c.round <= round))

    def _model(self, rollout: str, version: int | None) -> ModelVersion | None:
        stmt = sa.select(models.c.version, models.c.round, models.c.sha256, models.c.params).where(
            models.c.rollout == rollout)
        stmt = stmt.order_by(models.c.version.desc()).limit(1) if version is None else stmt.where(
            models.c.version == version)
        rows = self._rows(stmt)
        if not rows:
            return None
        v, r, sha, blob = rows[0]
        return ModelVersion(version=v, round=r, sha256=sha, params=decode_params(bytes(blob)))

    def latest_model(self, rollout: str) -> ModelVersion | None:
        return self._model(rollout, None)

    def model(self, rollout: str, version: int) -> ModelVersion | None:
        return self._model(rollout, version)

    def strategy_state(self, rollout: str, version: int) -> dict[str, np.ndarray] | None:
        """The strategy state committed with model ``version`` (``None`` if that round kept none)."""
        rows = self._rows(sa.select(strategy_t.c.state).where(strategy_t.c.rollout == rollout,
                                                               strategy_t.c.version == version))
        return None if not rows else npz_file.decode_arrays(bytes(rows[0][0]))

    def rounds(self, rollout: str) -> list[dict[str, Any]]:
        t = rounds_t
        rows = self._rows(sa.select(t.c.round, t.c.closed, t.c.accuracy, t.c.loss, t.c.metrics)
                          .where(t.c.rollout == rollout).order_by(t.c.round))
        return [{"round": r, "closed": c, "accuracy": _finite_or_none(a), "loss": _finite_or_none(lo),
                 **json.loads(m)} for r, c, a, lo, m in rows]

    def round_close_times(self, rollout: str) -> dict[int, float]:
        """round -> Unix time it was committed (without the rounds' metrics)."""
        t = rounds_t
        return {int(r): float(c) for r, c in self._rows(sa.select(t.c.round, t.c.closed).where(t.c.rollout == rollout))}

    # --- operations: desired state, open round, presence, versions (fedtier rollout / devices) ---------

    def create_rollout(self, rollout: str, config: Mapping[str, Any]) -> bool:
        """Register a rollout that no coordinator has started yet (``fedtier rollout create``).

        Returns False if the store already has a rollout of that id (nothing is changed).
        The manifest is issued by the coordinator when it first hosts the rollout.
        """
        now = time.time()
        with self._tx() as conn:
            if not self._insert_new(conn, rollouts, {"rollout": rollout, "config": json.dumps(
                    config, sort_keys=True, default=str), "manifest": b"", "status": "created", "created": now,
                    "finished": None}):
                return False
            self._upsert(conn, control, [{"rollout": rollout, "desired": "created", "updated": now}])
        return True

    def set_desired(self, rollout: str, desired: str) -> None:
        """What the operator asked for: ``running``, ``paused`` or ``stopped`` (the coordinator polls it)."""
        with self._tx() as conn:
            self._upsert(conn, control, [{"rollout": rollout, "desired": desired, "updated": time.time()}])

    def desired(self, rollout: str) -> str | None:
        rows = self._rows(sa.select(control.c.desired).where(control.c.rollout == rollout))
        return rows[0][0] if rows else None

    def rollout_rows(self) -> list[dict[str, Any]]:
        """Every rollout: id, status (what the coordinator did), desired (what was asked), created, finished."""
        r, c = rollouts, control
        rows = self._rows(sa.select(r.c.rollout, r.c.status, c.c.desired, r.c.created, r.c.finished, r.c.config)
                          .select_from(r.outerjoin(c, c.c.rollout == r.c.rollout)).order_by(r.c.created, r.c.rollout))
        return [{"rollout": rid, "status": s, "desired": d, "created": cr, "finished": f, "config": json.loads(cfg)}
                for rid, s, d, cr, f, cfg in rows]

    def set_open_round(self, rollout: str, round: int | None, cells: Sequence[str] = ()) -> None:
        """The round the coordinator has open (``None``: none, e.g. paused between rounds)."""
        with self._tx() as conn:
            if round is None:
                conn.execute(sa.delete(open_rounds).where(open_rounds.c.rollout == rollout))
            else:
                self._upsert(conn, open_rounds, [{"rollout": rollout, "round": round, "opened": time.time(),
                                                  "cells": json.dumps(sorted(cells))}])

    def open_round(self, rollout: str) -> dict[str, Any] | None:
        t = open_rounds
        rows = self._rows(sa.select(t.c.round, t.c.opened, t.c.cells).where(t.c.rollout == rollout))
        return None if not rows else {"round": rows[0][0], "opened": rows[0][1], "cells": json.loads(rows[0][2])}

    def record_presence(self, node: str, doc: Mapping[str, Any], now: float) -> bool:
        """Keep the newest presence document of ``node``; ``last_seen`` moves only when it changes
        (a retained document redelivered after a reconnection is not a sighting). True if changed."""
        return bool(self.record_presences({node: (doc, now)}))

    def record_presences(self, docs: Mapping[str, tuple[Mapping[str, Any], float]]) -> list[str]:
        """``record_presence`` for many nodes in one transaction (a fleet of thousands announces itself at
        once); returns the nodes whose document changed."""
        if not docs:
            return []
        texts = {node: json.dumps(doc, sort_keys=True, default=str) for node, (doc, _) in docs.items()}
        rows = []
        with self._tx() as conn:
            old = dict(conn.execute(sa.select(presence_t.c.node, presence_t.c.doc)
                                    .where(presence_t.c.node.in_(list(docs)))).all())
            for node, (doc, now) in docs.items():
                if old.get(node) == texts[node]:
                    continue
                since = doc.get("since")
                rows.append({"node": node, "role": doc.get("role"), "cell": doc.get("cell"),
                             "state": str(doc.get("state", "unknown")),
                             "since": float(since) if isinstance(since, (int, float)) else None,
                             "last_seen": now, "doc": texts[node]})
            self._upsert(conn, presence_t, rows)
        return [str(r["node"]) for r in rows]

    def presence(self) -> list[dict[str, Any]]:
        t = presence_t
        rows = self._rows(sa.select(t.c.node, t.c.last_seen, t.c.doc).order_by(t.c.node))
        return [{**json.loads(doc), "node": node, "last_seen": seen} for node, seen, doc in rows]

    def record_contributions(self, rollout: str, round: int, model_version: int, devices: Sequence[str]) -> None:
        """The devices whose updates made it into ``round`` (trained from ``model_version``)."""
        with self._tx() as conn:
            self._upsert(conn, contributions_t, [{"rollout": rollout, "device": d, "round": round,
                                                  "model_version": model_version} for d in devices])

    def contributions(self) -> dict[str, dict[str, Any]]:
        """device -> its latest contribution (rollout, round, model version) over every rollout."""
        t = contributions_t
        rows = self._rows(sa.select(t.c.rollout, t.c.device, t.c.round, t.c.model_version).order_by(t.c.rollout))
        out: dict[str, dict[str, Any]] = {}
        for rollout, device, rnd, version in rows:
            out[device] = {"rollout": rollout, "round": rnd, "model_version": version}
        return out

    def models(self, rollout: str) -> list[dict[str, Any]]:
        """The version registry: version, round, sha256, created, and the round's test accuracy."""
        m, r = models, rounds_t
        rows = self._rows(sa.select(m.c.version, m.c.round, m.c.sha256, m.c.created, r.c.accuracy)
                          .select_from(m.outerjoin(r, sa.and_(r.c.rollout == m.c.rollout, r.c.round == m.c.round)))
                          .where(m.c.rollout == rollout).order_by(m.c.version))
        return [{"version": v, "round": rd, "sha256": s, "created": c, "accuracy": _finite_or_none(a)}
                for v, rd, s, c, a in rows]

    def set_deployment(self, rollout: str, cells: Sequence[str], version: int) -> None:
        """The model version ``cells`` serve for inference (canary, promotion, rollback)."""
        now = time.time()
        with self._tx() as conn:
            self._upsert(conn, deployments_t, [{"rollout": rollout, "cell": c, "version": int(version), "since": now}
                                               for c in cells])

    def clear_deployment(self, rollout: str, cell: str) -> None:
        with self._tx() as conn:
            conn.execute(sa.delete(deployments_t).where(deployments_t.c.rollout == rollout,
                                                        deployments_t.c.cell == cell))

    def deployments(self, rollout: str) -> dict[str, int]:
        t = deployments_t
        return {c: int(v) for c, v in self._rows(sa.select(t.c.cell, t.c.version).where(t.c.rollout == rollout))}

    def add_promotion(self, rollout: str, candidate: int, previous: int | None, canary: Sequence[str],
                      passed: bool, reasons: Sequence[str]) -> int:
        t = promotions_t
        with self._tx() as conn:
            last = conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.c.id), -1)).where(t.c.rollout == rollout)
                                ).scalar_one()
            conn.execute(sa.insert(t).values(rollout=rollout, id=last + 1, candidate=candidate, previous=previous,
                                             canary=json.dumps(list(canary)), passed=int(passed),
                                             reasons=json.dumps(list(reasons)), created=time.time()))
        return int(last + 1)

    def promotions(self, rollout: str) -> list[dict[str, Any]]:
        t = promotions_t
        rows = self._rows(sa.select(t.c.id, t.c.candidate, t.c.previous, t.c.canary, t.c.passed, t.c.reasons,
                                    t.c.created).where(t.c.rollout == rollout).order_by(t.c.id))
        return [{"id": i, "candidate": c, "previous": p, "canary": json.loads(cn), "passed": bool(ok),
                 "reasons": json.loads(rs), "created": when} for i, c, p, cn, ok, rs, when in rows]

    # --- privacy ledger ------------------------------------------------------------------------

    def privacy_releases(self, rollout: str) -> list[dict[str, Any]]:
        """Every release row of ``rollout``, in round order (``protected`` and ``inputs`` decoded)."""
        t = releases_t
        rows = self._rows(sa.select(*(t.c[c] for c in RELEASE_COLUMNS)).where(t.c.rollout == rollout)
                          .order_by(t.c.round, t.c.event, t.c.node, t.c.step))
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
        t = clear_t
        rows = self._rows(sa.select(*(t.c[c] for c in CLEAR_COLUMNS)).where(t.c.rollout == rollout)
                          .order_by(t.c.round, t.c.step, t.c.sender))
        return [{**dict(zip(CLEAR_COLUMNS, r, strict=True)), "receiver_trusted": bool(r[5])} for r in rows]

    # --- open-round inputs ----------------------------------------------------------------------

    def record_input(self, rollout: str, round: int, key: str, payload: bytes) -> None:
        t = inputs_t
        with self._tx() as conn:
            seq = conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.c.seq), 0)).where(t.c.rollout == rollout)
                               ).scalar_one()
            self._insert_new(conn, t, {"rollout": rollout, "round": round, "msg_key": key, "payload": payload,
                                       "seq": seq + 1})

    def inputs(self, rollout: str) -> list[bytes]:
        t = inputs_t
        return [bytes(p) for (p,) in self._rows(sa.select(t.c.payload).where(t.c.rollout == rollout)
                                                .order_by(t.c.round, t.c.seq))]

    def close(self) -> None:
        """Release this store's locks (the lease rows of rollouts that ended go with them) and its connections."""
        with self._lock:
            if self._locks.held:
                ended = sa.select(rollouts.c.rollout).where(rollouts.c.status.in_(ENDED))
                try:
                    with self.engine.begin() as conn:
                        conn.execute(sa.delete(leases).where(leases.c.rollout.in_(sorted(self._locks.held)),
                                                             leases.c.rollout.in_(ended)))
                except sa.exc.SQLAlchemyError:
                    pass  # the store is gone already; the lease rows only say who last drove a rollout
            self._locks.release_all()
            self.engine.dispose()


def _finite_or_none(value: float | None) -> float | None:
    """SQLite turns a NaN into NULL, PostgreSQL keeps it: both read back as ``None``."""
    return None if value is None or value != value else value
