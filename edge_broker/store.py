"""The edge's durable state: the inputs it accepted in the open round, and manifests.

Recovery is by replay: the edge role is a pure state machine, so the state of the open
round is exactly the result of feeding it the round's ``CellTask`` and the device updates
it accepted, in order. Each accepted message is appended here *before* the broker is
acknowledged; a restarted edge replays them into a fresh role and is where it was.

Outputs to the cloud are stored too, before they are published: a replay that closes the
cell again republishes the stored bytes (receivers drop them by idempotency key) rather than
a fresh encoding. A trusted edge noises its aggregate with fresh OS randomness, so a second
encoding would be a second noisy release of the same aggregate, one the ledger never charges.

What a role carries from one round to the next beyond its inputs (an edge optimizer's moments) is
stored with the round's output, in the same commit; a restarted edge hands the state stored for the
round before the open one back to the role before it replays the open round.

An asynchronous rollout (FedBuff) has no rounds to prune by: its edge stores its role's state with a cell update
now and then (``save_checkpoint``; how often is the service's choice) and forgets the inputs that state holds, so
a restart loads the state and replays the newest cell task and what arrived after it; the outputs the cloud has
counted are forgotten as it says so (``prune_outputs``).

Rollouts that ended (their manifest cleared) are remembered, with the sha256 of their last manifest:
the edge refuses their messages for good (a replayed task is not a new round), until a different
manifest of the same rollout id starts it again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from fedtier.storage.sqlite import Database
from fedtier.wire.messages import CellTask

SCHEMA = """
CREATE TABLE IF NOT EXISTS inputs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, rollout TEXT NOT NULL, round INTEGER NOT NULL,
    kind TEXT NOT NULL, msg_key TEXT NOT NULL UNIQUE, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS manifests (rollout TEXT PRIMARY KEY, version INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS outputs (
    msg_key TEXT PRIMARY KEY, rollout TEXT NOT NULL, round INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS strategy_states (
    rollout TEXT NOT NULL, round INTEGER NOT NULL, state BLOB NOT NULL, PRIMARY KEY (rollout, round));
CREATE TABLE IF NOT EXISTS ended (rollout TEXT PRIMARY KEY, manifest_sha TEXT NOT NULL);
"""


class EdgeStore:
    def __init__(self, path: Path | str, *, keep_inputs: bool = True) -> None:
        """``keep_inputs=False``: ``record`` keeps nothing (the simulator's in-memory edges, which no restart
        replays: the round's updates would only be a second copy of what the edge already folded, 20 kB a
        device for the simulator's MLP, 2 GB at 100,000 devices)."""
        self.db = Database(path, SCHEMA)
        self.keep_inputs = keep_inputs

    def batch(self) -> AbstractContextManager[None]:
        """Group commit of the inputs recorded inside (``Database.batch``); the edge acknowledges them after."""
        return self.db.batch()

    def record(self, rollout: str, round: int, kind: str, key: str, payload: bytes) -> None:
        """Append an accepted input (idempotent by key)."""
        if not self.keep_inputs:
            return
        with self.db.locked() as db:
            db.execute("INSERT OR IGNORE INTO inputs (rollout, round, kind, msg_key, payload)"
                             " VALUES (?,?,?,?,?)", (rollout, round, kind, key, payload))

    def prune(self, rollout: str, before_round: int) -> None:
        """Forget inputs and outputs of rounds that can no longer change (a newer task arrived)."""
        with self.db.transaction() as db:
            db.execute("DELETE FROM inputs WHERE rollout=? AND round<?", (rollout, before_round))
            db.execute("DELETE FROM outputs WHERE rollout=? AND round<?", (rollout, before_round))
            # keep the newest state older than the open round: the one its replay starts from
            db.execute("DELETE FROM strategy_states WHERE rollout=? AND round < (SELECT COALESCE(MAX(round), -1) "
                       "FROM strategy_states WHERE rollout=? AND round<?)", (rollout, rollout, before_round))

    def output(self, key: str) -> bytes | None:
        """The payload published earlier under idempotency key ``key``, if any."""
        with self.db.locked() as db:
            row = db.execute("SELECT payload FROM outputs WHERE msg_key=?", (key,)).fetchone()
        return bytes(row[0]) if row else None

    def outputs(self, rollout: str, round: int | None) -> list[bytes]:
        """The payloads published for ``round`` of ``rollout`` (``None``: every round), oldest first."""
        with self.db.locked() as db:
            if round is None:
                rows = db.execute("SELECT payload FROM outputs WHERE rollout=? ORDER BY rowid", (rollout,))
            else:
                rows = db.execute("SELECT payload FROM outputs WHERE rollout=? AND round=? ORDER BY rowid",
                                  (rollout, round))
            return [bytes(p) for (p,) in rows]

    def save_output(self, rollout: str, round: int, key: str, payload: bytes) -> None:
        """Keep an output before it is published (the first one for a key wins)."""
        with self.db.locked() as db:
            db.execute("INSERT OR IGNORE INTO outputs VALUES (?,?,?,?)", (key, rollout, round, payload))
        self.db.commit_pending()  # durable before it is published, inside a batch too

    def save_strategy_state(self, rollout: str, round: int, state: bytes) -> None:
        """A role's state after it closed ``round`` (committed with the round's output, which follows)."""
        with self.db.locked() as db:
            db.execute("INSERT OR REPLACE INTO strategy_states VALUES (?,?,?)", (rollout, round, state))

    def save_checkpoint(self, rollout: str, update: int, key: str, payload: bytes, state: bytes) -> None:
        """Asynchronous rollout (FedBuff): cell update ``update`` (its output, kept before it is published) and the
        role's state right after it, in one commit that also forgets what that state holds: every input of the
        rollout but its newest cell task (where a replay starts, the state loaded first), and older states. An
        asynchronous edge's store then holds the inputs since its last checkpoint, however long the rollout ran."""
        with self.db.transaction() as db:
            db.execute("INSERT OR REPLACE INTO strategy_states VALUES (?,?,?)", (rollout, update, state))
            db.execute("DELETE FROM strategy_states WHERE rollout=? AND round<?", (rollout, update))
            db.execute("DELETE FROM inputs WHERE rollout=? AND id IS NOT (SELECT MAX(id) FROM inputs WHERE rollout=? "
                       "AND kind=?)", (rollout, rollout, CellTask.KIND))
            db.execute("INSERT OR IGNORE INTO outputs VALUES (?,?,?,?)", (key, rollout, update, payload))
        self.db.commit_pending()  # durable before it is published, inside a batch too

    def prune_outputs(self, rollout: str, before: int) -> None:
        """Forget the outputs numbered below ``before``: the parent counted them (an asynchronous rollout's cell
        updates, ``fedbuff.COUNTED``), so none is ever published again. Only those the newest checkpoint holds: a
        replay from it makes the others again, and must find their stored bytes (a fresh encoding of a trusted
        edge's update would be a second noisy release of it)."""
        with self.db.locked() as db:
            db.execute("DELETE FROM outputs WHERE rollout=? AND round<? AND round <= (SELECT MAX(round) FROM "
                       "strategy_states WHERE rollout=?)", (rollout, before, rollout))

    def latest_strategy_state(self, rollout: str) -> bytes | None:
        """The newest state stored for ``rollout``: an asynchronous edge's checkpoint (``save_checkpoint``)."""
        with self.db.locked() as db:
            row = db.execute("SELECT state FROM strategy_states WHERE rollout=? ORDER BY round DESC LIMIT 1",
                             (rollout,)).fetchone()
        return bytes(row[0]) if row else None

    def strategy_state_before(self, rollout: str, round: int) -> bytes | None:
        """The newest state stored for a round before ``round``: where a replay of ``round`` starts."""
        with self.db.locked() as db:
            row = db.execute("SELECT state FROM strategy_states WHERE rollout=? AND round<? ORDER BY round DESC "
                             "LIMIT 1", (rollout, round)).fetchone()
        return bytes(row[0]) if row else None

    def inputs(self) -> list[tuple[str, bytes]]:
        """Every recorded input as ``(rollout, payload)``, in acceptance order."""
        with self.db.locked() as db:
            return [(r, bytes(p)) for r, p in db.execute("SELECT rollout, payload FROM inputs ORDER BY id")]

    def count(self, rollout: str, kind: str) -> int:
        with self.db.locked() as db:
            return int(db.execute("SELECT COUNT(*) FROM inputs WHERE rollout=? AND kind=?",
                                        (rollout, kind)).fetchone()[0])

    def save_manifest(self, rollout: str, version: int, payload: bytes) -> None:
        with self.db.locked() as db:
            db.execute("INSERT OR REPLACE INTO manifests VALUES (?,?,?)", (rollout, version, payload))

    def manifests(self) -> dict[str, tuple[int, bytes]]:
        with self.db.locked() as db:
            return {r: (v, bytes(p)) for r, v, p in db.execute("SELECT rollout, version, payload FROM manifests")}

    def forget(self, rollout: str, manifest_sha: str | None = None) -> None:
        """The rollout ended: drop its inputs, outputs and manifest (a restart replays nothing of it), and
        remember that it ended (``ended``), with the sha256 of its last manifest when given."""
        with self.db.transaction() as db:
            for table in ("inputs", "outputs", "manifests", "strategy_states"):
                db.execute(f"DELETE FROM {table} WHERE rollout=?", (rollout,))
            db.execute("INSERT INTO ended VALUES (?,?) ON CONFLICT(rollout) DO UPDATE SET manifest_sha="
                       "CASE WHEN excluded.manifest_sha = '' THEN ended.manifest_sha ELSE excluded.manifest_sha END",
                       (rollout, manifest_sha or ""))

    def ended(self) -> dict[str, str]:
        """Rollouts that ended -> the sha256 of their last manifest ("" if the edge never had it)."""
        with self.db.locked() as db:
            return {r: str(s) for r, s in db.execute("SELECT rollout, manifest_sha FROM ended")}

    def restarted(self, rollout: str) -> None:
        """A new manifest of an ended rollout's id arrived: it runs again."""
        with self.db.locked() as db:
            db.execute("DELETE FROM ended WHERE rollout=?", (rollout,))

    def close(self) -> None:
        self.db.close()
