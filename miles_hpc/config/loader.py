"""The generic machinery under the run config: plain data <-> frozen dataclasses, strictly typed.

Invariants:
- Loading is strict: an unknown key or a value of the wrong type fails with :class:`ConfigError`, naming the
  full key path (``rollout.temperature``) and the source (file name or ``override``). Nothing is silently coerced
  except int -> float and YAML 1.1's ``1e-5`` strings -> float.
- ``to_dict`` then ``build`` gives back an equal tree (the round trip ``RUN/config.yaml`` relies on).

Nothing here knows the run's sections; :mod:`miles_hpc.config.run` declares them.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem a user can act on: names the key path and where the value came from."""


def meta(text: str) -> dict[str, str]:
    """A field's help, as ``field(metadata=meta("..."))``: the reference table (docs/config.md) prints it."""
    return {"help": text}


def require(ok: bool, key: str, message: str) -> None:
    """A ``__post_init__`` check: the key is relative to its section; :func:`build` prefixes the path."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


_SCI_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert_union(value: Any, tp: Any, path: str, source: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, path, source)
        except ConfigError:
            continue
    raise ConfigError(f"{source}: {path}: expected {type_name(tp)}, got {value!r}")


def _convert_scalar(value: Any, tp: Any, path: str, source: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `3e-4` (no dot) as a string; accept exactly that spelling of a number, nothing looser.
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{source}: {path}: unsupported annotation {tp!r}")
    raise ConfigError(f"{source}: {path}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def _convert(value: Any, tp: Any, path: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in canonical form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path}: expected a mapping for section {type_name(tp)}, got {value!r}")
        return _build(typing.cast(type, tp), value, path, source)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, path, source)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{source}: {path}: expected one of {type_name(tp)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(v, item_tp, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(v, val_tp, f"{path}.{k}", source) for k, v in value.items()}
    return _convert_scalar(value, tp, path, source)


def _build(cls: type[T], data: dict[str, Any], prefix: str, source: str) -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{source}: unknown key {where!r} (section {cls.__name__} has: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _convert(value, hints[key], path, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"{source}: {where}{e}") from None


def build(cls: type[T], data: Any, *, source: str = "<dict>") -> T:
    """A config tree of ``cls`` from plain data (as parsed from YAML); strict."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    return _build(cls, data, "", source)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config tree (tuples become lists so YAML stays plain)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    out: dict[str, Any] = plain(cfg)
    return out


def dump(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to nested plain data. Values are parsed as YAML scalars/lists."""
    out = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file (an empty file is ``{}``); errors name the file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{source}: cannot read config: {e.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def load(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Load YAML ``path`` (or defaults when None), apply overrides, validate. Errors name file and key path."""
    source = "<defaults>" if path is None else str(path)
    data = {} if path is None else read_yaml(path)
    # Validate the file alone first so an error in it is reported against the file, not the overrides.
    cfg = build(cls, data, source=source)
    if overrides:
        return build(cls, apply_overrides(data, overrides), source=f"{source} + overrides")
    return cfg


def reference(cls: type, prefix: str = "") -> str:
    """Markdown table of every key (path, type, default, help) under ``cls``."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"] if not prefix else []
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], f"{path}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        type_text = type_name(hints[f.name]).replace("|", "\\|")
        rows.append(f"| `{path}` | {type_text} | `{default!r}` | {f.metadata.get('help', '')} |")
    for sub, sub_prefix in nested:
        rows.append(reference(sub, sub_prefix))
    return "\n".join(rows)
