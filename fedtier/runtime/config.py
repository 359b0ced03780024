"""TOML configuration: typed sections, validated up front, errors that name the bad key.

Each config file maps onto a tree of frozen dataclasses (``Section`` subclasses). Fields
carry their own documentation and constraints in ``field(metadata=...)`` via ``opt()``:

* ``help``    — one line for ``docs/configuration.md`` and error messages;
* ``choices`` — allowed values;
* ``min`` / ``max`` — numeric bounds (inclusive); ``gt`` — strict lower bound;
* ``check``   — a callable that raises ``ValueError`` with a reason.

``load(cls, path)`` reads the file, rejects unknown keys (suggesting the closest known
one), converts types strictly (no bool where an int is wanted, no silent truncation) and
raises ``ConfigError`` whose message starts with ``<file>: [section.key]``. Relative paths
in a config are resolved against the config file's directory, so a config works from
whatever directory the service is started in.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar, Union, get_args, get_origin

from fedtier.errors import ConfigError
from fedtier.transport.topics import check_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T", bound="Section")


def opt(default: Any = MISSING, *, help: str = "", choices: tuple[Any, ...] | None = None,
        min: float | None = None, max: float | None = None, gt: float | None = None,
        check: Callable[[Any], None] | None = None, default_factory: Any = MISSING) -> Any:
    """A config field with documentation and constraints (see module docstring)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "gt": gt, "check": check}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def node_id(value: str) -> None:
    """Validator: a node/cell/rollout id usable in topics."""
    try:
        check_id(value)
    except Exception as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class Section:
    """Base of every config section."""

    @classmethod
    def from_mapping(cls: type[T], data: Mapping[str, Any], *, prefix: str = "", source: str | None = None,
                     base_dir: Path | None = None) -> T:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table, got {type(data).__name__}", key=prefix or None, source=source)
        if base_dir is not None:
            data = cls.rebase_strings(data, base_dir)
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in fields(cls) if f.init}
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(key, list(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(known))}"
                raise ConfigError(f"unknown key{hint}", key=_join(prefix, key), source=source)
        kwargs: dict[str, Any] = {}
        for name, f in known.items():
            path = _join(prefix, name)
            if name in data:
                kwargs[name] = _convert(data[name], hints[name], path, source, base_dir)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError("required key is missing", key=path, source=source)
            else:
                continue
            _validate(kwargs[name], f.metadata, path, source)
        try:
            obj = cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc), key=prefix or None, source=source) from None
        obj.check(prefix=prefix, source=source)
        return obj

    @classmethod
    def rebase_strings(cls, data: Mapping[str, Any], base_dir: Path) -> Mapping[str, Any]:
        """``data`` (this section's raw table) with its relative file names that are not ``Path`` fields made
        absolute against ``base_dir`` (a factory's ``file.py:function``, a ``sqlite:///`` URL). ``Path``
        fields are resolved by type; override for strings that name a file."""
        return data

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        """Cross-field validation; override and raise ``self.error(...)``."""

    def error(self, message: str, key: str, *, prefix: str = "", source: str | None = None) -> ConfigError:
        return ConfigError(message, key=_join(prefix, key), source=source)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for TOML writing and for putting into manifests)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, source: str | None, base_dir: Path | None) -> Any:
    """``value`` as the declared type ``tp``, or a ``ConfigError`` naming ``path``: unions first, then
    nested sections, the scalar kinds (a table: ``_SCALARS``), paths, and the two containers."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(value, tp, path, source, base_dir)
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp.from_mapping(value, prefix=path, source=source, base_dir=base_dir)
    if tp in _SCALARS:
        return _convert_scalar(value, tp, path, source)
    if tp is Path:
        return _convert_path(value, path, source, base_dir)
    if origin is tuple:
        return _convert_tuple(value, tp, path, source, base_dir)
    if origin in (dict, collections.abc.Mapping):
        return _convert_table(value, tp, path, source, base_dir)
    raise ConfigError(f"unsupported config type {tp!r}", key=path, source=source)  # pragma: no cover


def _convert_union(value: Any, tp: Any, path: str, source: str | None, base_dir: Path | None) -> Any:
    """``X | None`` takes ``None`` or an ``X``; a wider union takes the first member type that converts."""
    args = [a for a in get_args(tp) if a is not type(None)]
    if value is None:
        return None
    if len(args) == 1:  # Optional[X]: X's own error names the real problem
        return _convert(value, args[0], path, source, base_dir)
    for arg in args:
        try:
            return _convert(value, arg, path, source, base_dir)
        except ConfigError:
            continue
    raise ConfigError(f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}",
                      key=path, source=source)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


_SCALARS: dict[Any, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = {
    # type -> (accepts, what the error says was expected, conversion). Strict: TOML's true is not 1, and
    # a float is not silently truncated to an int; an int where a float is wanted is widened.
    bool: (lambda v: isinstance(v, bool), "true or false", lambda v: v),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", lambda v: v),
    float: (_is_number, "a number", float),
    str: (lambda v: isinstance(v, str), "a string", lambda v: v),
}


def _convert_scalar(value: Any, tp: type, path: str, source: str | None) -> Any:
    accepts, expected, cast = _SCALARS[tp]
    if not accepts(value):
        raise ConfigError(f"expected {expected}, got {value!r}", key=path, source=source)
    return cast(value)


def _convert_path(value: Any, path: str, source: str | None, base_dir: Path | None) -> Path:
    """A path string, ``~`` expanded; a relative one is taken from the config file's directory, so the
    config means the same files whatever directory the service starts in."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"expected a path string, got {value!r}", key=path, source=source)
    p = Path(value).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(os.path.normpath(base_dir / p))
    return p


def _convert_tuple(value: Any, tp: Any, path: str, source: str | None, base_dir: Path | None) -> tuple[Any, ...]:
    """A TOML array as a tuple of the first type argument, each item's errors naming ``path[i]``."""
    if not isinstance(value, list):
        raise ConfigError(f"expected a list, got {value!r}", key=path, source=source)
    item_tp = get_args(tp)[0]
    return tuple(_convert(v, item_tp, f"{path}[{i}]", source, base_dir) for i, v in enumerate(value))


def _convert_table(value: Any, tp: Any, path: str, source: str | None, base_dir: Path | None) -> dict[str, Any]:
    """A TOML table as a dict of string keys, each value converted to the value type and named ``path.key``."""
    _, val_tp = get_args(tp)
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {value!r}", key=path, source=source)
    return {str(k): _convert(v, val_tp, _join(path, str(k)), source, base_dir) for k, v in value.items()}


def _validate(value: Any, meta: Mapping[str, Any], path: str, source: str | None) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"must be one of {', '.join(map(repr, choices))}; got {value!r}", key=path, source=source)
    for bound, ok, word in (("min", lambda v, b: v >= b, ">="), ("max", lambda v, b: v <= b, "<="),
                            ("gt", lambda v, b: v > b, ">")):
        b = meta.get(bound)
        if b is not None and isinstance(value, (int, float)) and not ok(value, b):
            raise ConfigError(f"must be {word} {b}; got {value!r}", key=path, source=source)
    check = meta.get("check")
    if check is not None:
        try:
            check(value)
        except ValueError as exc:
            raise ConfigError(str(exc), key=path, source=source) from None


def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file; a missing file or a syntax error becomes a ``ConfigError``."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=str(path)) from None


def load(cls: type[T], path: str | Path) -> T:
    """Load and validate a config file of section type ``cls``."""
    path = Path(path)
    return cls.from_mapping(read_toml(path), source=str(path), base_dir=path.resolve().parent)


def merge_tables(mapping: Mapping[str, Any], extra: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``mapping`` with each table of ``extra`` merged into its own (keys of ``extra`` win)."""
    out = dict(mapping)
    for key, table in extra.items():
        current = out.get(key)
        out[key] = {**(current if isinstance(current, Mapping) else {}), **table}
    return out


def dumps_toml(data: Mapping[str, Any]) -> str:
    """Write plain data as TOML (enough for the configs fedtier generates: no arrays of tables).

    Strings and keys are escaped per TOML 1.0 (control characters as ``\\uXXXX``); keys that
    are not bare ASCII are quoted; table names are dotted paths of such keys.
    """
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((_toml_key(key), value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for name, table in tables:
        _dump_table(name, table, lines)
    return "\n".join(lines) + "\n"


def _dump_table(name: str, table: Mapping[str, Any], lines: list[str]) -> None:
    lines.append("")
    lines.append(f"[{name}]")
    for key, value in table.items():
        if not isinstance(value, Mapping):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        if isinstance(value, Mapping):
            _dump_table(f"{name}.{_toml_key(key)}", value, lines)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, Path)):
        return _toml_string(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


@dataclass(frozen=True)
class BrokerConfig(Section):
    """Where an MQTT connection goes and how it behaves."""

    host: str = opt("127.0.0.1", help="Broker host name or IP address.")
    port: int = opt(1883, min=1, max=65535, help="Broker TCP port.")
    protocol: int = opt(5, choices=(4, 5), help="MQTT protocol: 5 (MQTT 5) or 4 (MQTT 3.1.1).")
    keepalive_s: int = opt(30, min=5, max=3600, help="MQTT keepalive, seconds.")
    session_expiry_s: int = opt(3600, min=0, help="How long the broker keeps our session while we are away.")
    max_packet_size: int = opt(0, min=0, help="Packet limit in bytes; 0 = the broker's CONNACK limit or 256 KiB. "
                                              "Larger messages are chunked.")
    tls_ca: Path | None = opt(None, help="CA certificate (PEM) that signed the broker's certificate; enables TLS.")
    tls_cert: Path | None = opt(None, help="This node's client certificate (PEM) for mutual TLS.")
    tls_key: Path | None = opt(None, help="This node's private key (PEM, mode 0600) for mutual TLS.")
    max_auth_failures: int = opt(5, min=0, help="End the process with exit code 77 after this many authorization "
                                                "failures in a row (certificate refused by either side, CONNACK or "
                                                "PUBACK 'not authorized'); 0 = retry forever.")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.max_packet_size and self.max_packet_size < 4096:
            raise self.error("must be 0 or at least 4096", "max_packet_size", prefix=prefix, source=source)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise self.error("tls_cert and tls_key go together", "tls_cert", prefix=prefix, source=source)
        if self.tls_cert is not None and self.tls_ca is None:
            raise self.error("a client certificate needs tls_ca to verify the broker", "tls_ca",
                             prefix=prefix, source=source)
        for key in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, key)
            if path is not None and not path.is_file():
                raise self.error(f"file not found: {path}", key, prefix=prefix, source=source)


LOG_LEVELS = ("debug", "info", "warning", "error")
