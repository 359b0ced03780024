"""A device's durable state: the outbox of unacknowledged updates, the last round done, and
the manifests it installed.

paho keeps unsent QoS 1 messages in memory only (field notes §2.2). The agent writes each
update here *before* publishing it and deletes it when the broker acknowledges it; on
start, whatever is left is published again (receivers drop duplicates by idempotency key).
The last round reported per rollout, and the (round, step) of the newest upload, are stored
with the update in one transaction, so a restarted agent neither loses an update nor trains a
step twice (a second upload of a step would be a second, uncharged, noisy release of it).

The bytes of the newest upload (of every kind sent at that round and step) are kept beyond the
broker's acknowledgement: a broker that restarts without persistence loses the messages it had
acknowledged but not yet delivered, and when the edge then asks for that step again (its task,
sent again when the device reconnects), the device sends the same bytes again — never a second
training of the step, which would be a second noisy release.

The manifest of every rollout the device takes part in is kept as it arrived (signed bytes):
a restarted agent installs it again from here, with the artifacts in its cache, instead of
refusing the edge's retained copy as "not newer than the installed version".

The local work in progress is recorded before the trainer runs (``begin_work``: rollout, round,
step, how many times it was started) and cleared once it finished (``end_work``). A record still
open when the agent starts is a run that died in that work — a native crash of the training
runtime leaves nothing else behind. Started again as often as the limit (``max_task_crashes``),
the work is not started once more: it is marked failed, the agent reports ``training_failed``
instead, and a repeated request of the same work gets the same answer (``DESIGN`` §9, containment).
"""

from __future__ import annotations

from pathlib import Path

from fedtier.storage.sqlite import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    msg_key TEXT PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS progress (rollout TEXT PRIMARY KEY, last_round INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sent (rollout TEXT PRIMARY KEY, round INTEGER NOT NULL, step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS manifests (rollout TEXT PRIMARY KEY, version INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS uploads (
    msg_key TEXT NOT NULL, rollout TEXT NOT NULL, round INTEGER NOT NULL, step INTEGER NOT NULL,
    topic TEXT NOT NULL, payload BLOB NOT NULL, created INTEGER NOT NULL, PRIMARY KEY (rollout, msg_key));
CREATE TABLE IF NOT EXISTS work (
    rollout TEXT PRIMARY KEY, round INTEGER NOT NULL, step INTEGER NOT NULL, attempts INTEGER NOT NULL,
    failed TEXT);
"""

WorkRecord = tuple[str, int, int, int, "str | None"]
"""``(rollout, round, step, attempts, failed)`` of local work in progress (or failed): see ``begin_work``."""


class DeviceState:
    def __init__(self, path: Path | str) -> None:
        self.db = Database(path, SCHEMA)

    def put_update(self, key: str, topic: str, payload: bytes, rollout: str, round: int, now: float,
                   sent: tuple[int, int] | None = None) -> None:
        """Queue an upload for sending and record the progress it stands for, atomically.

        Args:
            round: the role's ``last_round``: an upload in the middle of a round (a step before
                the last) leaves it where it was.
            sent: the upload's ``(round, step)``; progress never moves backwards.
        """
        with self.db.transaction() as db:
            db.execute("INSERT OR REPLACE INTO outbox VALUES (?,?,?,?)", (key, topic, payload, now))
            db.execute("INSERT INTO progress VALUES (?,?) ON CONFLICT(rollout) DO UPDATE SET "
                       "last_round=MAX(last_round, excluded.last_round)", (rollout, round))
            if sent is not None:
                db.execute("INSERT INTO sent VALUES (?,?,?) ON CONFLICT(rollout) DO UPDATE SET "
                           "round=excluded.round, step=excluded.step "
                           "WHERE (excluded.round, excluded.step) > (sent.round, sent.step)",
                           (rollout, sent[0], sent[1]))
                # the newest step's uploads only: an older one is never asked for again
                db.execute("DELETE FROM uploads WHERE rollout=? AND (round, step) < (?,?)", (rollout, *sent))
                db.execute("INSERT OR REPLACE INTO uploads SELECT ?,?,?,?,?,?, "
                           "(SELECT COALESCE(MAX(created), 0) + 1 FROM uploads) "
                           "WHERE NOT EXISTS (SELECT 1 FROM uploads WHERE rollout=? AND (round, step) > (?,?))",
                           (key, rollout, *sent, topic, payload, rollout, *sent))

    def delete(self, key: str) -> None:
        with self.db.locked() as db:
            db.execute("DELETE FROM outbox WHERE msg_key=?", (key,))

    def retopic(self, key: str, topic: str) -> None:
        """The upload ``key`` goes to ``topic`` from now on (its outbox entry and its kept bytes): a device of a
        roaming rollout that moved sends what it queued in its old cell to its new one."""
        with self.db.transaction() as db:
            db.execute("UPDATE outbox SET topic=? WHERE msg_key=?", (topic, key))
            db.execute("UPDATE uploads SET topic=? WHERE msg_key=?", (topic, key))

    def pending(self) -> list[tuple[str, str, bytes]]:
        """Unacknowledged messages as ``(key, topic, payload)``, oldest first."""
        with self.db.locked() as db:
            return [(k, t, bytes(p)) for k, t, p in
                    db.execute("SELECT msg_key, topic, payload FROM outbox ORDER BY created")]

    def last_round(self, rollout: str) -> int:
        with self.db.locked() as db:
            row = db.execute("SELECT last_round FROM progress WHERE rollout=?", (rollout,)).fetchone()
        return int(row[0]) if row else -1

    def last_sent(self, rollout: str) -> tuple[int, int] | None:
        """``(round, step)`` of the newest upload queued for ``rollout``, or None."""
        with self.db.locked() as db:
            row = db.execute("SELECT round, step FROM sent WHERE rollout=?", (rollout,)).fetchone()
        return (int(row[0]), int(row[1])) if row else None

    def uploads(self, rollout: str, round: int, step: int) -> list[tuple[str, str, bytes]]:
        """``(key, topic, payload)`` of the uploads of ``round``/``step`` when that is the newest step
        uploaded for ``rollout`` (acknowledged by the broker or not), in the order they were queued."""
        with self.db.locked() as db:
            return [(k, t, bytes(p)) for k, t, p in db.execute(
                "SELECT msg_key, topic, payload FROM uploads WHERE rollout=? AND round=? AND step=? ORDER BY created",
                (rollout, round, step))]

    def manifest_version(self) -> int:
        """The newest manifest version this device installed (no older one is accepted again)."""
        with self.db.locked() as db:
            row = db.execute("SELECT value FROM settings WHERE name='manifest_version'").fetchone()
        return int(row[0]) if row else 0

    def set_manifest_version(self, version: int) -> None:
        with self.db.locked() as db:
            db.execute("INSERT INTO settings VALUES ('manifest_version', ?) ON CONFLICT(name) DO UPDATE SET "
                       "value=MAX(value, excluded.value)", (version,))

    def save_manifest(self, rollout: str, version: int, payload: bytes) -> None:
        """Keep the manifest installed for ``rollout`` (as received: signed bytes)."""
        with self.db.locked() as db:
            db.execute("INSERT OR REPLACE INTO manifests VALUES (?,?,?)", (rollout, version, payload))

    def installed_manifests(self) -> dict[str, bytes]:
        """Rollout -> the manifest bytes installed for it, for a restart."""
        with self.db.locked() as db:
            return {r: bytes(p) for r, p in db.execute("SELECT rollout, payload FROM manifests ORDER BY version")}

    def forget_manifest(self, rollout: str) -> None:
        """The rollout ended: do not install it again at the next start (nor send its uploads again)."""
        with self.db.transaction() as db:
            db.execute("DELETE FROM manifests WHERE rollout=?", (rollout,))
            db.execute("DELETE FROM uploads WHERE rollout=?", (rollout,))
            db.execute("DELETE FROM work WHERE rollout=?", (rollout,))

    def begin_work(self, rollout: str, round: int, step: int, limit: int) -> str | None:
        """Record, durably, that local work on ``(round, step)`` of ``rollout`` starts; ``None`` means run it.

        The same work still open from an earlier start was never finished: the agent died in it. Once it was
        started ``limit`` times so, it is marked failed (``"crash"``) instead and not run again; work marked
        failed answers its reason. Other work replaces the record (one per rollout).

        Written without an fsync (``flushed=False``): it must survive the agent's process dying, which a
        written commit does; after a power loss a record may be missing (a death not counted) or stale (one
        counted that was not)."""
        with self.db.transaction(flushed=False) as db:
            row = db.execute("SELECT round, step, attempts, failed FROM work WHERE rollout=?", (rollout,)).fetchone()
            if row is not None and (int(row[0]), int(row[1])) == (round, step):
                if row[3] is not None:
                    return str(row[3])
                if int(row[2]) >= limit:
                    db.execute("UPDATE work SET failed='crash' WHERE rollout=?", (rollout,))
                    return "crash"
                db.execute("UPDATE work SET attempts=attempts+1 WHERE rollout=?", (rollout,))
                return None
            db.execute("INSERT OR REPLACE INTO work VALUES (?,?,?,1,NULL)", (rollout, round, step))
            return None

    def fail_work(self, rollout: str, round: int, step: int, reason: str) -> None:
        """The work of ``(round, step)`` failed for ``reason``: a repeated request of it gets that answer."""
        with self.db.transaction(flushed=False) as db:
            db.execute("INSERT OR REPLACE INTO work VALUES (?,?,?,1,?)", (rollout, round, step, reason))

    def end_work(self, rollout: str, round: int, step: int) -> None:
        """The work of ``(round, step)`` finished (its result went to the role): forget it, unless it failed."""
        with self.db.transaction(flushed=False) as db:
            db.execute("DELETE FROM work WHERE rollout=? AND round=? AND step=? AND failed IS NULL",
                       (rollout, round, step))

    def open_work(self) -> list[WorkRecord]:
        """Every work record, for a restart: those not failed are runs that died in them."""
        with self.db.locked() as db:
            return [(str(r), int(n), int(s), int(a), None if f is None else str(f)) for r, n, s, a, f in
                    db.execute("SELECT rollout, round, step, attempts, failed FROM work ORDER BY rollout")]

    def close(self) -> None:
        self.db.close()


class MemoryDeviceState:
    """``DeviceState``'s contract in dicts, for the simulator's thousands of devices.

    Why: an in-memory SQLite database per simulated device costs about 75 kB (its page cache and
    connection), three quarters of a device's memory before it trains; a simulated device has no
    disk to survive a crash on anyway. A test holds both classes to the same answers on the same
    operations (``tests/unit/device_agent/test_device_state.py``).
    """

    def __init__(self, keep_uploads: bool = True) -> None:
        """``keep_uploads=False``: ``uploads`` answers ``[]`` — the simulator, which has no broker to lose a
        message, does not keep a copy of every device's last update (a fifth of a device's memory)."""
        self._keep_uploads = keep_uploads
        self._uploads: dict[str, tuple[tuple[int, int], list[tuple[str, str, bytes]]]] = {}
        self._outbox: dict[str, tuple[str, bytes, float, int]] = {}
        self._progress: dict[str, int] = {}
        self._sent: dict[str, tuple[int, int]] = {}
        self._manifest_version = 0
        self._manifests: dict[str, tuple[int, bytes]] = {}
        self._work: dict[str, list] = {}  # rollout -> [round, step, attempts, failed]
        self._order = 0

    def put_update(self, key: str, topic: str, payload: bytes, rollout: str, round: int, now: float,
                   sent: tuple[int, int] | None = None) -> None:
        self._order += 1
        self._outbox[key] = (topic, bytes(payload), float(now), self._order)
        self._progress[rollout] = max(self._progress.get(rollout, round), round)
        if sent is not None and (rollout not in self._sent or tuple(sent) > self._sent[rollout]):
            self._sent[rollout] = (int(sent[0]), int(sent[1]))
        if sent is not None and self._keep_uploads:
            step = (int(sent[0]), int(sent[1]))
            newest, kept = self._uploads.get(rollout, (step, []))
            if step > newest:
                newest, kept = step, []
            if step == newest:
                kept = [u for u in kept if u[0] != key] + [(key, topic, bytes(payload))]
                self._uploads[rollout] = (newest, kept)

    def delete(self, key: str) -> None:
        self._outbox.pop(key, None)

    def retopic(self, key: str, topic: str) -> None:
        if key in self._outbox:
            self._outbox[key] = (topic, *self._outbox[key][1:])
        for rollout, (newest, kept) in self._uploads.items():
            self._uploads[rollout] = (newest, [(k, topic if k == key else t, p) for k, t, p in kept])

    def pending(self) -> list[tuple[str, str, bytes]]:
        return [(k, t, p) for k, (t, p, _, _) in sorted(self._outbox.items(), key=lambda i: (i[1][2], i[1][3]))]

    def last_round(self, rollout: str) -> int:
        return self._progress.get(rollout, -1)

    def last_sent(self, rollout: str) -> tuple[int, int] | None:
        return self._sent.get(rollout)

    def uploads(self, rollout: str, round: int, step: int) -> list[tuple[str, str, bytes]]:
        newest, kept = self._uploads.get(rollout, ((-1, -1), []))
        return list(kept) if newest == (round, step) else []

    def manifest_version(self) -> int:
        return self._manifest_version

    def set_manifest_version(self, version: int) -> None:
        self._manifest_version = max(self._manifest_version, int(version))

    def save_manifest(self, rollout: str, version: int, payload: bytes) -> None:
        self._manifests[rollout] = (int(version), bytes(payload))

    def installed_manifests(self) -> dict[str, bytes]:
        return {r: p for r, (_, p) in sorted(self._manifests.items(), key=lambda i: i[1][0])}

    def forget_manifest(self, rollout: str) -> None:
        self._manifests.pop(rollout, None)
        self._uploads.pop(rollout, None)
        self._work.pop(rollout, None)

    def begin_work(self, rollout: str, round: int, step: int, limit: int) -> str | None:
        record = self._work.get(rollout)
        if record is not None and (record[0], record[1]) == (round, step):
            if record[3] is not None:
                return str(record[3])
            if record[2] >= limit:
                record[3] = "crash"
                return "crash"
            record[2] += 1
            return None
        self._work[rollout] = [int(round), int(step), 1, None]
        return None

    def fail_work(self, rollout: str, round: int, step: int, reason: str) -> None:
        self._work[rollout] = [int(round), int(step), 1, reason]

    def end_work(self, rollout: str, round: int, step: int) -> None:
        record = self._work.get(rollout)
        if record is not None and (record[0], record[1]) == (round, step) and record[3] is None:
            del self._work[rollout]

    def open_work(self) -> list[WorkRecord]:
        return [(r, w[0], w[1], w[2], w[3]) for r, w in sorted(self._work.items())]

    def close(self) -> None:
        return None
