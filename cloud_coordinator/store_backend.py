"""Where the coordinator's store lives and how it is opened: SQLite (the default) or PostgreSQL.

Both go through SQLAlchemy Core, so the store's statements are written once. This module holds
what differs between the two: the URL (``sqlite:///path`` or ``postgresql://...``), the engine
settings (SQLite: write-ahead log, ``synchronous=FULL``, ``BEGIN IMMEDIATE`` so a transaction
that reads then writes never deadlocks against another process; PostgreSQL: psycopg 3), the
schema version table and its migrations, and the lock that keeps two coordinators from driving
one rollout (a PostgreSQL advisory lock held on a connection of its own; on SQLite an exclusive
``flock`` on a file beside the database). Both locks die with the process that holds them, so a
coordinator killed with SIGKILL never leaves a rollout locked.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fedtier.errors import ConfigError, FedtierError

"""The SQLite store's file name inside a ``state_dir`` (when no ``store`` URL is given)."""

SCHEMA_VERSION = 2
"""Version 1: the tables of fedtier <= 0.1 (SQLite only, no version table). Version 2: ``inputs.seq``
(arrival order without SQLite's rowid), the ``leases`` table and ``schema_version``."""


class RolloutHeldError(FedtierError):
    """Another coordinator drives this rollout (its lock is held): the message names it."""

    def __init__(self, rollout: str, holder: dict[str, Any] | None, store: str) -> None:
        if holder:
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["acquired"]))
            who = f"coordinator {holder['holder']} (pid {holder['pid']} on {holder['host']}, since {since})"
        else:
            who = "another coordinator (it has not written its name yet)"
        super().__init__(f"rollout {rollout!r} of store {store} is driven by {who}: stop that coordinator "
                         "first; a second one would open rounds twice")
        self.rollout = rollout
        self.holder = holder


def parse_url(location: Path | str) -> sa.URL:
    """A store location (a SQLite path, ``":memory:"``, or a URL) as a SQLAlchemy URL.

    Raises:
        ConfigError(key="store"): not a ``sqlite:`` or ``postgresql:`` URL.
    """
    text = str(location)
    if isinstance(location, Path) or "://" not in text:
        return sa.make_url("sqlite://" if text == ":memory:" else "sqlite:///" + text)
    try:
        url = sa.make_url(text)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"not a store URL: {exc}", key="store") from None
    backend = url.get_backend_name()
    if backend == "postgresql":
        return url.set(drivername="postgresql+psycopg")  # psycopg 3, whatever driver the URL named
    if backend != "sqlite":
        raise ConfigError(f"store {url.render_as_string(hide_password=True)}: fedtier stores its state in "
                          "sqlite:///PATH or postgresql://USER@HOST:PORT/DB", key="store")
    return url


def display(url: sa.URL) -> str:
    """The URL without its password (for messages and logs)."""
    return url.render_as_string(hide_password=True).replace("+psycopg", "")


def sqlite_path(url: sa.URL) -> Path | None:
    """The database file of a SQLite URL (``None``: in memory, or not SQLite)."""
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def make_engine(url: sa.URL, *, read_only: bool = False) -> Engine:
    """An engine for ``url`` with the settings the store relies on (``read_only``: for a store this process only
    reads, which it must not change, not even its SQLite journal mode).

    Raises:
        ConfigError(key="store"): PostgreSQL without psycopg installed.
    """
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, read_only=read_only)
    try:
        import psycopg  # noqa: F401  (a clear message instead of SQLAlchemy's NoSuchModuleError)
    except ImportError:
        raise ConfigError(f"store {display(url)} needs psycopg 3: pip install 'fedtier[postgres]'",
                          key="store") from None
    return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4,
                            connect_args={"connect_timeout": 10, "application_name": "fedtier-coordinator"})


READ_ONLY = "fedtier_read_only"
"""Execution option of a connection that only reads (see ``_sqlite_engine``)."""


def _sqlite_engine(url: sa.URL, *, read_only: bool = False) -> Engine:
    memory = sqlite_path(url) is None
    engine = sa.create_engine(url, poolclass=sa.pool.StaticPool if memory else sa.pool.QueuePool,
                              connect_args={"check_same_thread": False, "timeout": 30})

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        if read_only:
            return  # the journal mode is the file's (a coordinator set it); a reader leaves it as it is
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")  # an acknowledged update has reached the disk
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # A write takes SQLite's write lock up front; a read (``READ_ONLY``) takes none, so the
        # CLI and the dashboard never wait for the coordinator, nor it for them.
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


def connect_error(url: sa.URL, exc: Exception) -> ConfigError:
    """A failed connection as a message that names the store and what to check."""
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    hint = ("is the server running, and does the database exist (createdb)?"
            if url.get_backend_name() == "postgresql" else "is the directory writable?")
    return ConfigError(f"cannot open store {display(url)}: {detail}; {hint}", key="store")


# --- schema versions -----------------------------------------------------------------------------

def _migrate_1_to_2(conn: Connection) -> None:
    """fedtier 0.1's SQLite store: keep the inputs' arrival order (SQLite's rowid) in ``seq``."""
    conn.exec_driver_sql("ALTER TABLE inputs ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
    conn.exec_driver_sql("UPDATE inputs SET seq = rowid")


MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _migrate_1_to_2}
"""from version N to N + 1 (new tables come from ``metadata.create_all`` afterwards)."""


MIGRATE_COMMAND = "fedtier coordinator migrate"
"""What runs a due migration (so does the coordinator, ``run`` or ``serve``, when it opens the store)."""


def _found_version(conn: Connection) -> int:
    """The schema version of the store ``conn`` reads (0: no store; 1: fedtier 0.1's, before the version table)."""
    tables = set(sa.inspect(conn).get_table_names())
    if "schema_version" in tables:
        return int(conn.execute(sa.text("SELECT MAX(version) FROM schema_version")).scalar() or 0)
    return 1 if "rollouts" in tables else 0


def _newer(url: sa.URL, found: int) -> ConfigError:
    return ConfigError(f"store {display(url)} has schema version {found}, written by a newer fedtier "
                       f"(this one knows {SCHEMA_VERSION}): upgrade fedtier", key="store")


def read_schema(engine: Engine, url: sa.URL) -> int:
    """The schema version of the store, read without changing anything (a read-only command's open).

    Raises:
        ConfigError(key="store"): the store was written by a newer fedtier.
    """
    with engine.connect() as conn:
        conn.execution_options(**{READ_ONLY: True})
        found = _found_version(conn)
        conn.rollback()
    if found > SCHEMA_VERSION:
        raise _newer(url, found)
    return found


def migration_due(url: sa.URL, found: int, where: str | None = None) -> str:
    """What a read-only command says about a store of an older schema: a migration is due, and what runs it."""
    option = where or f"--store {display(url)}"
    return (f"store {display(url)} has schema version {found}, this fedtier writes version {SCHEMA_VERSION}: a "
            f"migration is due (read as it is, nothing changed). `{MIGRATE_COMMAND} {option}` migrates it, as "
            "`fedtier coordinator run` or `serve` of this version does when it opens the store; stop coordinators "
            "of the older version on it first")


def ensure_schema(engine: Engine, metadata: sa.MetaData, url: sa.URL) -> int:
    """Create the tables of a new store, or migrate an older one to ``SCHEMA_VERSION``.

    Returns the version found before (0: a new store). Runs in one transaction, serialized
    against other processes opening the same store (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL:
    a transaction-scoped advisory lock).

    Raises:
        ConfigError(key="store"): the store was written by a newer fedtier.
    """
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key("schema")})
        found = _found_version(conn)
        if found > SCHEMA_VERSION:
            raise _newer(url, found)
        for version in range(max(found, 1), SCHEMA_VERSION):
            if found:
                MIGRATIONS[version](conn)
        metadata.create_all(conn)
        if found < SCHEMA_VERSION:
            conn.execute(sa.text("DELETE FROM schema_version"))
            conn.execute(sa.text("INSERT INTO schema_version (version, applied) VALUES (:v, :t)"),
                         {"v": SCHEMA_VERSION, "t": time.time()})
    return found


def existing_tables(url: sa.URL) -> set[str] | None:
    """The tables of an existing store, without creating anything (``None``: no store there)."""
    path = sqlite_path(url)
    if path is not None:
        if not path.is_file():
            return None
        import sqlite3
        from contextlib import closing

        try:
            with closing(sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)) as conn:
                return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{path} is not a coordinator database: {exc}", key="store") from None
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    except sa.exc.OperationalError as exc:
        raise connect_error(url, exc) from None
    finally:
        engine.dispose()


# --- one coordinator per rollout ---------------------------------------------------------------

def lock_key(name: str) -> int:
    """A signed 64-bit key for PostgreSQL's advisory locks, stable across processes and hosts."""
    digest = hashlib.blake2b(f"fedtier:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass
class RolloutLocks:
    """The rollout locks one store object holds (released by ``release_all`` or by dying)."""

    engine: Engine
    url: sa.URL
    _pg_conn: Connection | None = None
    _files: dict[str, int] | None = None
    held: set[str] = field(default_factory=set)
    """The rollouts whose locks this object holds."""

    def try_acquire(self, rollout: str) -> bool:
        got = self._try_acquire(rollout)
        if got:
            self.held.add(rollout)
        return got

    def _try_acquire(self, rollout: str) -> bool:
        if self.engine.dialect.name == "postgresql":
            if self._pg_conn is None:
                self._pg_conn = self.engine.connect()  # a session of its own: the lock lives as long as it
            if rollout in self.held:
                return True  # advisory locks count: taking it twice would need two unlocks
            got = bool(self._pg_conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"),
                                             {"k": lock_key(f"rollout:{rollout}")}).scalar())
            self._pg_conn.commit()
            return got
        path = sqlite_path(self.url)
        if path is None:
            return True  # in memory: no other process can see this store
        import fcntl

        self._files = self._files or {}
        if rollout in self._files:
            return True
        name = hashlib.sha256(rollout.encode()).hexdigest()[:16]
        fd = os.open(f"{path}.lock-{name}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._files[rollout] = fd
        return True

    def release(self, rollout: str) -> None:
        """Give up ``rollout``'s lock, if this object holds it (its rollout ended)."""
        if rollout not in self.held:
            return
        self.held.discard(rollout)
        if self.engine.dialect.name == "postgresql":
            if self._pg_conn is not None:
                try:
                    self._pg_conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"),
                                          {"k": lock_key(f"rollout:{rollout}")})
                    self._pg_conn.commit()
                except sa.exc.DBAPIError:
                    pass  # the session is gone, and the lock with it
            return
        fd = (self._files or {}).pop(rollout, None)
        if fd is not None:
            os.close(fd)

    def release_all(self) -> None:
        if self._pg_conn is not None:
            try:  # released now, in this session: closing may only return the connection to the engine's pool,
                # and a session that ends frees its locks only once the server has noticed
                self._pg_conn.execute(sa.text("SELECT pg_advisory_unlock_all()"))
                self._pg_conn.commit()
            except sa.exc.DBAPIError:
                pass  # the session is gone already, and its locks with it
            self._pg_conn.close()
            self._pg_conn = None
        for fd in (self._files or {}).values():
            os.close(fd)
        self._files = {}
        self.held.clear()


def holder_identity(holder: str) -> dict[str, Any]:
    """Who is taking a lock: the coordinator's id, host and process."""
    return {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "acquired": time.time()}
