"""A throwaway PostgreSQL server for the tests: ``initdb`` + ``pg_ctl`` from Debian's ``postgresql``
package, in a temporary directory, on a free port, stopped at the end of the session.

PostgreSQL refuses to run as root; when the tests run as root the server runs as the
``postgres`` system user (the Debian package creates it) in a directory that user owns.
Each test gets a database of its own (``CREATE DATABASE``), so tests never see each other's rows.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

USER = "fedtier"
"""The server's superuser (trust authentication on 127.0.0.1 only)."""


def pg_bin(name: str) -> str | None:
    """``initdb``/``pg_ctl`` on PATH, else the newest under /usr/lib/postgresql/*/bin (Debian's layout)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return candidates[-1] if candidates else None


def available() -> bool:
    if pg_bin("initdb") is None or pg_bin("pg_ctl") is None:
        return False
    return os.geteuid() != 0 or _postgres_user() is not None


def _postgres_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


@dataclass
class PostgresServer:
    directory: Path
    port: int
    _as_user: list[str]

    @property
    def base_url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}"

    @classmethod
    def start(cls, port: int) -> "PostgresServer":
        directory = Path(tempfile.mkdtemp(prefix="fedtier-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            user = _postgres_user()
            assert user is not None, "running as root needs the postgres system user"
            os.chown(directory, user.pw_uid, user.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data, sockets, log = directory / "data", directory / "sock", directory / "server.log"
        subprocess.run([*as_user, "mkdir", str(sockets)], check=True)
        subprocess.run([*as_user, pg_bin("initdb"), "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8",
                        "--no-sync", "--no-instructions"], check=True, capture_output=True, text=True)
        options = (f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        done = subprocess.run([*as_user, pg_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w",
                               "-t", "60", "start"], capture_output=True, text=True)
        if done.returncode != 0:
            text = log.read_text() if log.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stdout}{done.stderr}\n{text}")
        return cls(directory=directory, port=port, _as_user=as_user)

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"{self.base_url}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{self.base_url}/{name}"

    def stop(self) -> None:
        subprocess.run([*self._as_user, pg_bin("pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate",
                        "-w", "stop"], capture_output=True)
        shutil.rmtree(self.directory, ignore_errors=True)
