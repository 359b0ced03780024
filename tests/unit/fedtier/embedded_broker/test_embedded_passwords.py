"""Mosquitto-format password files: reading mosquitto_passwd's hashes, writing compatible ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtier.embedded_broker.passwords import PasswordFile, hash_password, set_password
from fedtier.errors import ConfigError

# Written by mosquitto_passwd 2.0.11: `-b` ($7$, PBKDF2-SHA512, 101 iterations) and `-H sha512 -b` ($6$).
MOSQUITTO_LINES = """\
alice:$7$101$CCeU6wtWVbCks7mc$5WjWIWI1g/vZWDwsdWHclGJGcxocoMSufm2JvUlADhTpdUIv6n3/ZOmqLYSCA8ULowGUbel9Hldf4UdVkPPyPQ==
# a comment, then a blank line

bob:$6$SE6AGF9Zn0xzjWts$CdFse1g1y08/58xU+8eg05Rz5LejJ72DHuefCEbmutmdx2M3BXbt49d2xLtf8mv+Elr0+UcgOUkXdEBVosLp9A==
"""


def test_hashes_written_by_mosquitto_passwd_are_checked() -> None:
    passwords = PasswordFile.parse(MOSQUITTO_LINES)
    assert passwords.users == ["alice", "bob"]
    assert passwords.check("alice", b"secret") and passwords.check("bob", b"hunter2")
    assert not passwords.check("alice", b"hunter2") and not passwords.check("bob", b"secret")
    assert not passwords.check("carol", b"secret")
    assert not passwords.check("alice", None) and not passwords.check(None, b"secret")


def test_written_hashes_have_mosquitto_passwd_s_form_and_check() -> None:
    line = hash_password("pw", salt=bytes(range(12)))
    kind, iterations, salt, digest = line.split("$")[1:]
    assert (kind, iterations, salt, len(digest)) == ("7", "101", "AAECAwQFBgcICQoL", 88)
    assert PasswordFile.parse(f"u:{line}").check("u", b"pw")
    assert hash_password("pw") != hash_password("pw")  # a fresh salt each time


@pytest.mark.parametrize("line", ["alice:secret", "alice:$7$x$AAAA$AAAA", "alice:$5$AAAA$AAAA", ":$6$AAAA$AAAA",
                                  "no-colon", "alice:$6$not base64!$AAAA"])
def test_plain_text_and_malformed_lines_are_refused(line: str) -> None:
    with pytest.raises(ConfigError) as info:
        PasswordFile.parse(line)
    assert info.value.key == "password_file"


def test_set_password_adds_replaces_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text(MOSQUITTO_LINES)
    set_password(path, "carol", "c")
    set_password(path, "alice", "new")
    passwords = PasswordFile.load(path)
    assert passwords.users == ["alice", "bob", "carol"]
    assert passwords.check("alice", b"new") and not passwords.check("alice", b"secret")
    assert passwords.check("bob", b"hunter2") and passwords.check("carol", b"c")
    assert "# a comment" in path.read_text()
    with pytest.raises(ConfigError):
        set_password(path, "a:b", "x")
    with pytest.raises(ConfigError):
        PasswordFile.load(tmp_path / "missing")
