"""Password files in Mosquitto's format: ``user:hash`` lines, as ``mosquitto_passwd`` writes them.

Mosquitto 2.0's ``mosquitto_passwd`` writes ``$7$`` hashes, PBKDF2-HMAC-SHA512 with 101
iterations and a 12-byte salt: ``alice:$7$101$<base64 salt>$<base64 64-byte digest>``;
``-H sha512`` writes ``$6$<base64 salt>$<base64 SHA-512(password + salt)>``. Both are read here,
so one file serves Mosquitto's ``password_file`` and the embedded broker's ``--password-file``;
:func:`hash_password` writes ``$7$`` lines (``fedtier broker passwd``), for machines without
``mosquitto_passwd``. Plain-text passwords are refused, as Mosquitto 2.0 refuses them.

With a password file, a client is let in only with a listed user name and its password:
otherwise CONNACK 0x87 Not authorized (3.1.1: return code 5), as Mosquitto answers with
``allow_anonymous false``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from fedtier.errors import ConfigError

PBKDF2_ITERATIONS = 101
"""What ``mosquitto_passwd`` 2.0 uses for ``$7$``."""
SALT_BYTES = 12


@dataclass(frozen=True, slots=True)
class _Hash:
    kind: str  # "6" or "7"
    iterations: int
    salt: bytes
    digest: bytes

    def matches(self, password: bytes) -> bool:
        if self.kind == "7":
            computed = hashlib.pbkdf2_hmac("sha512", password, self.salt, self.iterations, len(self.digest))
        else:
            computed = hashlib.sha512(password + self.salt).digest()
        return hmac.compare_digest(computed, self.digest)


def _parse_hash(text: str, where: str) -> _Hash:
    parts = text.split("$")
    try:
        if len(parts) == 5 and parts[0] == "" and parts[1] == "7":
            iterations = int(parts[2])
            if iterations < 1:
                raise ValueError("iterations")
            return _Hash("7", iterations, base64.b64decode(parts[3], validate=True),
                         base64.b64decode(parts[4], validate=True))
        if len(parts) == 4 and parts[0] == "" and parts[1] == "6":
            return _Hash("6", 1, base64.b64decode(parts[2], validate=True),
                         base64.b64decode(parts[3], validate=True))
    except (ValueError, binascii.Error):
        pass
    raise ConfigError(f"{where}: not a $6$ or $7$ password hash (plain-text passwords are not "
                      "accepted: hash them with 'fedtier broker passwd' or 'mosquitto_passwd -U')",
                      key="password_file")


class PasswordFile:
    """The users of a Mosquitto-format password file and their hashes."""

    def __init__(self, users: dict[str, _Hash]) -> None:
        self._users = users
        # An unknown user is checked against this, so a refusal takes as long either way.
        self._decoy = _Hash("7", PBKDF2_ITERATIONS, bytes(SALT_BYTES), bytes(64))

    @classmethod
    def parse(cls, text: str, source: str = "password file") -> PasswordFile:
        """Read ``user:hash`` lines; blank lines and ``#`` comments are skipped."""
        users: dict[str, _Hash] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, hashed = line.partition(":")
            where = f"{source} line {number}"
            if not sep or not user:
                raise ConfigError(f"{where}: expected 'user:hash'", key="password_file")
            users[user] = _parse_hash(hashed, where)
        return cls(users)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PasswordFile:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read password file {os.fspath(path)!r}: {exc}",
                              key="password_file") from None
        return cls.parse(text, os.fspath(path))

    @property
    def users(self) -> list[str]:
        return sorted(self._users)

    def check(self, username: str | None, password: bytes | None) -> bool:
        """Whether ``username`` is listed and ``password`` is its password."""
        if username is None or password is None:
            return False
        entry = self._users.get(username)
        if entry is None:
            self._decoy.matches(password)
            return False
        return entry.matches(password)


def hash_password(password: str | bytes, *, iterations: int = PBKDF2_ITERATIONS,
                  salt: bytes | None = None) -> str:
    """A ``$7$`` hash of ``password``, as ``mosquitto_passwd`` 2.0 writes it."""
    secret = password.encode("utf-8") if isinstance(password, str) else password
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", secret, salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def set_password(path: str | os.PathLike[str], username: str, password: str | bytes) -> None:
    """Add ``username`` to the password file at ``path`` or replace its password; the file is
    created (mode 0600) if missing, its other lines are kept."""
    if not username or ":" in username:
        raise ConfigError(f"invalid user name {username!r} (empty, or contains ':')", key="username")
    target = Path(path)
    lines = target.read_text(encoding="utf-8").splitlines() if target.exists() else []
    entry = f"{username}:{hash_password(password)}"
    kept = [line for line in lines if line.partition(":")[0].strip() != username]
    text = "\n".join([*kept, entry]) + "\n"
    PasswordFile.parse(text, os.fspath(path))  # never write a file the broker would refuse
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
