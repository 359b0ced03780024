"""fedtier.runtime.config: typed TOML sections whose errors name the offending key."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier.errors import ConfigError
from fedtier.runtime.config import BrokerConfig, Section, dumps_toml, load, node_id, opt, read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# A small hierarchy exercising every supported field type and constraint.


@dataclass(frozen=True)
class Training(Section):
    lr: float = opt(0.1, gt=0, help="Learning rate.")
    local_steps: int = opt(5, min=1, max=100, help="Steps per round.")
    optimizer: str = opt("sgd", choices=("sgd", "adam"))
    data_dir: Path = opt(Path("data"), help="Where the data lives.")
    clip: float | None = opt(None, min=0.0)


@dataclass(frozen=True)
class Service(Section):
    node: str = opt(help="This node's id.", check=node_id)
    training: Training = opt(default_factory=Training)
    broker: BrokerConfig = opt(default_factory=BrokerConfig)
    verbose: bool = opt(False)
    peers: tuple[str, ...] = opt(default_factory=tuple)
    quotas: dict[str, int] = opt(default_factory=dict)
    log_file: Path | None = opt(None)


def error_of(data: dict[str, Any], cls: type[Section] = Service) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cls.from_mapping(data, source="svc.toml")
    return info.value


# --- happy path -------------------------------------------------------------------------------


def test_defaults_and_values() -> None:
    cfg = Service.from_mapping({"node": "edge-1", "training": {"lr": 1, "optimizer": "adam"},
                                "peers": ["a", "b"], "quotas": {"x": 3}})

    assert cfg.node == "edge-1"
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.training.optimizer == "adam"
    assert cfg.training.local_steps == 5
    assert cfg.training.clip is None
    assert cfg.peers == ("a", "b")
    assert cfg.quotas == {"x": 3}
    assert cfg.broker == BrokerConfig()


def test_sections_are_frozen() -> None:
    cfg = Service.from_mapping({"node": "n"})

    with pytest.raises(AttributeError):
        cfg.node = "m"  # type: ignore[misc]


# --- unknown keys --------------------------------------------------------------------------


def test_unknown_key_names_the_full_dotted_key_and_suggests_the_closest() -> None:
    err = error_of({"node": "n", "training": {"local_step": 3}})

    assert err.key == "training.local_step"
    assert str(err).startswith("svc.toml: [training.local_step] ")
    assert "did you mean 'local_steps'" in str(err)


def test_unknown_key_three_levels_deep() -> None:
    err = error_of({"node": "n", "broker": {"prot": 5}})

    assert err.key == "broker.prot"
    assert "did you mean 'port'" in str(err) or "did you mean 'protocol'" in str(err)


def test_unknown_key_without_a_close_match_lists_the_known_keys() -> None:
    err = error_of({"node": "n", "zzzzzz": 1})

    assert err.key == "zzzzzz"
    assert "did you mean" not in str(err)
    assert "known keys: broker, log_file, node, peers, quotas, training, verbose" in str(err)


# --- types --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "key", "fragment"), [
    ({"training": {"local_steps": True}}, "training.local_steps", "integer"),
    ({"training": {"local_steps": "5"}}, "training.local_steps", "integer"),
    ({"training": {"local_steps": 5.0}}, "training.local_steps", "integer"),
    ({"training": {"local_steps": 5.5}}, "training.local_steps", "integer"),
    ({"training": {"lr": True}}, "training.lr", "number"),
    ({"training": {"lr": "0.1"}}, "training.lr", "number"),
    ({"training": {"optimizer": 1}}, "training.optimizer", "string"),
    ({"training": {"data_dir": 3}}, "training.data_dir", "path"),
    ({"training": {"data_dir": ""}}, "training.data_dir", "path"),
    ({"training": {"clip": "x"}}, "training.clip", "number"),
    ({"log_file": 5}, "log_file", "path"),
    ({"training": 5}, "training", "table"),
    ({"verbose": 1}, "verbose", "true or false"),
    ({"verbose": "yes"}, "verbose", "true or false"),
    ({"peers": "a"}, "peers", "list"),
    ({"peers": ["a", 1]}, "peers[1]", "string"),
    ({"quotas": [1]}, "quotas", "table"),
    ({"quotas": {"x": "1"}}, "quotas.x", "integer"),
    ({"broker": {"port": "1883"}}, "broker.port", "integer"),
])
def test_wrong_types_name_the_key(data: dict[str, Any], key: str, fragment: str) -> None:
    err = error_of({"node": "n", **data})

    assert err.key == key
    assert f"[{key}]" in str(err)
    assert fragment in str(err)


def test_required_key_missing() -> None:
    err = error_of({})

    assert err.key == "node"
    assert "required" in str(err)


# --- constraints ----------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "key"), [
    ({"training": {"optimizer": "rmsprop"}}, "training.optimizer"),
    ({"training": {"local_steps": 0}}, "training.local_steps"),
    ({"training": {"local_steps": 101}}, "training.local_steps"),
    ({"training": {"lr": 0}}, "training.lr"),
    ({"training": {"lr": -0.1}}, "training.lr"),
    ({"training": {"clip": -1.0}}, "training.clip"),
    ({"broker": {"port": 0}}, "broker.port"),
    ({"broker": {"port": 65536}}, "broker.port"),
    ({"broker": {"protocol": 3}}, "broker.protocol"),
    ({"broker": {"keepalive_s": 4}}, "broker.keepalive_s"),
])
def test_constraints_name_the_key(data: dict[str, Any], key: str) -> None:
    err = error_of({"node": "n", **data})

    assert err.key == key


@pytest.mark.parametrize(("data", "attr", "value"), [
    ({"training": {"local_steps": 1}}, "local_steps", 1),
    ({"training": {"local_steps": 100}}, "local_steps", 100),
    ({"training": {"lr": 1e-9}}, "lr", 1e-9),
    ({"training": {"clip": 0.0}}, "clip", 0.0),
])
def test_bounds_are_inclusive_and_gt_is_strict(data: dict[str, Any], attr: str, value: Any) -> None:
    cfg = Service.from_mapping({"node": "n", **data})

    assert getattr(cfg.training, attr) == value


@pytest.mark.parametrize("bad", ["a/b", "", "x" * 65, "+"])
def test_check_callable_names_the_key(bad: str) -> None:
    err = error_of({"node": bad})

    assert err.key == "node"
    assert "invalid" in str(err)


# --- BrokerConfig cross-field checks --------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 1000, 4095])
def test_broker_max_packet_size_between_1_and_4095_is_rejected(size: int) -> None:
    err = error_of({"node": "n", "broker": {"max_packet_size": size}})

    assert err.key == "broker.max_packet_size"


@pytest.mark.parametrize("size", [0, 4096, 1 << 20])
def test_broker_max_packet_size_0_or_at_least_4096_is_accepted(size: int) -> None:
    assert BrokerConfig.from_mapping({"max_packet_size": size}).max_packet_size == size


def test_broker_negative_max_packet_size_is_rejected() -> None:
    err = error_of({"max_packet_size": -1}, BrokerConfig)

    assert err.key == "max_packet_size"


# --- files ------------------------------------------------------------------------------------


def test_load_resolves_relative_paths_against_the_config_files_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a config in tmp/etc, loaded from an unrelated working directory.
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "svc.toml").write_text(
        'node = "edge-1"\n'
        'log_file = "../logs/svc.log"\n'
        "[training]\n"
        'data_dir = "sub/data"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    # Execute
    cfg = load(Service, "../etc/svc.toml")

    # Assert
    assert cfg.training.data_dir == etc.resolve() / "sub/data"
    assert cfg.log_file is not None and cfg.log_file.is_absolute()
    assert cfg.log_file.resolve() == (tmp_path / "logs" / "svc.log").resolve()


def test_load_keeps_absolute_paths(tmp_path: Path) -> None:
    path = tmp_path / "svc.toml"
    path.write_text('node = "n"\n[training]\ndata_dir = "/srv/data"\n')

    assert load(Service, path).training.data_dir == Path("/srv/data")


def test_from_mapping_without_a_base_dir_keeps_relative_paths() -> None:
    cfg = Service.from_mapping({"node": "n", "training": {"data_dir": "sub/data"}})

    assert cfg.training.data_dir == Path("sub/data")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "svc.toml"
    path.write_text('node = "n"\n[training]\nlocal_steps = true\n')

    with pytest.raises(ConfigError) as info:
        load(Service, path)

    assert str(info.value).startswith(f"{path}: [training.local_steps] ")
    assert info.value.source == str(path)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('node = "n\n')

    with pytest.raises(ConfigError, match="broken.toml.*not valid TOML"):
        load(Service, path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"

    with pytest.raises(ConfigError, match="absent.toml.*not found"):
        read_toml(path)
    with pytest.raises(ConfigError, match="absent.toml"):
        load(Service, path)


# --- dumps_toml ---------------------------------------------------------------------------------


def test_dumps_toml_by_hand() -> None:
    text = dumps_toml({"a": 1, "t": {"x": "s", "sub": {"y": [1, 2]}}, "b": True})

    assert tomllib.loads(text) == {"a": 1, "b": True, "t": {"x": "s", "sub": {"y": [1, 2]}}}


def test_dumps_toml_of_to_dict_loads_back_to_the_same_config(tmp_path: Path) -> None:
    # Prepare
    cfg = Service.from_mapping({
        "node": "edge-1", "verbose": True, "peers": ["p1", "p2"], "quotas": {"a": 1, "b-c": 2},
        "training": {"lr": 0.05, "local_steps": 7, "optimizer": "adam", "data_dir": "/data/x", "clip": 1.5},
        "broker": {"host": "broker.local", "port": 8883, "protocol": 4, "max_packet_size": 4096},
        "log_file": "/var/log/svc.log",
    })
    path = tmp_path / "out.toml"

    # Execute
    text = dumps_toml(cfg.to_dict())
    path.write_text(text)

    # Assert
    assert tomllib.loads(text) == cfg.to_dict()
    assert load(Service, path) == cfg


@pytest.mark.parametrize("value", ["plain", 'quote " inside', "back\\slash", "tab\there", "ünïcödé ✓", "",
                                   "C:\\Users\\x"])
def test_dumps_toml_string_values_round_trip(value: str) -> None:
    assert tomllib.loads(dumps_toml({"k": value, "t": {"k": value}})) == {"k": value, "t": {"k": value}}


@pytest.mark.parametrize("data", [
    {"k": "two\nlines"},                 # a newline must be escaped in a basic string
    {"k": "bell\x07"},                   # so must every other control character
    {"k": "del\x7f"},
    {"t": {"k": "cr\r"}},
    {"café": 1},                         # bare keys are ASCII only ("é".isalnum() is True)
    {"a\\b": 1},                         # a backslash in a quoted key must be escaped
    {"a b": {"x": 1}},                   # top-level table names are not quoted at all...
    {"a.b": {"x": 1}},                   # ... so a dot makes a nested table
    {"t": {"k\ny": 1}},
], ids=["newline", "bell", "del", "cr", "non-ascii-key", "backslash-key", "space-table", "dot-table",
        "newline-key"])
def test_dumps_toml_escapes_what_toml_requires(data: dict[str, Any]) -> None:
    assert tomllib.loads(dumps_toml(data)) == data


_safe_keys = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1, max_size=8)
# No control characters in strings (the failing cases above cover those).
_safe_text = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=12)
_scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), _safe_text)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=4))
_tables = st.recursive(st.dictionaries(_safe_keys, _values, max_size=4),
                       lambda inner: st.dictionaries(_safe_keys, st.one_of(_values, inner), max_size=4),
                       max_leaves=12)


@SETTINGS
@given(_tables)
def test_dumps_toml_round_trip_property(data: dict[str, Any]) -> None:
    assert tomllib.loads(dumps_toml(data)) == data


def test_dumps_toml_refuses_what_it_cannot_write() -> None:
    with pytest.raises(TypeError):
        dumps_toml({"k": None})
    with pytest.raises(TypeError):
        dumps_toml({"k": [{"a": 1}]})
