"""The coordinator's store, on SQLite and on a real PostgreSQL server: exact model round trips,
atomic rounds, open-round inputs in arrival order, the ledger, schema versions, and the lock that
keeps a second coordinator off a rollout."""

from __future__ import annotations

import math
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator.store import CoordinatorStore, decode_params, encode_params
from cloud_coordinator.store_backend import SCHEMA_VERSION, RolloutHeldError
from fedtier.errors import ConfigError

PARAMS = {"w": np.array([[0.1, -2.5]], np.float32), "b": np.array([3.0], np.float32)}
RELEASE = {"round": 0, "event": "noise", "step": 0, "node": "d0", "parent": "cell-a", "parent_trusted": False,
           "protected": ["d0"], "sensitivity": 0.5, "inputs": {"n": 1}, "sigma": 1.25, "noise_multiplier": 2.5,
           "mode": "rdp", "observed": True}


def test_params_round_trip_bit_exact() -> None:
    back = decode_params(encode_params(PARAMS, rollout="r", round=3))
    assert all(np.array_equal(back[k], v) and back[k].dtype == np.float32 for k, v in PARAMS.items())


def test_state_survives_reopening_and_rounds_commit_with_their_model(store_url: str) -> None:
    store = CoordinatorStore(store_url)
    store.ensure_rollout("r", {"rounds": 3}, b"{}")
    store.save_initial_model("r", PARAMS)
    for i, key in enumerate(["k9", "k1", "k5"]):  # arrival order, not key order
        store.record_input("r", 0, key, f"update-{i}".encode())
    store.record_input("r", 0, "k1", b"redelivered")  # a duplicate key is ignored
    assert store.inputs("r") == [b"update-0", b"update-1", b"update-2"]
    newer = {k: v + 1 for k, v in PARAMS.items()}
    store.commit_round("r", 0, 1, newer, 0.5, 1.2, {"round": 0}, releases=[RELEASE],
                       clear=[{"round": 0, "step": 1, "sender": "d1", "receiver": "cell-b", "receiver_trusted": True}],
                       strategy_state={"m": np.arange(3, dtype=np.float64)})
    store.close()

    again = CoordinatorStore(store_url)
    latest = again.latest_model("r")
    assert latest is not None and (latest.version, latest.round) == (1, 0)
    assert np.array_equal(latest.params["w"], newer["w"])
    assert again.inputs("r") == []  # consumed by the committed round
    assert again.rounds("r")[0]["accuracy"] == 0.5
    assert again.model("r", 0) is not None and again.model("r", 0).round == -1
    assert again.privacy_releases("r") == [{**RELEASE, "rollout": "r"}]
    assert again.privacy_clear("r")[0]["receiver_trusted"] is True
    assert np.array_equal(again.strategy_state("r", 1)["m"], np.arange(3.0))
    again.ensure_rollout("r", {"rounds": 99}, b"other")  # a restart keeps the original
    assert again.manifest("r") == b"{}"
    assert [again.next_manifest_version() for _ in range(3)] == [1, 2, 3]
    again.close()


def test_a_nan_accuracy_reads_back_as_none_on_both_backends(store_url: str) -> None:
    store = CoordinatorStore(store_url)
    store.ensure_rollout("r", {}, b"")
    store.commit_round("r", 0, 1, PARAMS, math.nan, math.nan, {})
    assert store.rounds("r")[0]["accuracy"] is None and store.models("r")[0]["accuracy"] is None
    store.close()


def test_a_second_coordinator_of_a_rollout_is_refused_with_the_holders_name(store_url: str) -> None:
    first, second = CoordinatorStore(store_url), CoordinatorStore(store_url)
    first.hold_rollout("r", "cloud-east")
    second.hold_rollout("other", "cloud-west")  # another rollout of the same store is free
    with pytest.raises(RolloutHeldError, match=r"rollout 'r' .* is driven by coordinator cloud-east \(pid \d+ on "):
        second.hold_rollout("r", "cloud-west")
    first.close()  # the holder stops: the rollout is free again
    second.hold_rollout("r", "cloud-west")
    assert second.lease("r")["holder"] == "cloud-west"
    second.close()


def test_a_holder_killed_with_sigkill_frees_its_rollout(store_url: str, tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from cloud_coordinator.store import CoordinatorStore
        CoordinatorStore({store_url!r}).hold_rollout("r", "doomed")
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        store = CoordinatorStore(store_url)
        with pytest.raises(RolloutHeldError, match="doomed"):
            store.hold_rollout("r", "next")
    finally:
        holder.kill()
        holder.wait(10)
    for _ in range(100):  # the server notices the dead session within moments
        try:
            store.hold_rollout("r", "next")
            break
        except RolloutHeldError:
            time.sleep(0.05)
    assert store.lease("r")["holder"] == "next"
    store.close()


LEGACY_SCHEMA = """
CREATE TABLE rollouts (rollout TEXT PRIMARY KEY, config TEXT NOT NULL, manifest BLOB NOT NULL,
    status TEXT NOT NULL, created REAL NOT NULL, finished REAL);
CREATE TABLE inputs (rollout TEXT NOT NULL, round INTEGER NOT NULL, msg_key TEXT NOT NULL,
    payload BLOB NOT NULL, PRIMARY KEY (rollout, msg_key));
"""


def test_a_store_of_the_previous_schema_is_migrated_keeping_the_order_of_its_inputs(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:  # what fedtier 0.1 wrote: no version table, inputs ordered by rowid
        conn.executescript(LEGACY_SCHEMA)
        conn.execute("INSERT INTO rollouts VALUES ('r', '{}', x'', 'running', 1.0, NULL)")
        conn.executemany("INSERT INTO inputs VALUES ('r', 0, ?, ?)", [("kz", b"first"), ("ka", b"second")])
    store = CoordinatorStore(db)
    assert store.status("r") == "running"
    assert store.inputs("r") == [b"first", b"second"]
    store.record_input("r", 0, "kb", b"third")
    assert store.inputs("r") == [b"first", b"second", b"third"]
    store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_store_written_by_a_newer_fedtier_is_refused(store_url: str) -> None:
    import sqlalchemy as sa

    CoordinatorStore(store_url).close()
    from cloud_coordinator.store_backend import parse_url

    engine = sa.create_engine(parse_url(store_url))
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}")
    engine.dispose()
    with pytest.raises(ConfigError, match=f"schema version {SCHEMA_VERSION + 1}, written by a newer fedtier"):
        CoordinatorStore(store_url)


def test_an_unreachable_or_foreign_store_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"cannot open store postgresql://nobody:\*\*\*@127.0.0.1:1/x: .*server "
                                          "running") as refused:
        CoordinatorStore("postgresql://nobody:secret@127.0.0.1:1/x")
    assert "secret" not in str(refused.value)  # never a password in a message
    with pytest.raises(ConfigError, match="sqlite:///PATH or postgresql://"):
        CoordinatorStore("mysql://root@localhost/fedtier")


def test_a_rollout_that_ended_releases_its_lease(store_url: str) -> None:
    # Issue 34: the lease row of a finished rollout stayed in the store.
    first, second = CoordinatorStore(store_url), CoordinatorStore(store_url)
    for rollout, end in (("done", "finished"), ("halted", "stopped")):
        first.ensure_rollout(rollout, {}, b"")
        first.hold_rollout(rollout, "cloud-east")
        first.set_status(rollout, "paused")  # a rollout that has not ended keeps it
        assert first.lease(rollout)["holder"] == "cloud-east"
        with pytest.raises(RolloutHeldError):
            second.hold_rollout(rollout, "cloud-west")

        first.set_status(rollout, end)

        assert first.lease(rollout) is None
        second.hold_rollout(rollout, "cloud-west")  # its lock is free while the first coordinator still runs
        assert second.lease(rollout)["holder"] == "cloud-west"
    first.close()
    second.close()  # a coordinator started again on ended rollouts (it only clears their manifests) ...
    third = CoordinatorStore(store_url)
    assert third.lease("done") is None and third.lease("halted") is None  # ... leaves no lease behind either
    third.close()


def older_store(db: Path) -> None:
    """A store as fedtier 0.1 left it: this version's tables without the version table, the leases and inputs.seq."""
    CoordinatorStore(db).close()
    store = CoordinatorStore(db)
    store.ensure_rollout("r", {"rounds": 2, "topology": {"members": {"cell-a": ["d0"]}}}, b"{}")
    store.commit_round("r", 0, 1, PARAMS, 0.5, 1.0, {"round": 0})
    store.close()
    with sqlite3.connect(db) as conn:
        conn.executescript("DROP TABLE schema_version; DROP TABLE leases; ALTER TABLE inputs DROP COLUMN seq;"
                           "PRAGMA journal_mode=DELETE;")


def layout(db: Path) -> tuple[list[str], list[str], str]:
    with sqlite3.connect(db) as conn:
        tables = sorted(n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
        columns = [c[1] for c in conn.execute("PRAGMA table_info(inputs)")]
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    return tables, columns, mode


def test_a_read_only_open_never_migrates_an_older_store_and_says_a_migration_is_due(tmp_path: Path) -> None:
    db = tmp_path / "coordinator.db"
    older_store(db)
    before = layout(db)

    store = CoordinatorStore(db, read_only=True)

    assert (store.schema_found, store.migration_due) == (1, True)
    assert store.status("r") == "running" and store.rounds("r")[0]["accuracy"] == 0.5  # it reads what it can
    with pytest.raises(ConfigError, match=r"cannot read store .* as it is \(no such column: inputs.seq\): store "
                                          r".* has schema version 1, this fedtier writes version 2: a migration is "
                                          r"due .*`fedtier coordinator migrate --store sqlite:///"):
        store.inputs("r")
    with pytest.raises(RuntimeError, match="opened read-only"):
        store.set_desired("r", "paused")
    store.close()
    assert layout(db) == before  # no table, no column, not even the journal mode
    assert "schema_version" not in before[0] and before[2] == "delete"

    CoordinatorStore(db).close()  # a coordinator of this version opens it: migrated
    tables, columns, _ = layout(db)
    assert {"schema_version", "leases"} <= set(tables) and "seq" in columns
    assert not CoordinatorStore(db, read_only=True).migration_due


def test_read_only_commands_leave_an_older_store_as_it_is_and_name_the_command_that_migrates_it(
        tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedtier.cli import cli

    state = tmp_path / "state"
    state.mkdir()
    db = state / "coordinator.db"
    older_store(db)
    before = layout(db)
    runner = CliRunner()
    for command in (["rollout", "status", "r"], ["rollout", "list"], ["rollout", "models", "r"], ["devices", "list"]):
        result = runner.invoke(cli, [*command, "--state-dir", str(state)])
        assert result.exit_code == 0, (command, result.output)
        assert "has schema version 1, this fedtier writes version 2: a migration is due" in result.stderr
        assert f"`fedtier coordinator migrate --state-dir {state}` migrates it" in result.stderr
        assert layout(db) == before, command
    assert "rollout r" in runner.invoke(cli, ["rollout", "status", "r", "--state-dir", str(state)]).stdout
    report = runner.invoke(cli, ["report", "r", "--store", str(db), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0 and "a migration is due" in report.stderr, report.output
    assert layout(db) == before

    migrated = runner.invoke(cli, ["coordinator", "migrate", "--state-dir", str(state)])

    assert migrated.exit_code == 0, migrated.output
    assert migrated.output == f"store sqlite:///{db}: migrated from schema version 1 to 2\n"
    assert "schema_version" in layout(db)[0]
    again = runner.invoke(cli, ["coordinator", "migrate", "--state-dir", str(state)])
    assert "has schema version 2, this fedtier's: nothing to migrate" in again.output
    quiet = runner.invoke(cli, ["rollout", "status", "r", "--state-dir", str(state)])
    assert quiet.exit_code == 0 and quiet.stderr == ""
