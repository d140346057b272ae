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
        value = parse_yaml(raw, f"override {item!r}: the value") if raw != "" else ""
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


MAX_CONFIG_BYTES = 16 << 20  # a config is a few KB; anything this big is the wrong file (a checkpoint, a shard)
MAX_DEPTH = 64  # sections nest 2-3 deep; deeper (or a YAML alias that contains itself) is not a config


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently, so a
    second ``rollout:`` section would replace the first whole). Keys merged in with ``<<`` may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (first on line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str) -> Any:
    """YAML text -> plain data (strictly: no key twice, at most MAX_DEPTH levels); ConfigError names `source`."""
    try:
        loaded = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not a config: nested too deeply for the YAML parser") from None
    except ValueError as e:  # a constructor's conversion, e.g. an integer of more than 4300 digits
        raise ConfigError(f"{source}: not valid YAML: {str(e).split(';')[0]}") from None
    _check_depth(loaded, source)
    return loaded


def _check_depth(data: Any, source: str) -> None:
    """No value nests more than MAX_DEPTH levels and none contains itself (a YAML alias inside its own anchor).
    Iterative depth-first, each container measured once, so aliases repeated many times over cost nothing."""
    height: dict[int, int] = {}  # id of a container -> levels below and with it
    path: set[int] = set()  # containers entered and not yet left: the ancestors of what is popped next
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        value, leaving = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        kids = list(value.values() if isinstance(value, dict) else value)
        if leaving:
            path.discard(id(value))
            height[id(value)] = 1 + max((height[id(k)] for k in kids if isinstance(k, (dict, list))), default=0)
            if height[id(value)] > MAX_DEPTH:
                raise ConfigError(f"{source}: not a config: nested more than {MAX_DEPTH} levels deep")
        elif id(value) in path:
            raise ConfigError(f"{source}: not a config: a YAML alias refers to a value that contains it")
        elif id(value) not in height:
            path.add(id(value))
            stack.append((value, True))
            stack.extend((k, False) for k in kids)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file (an empty file is ``{}``); errors name the file and what is wrong
    (unreadable, a directory, binary or not UTF-8, too large, not YAML, not a mapping)."""
    source = str(path)
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{source}: cannot read config: it is a directory")
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{source}: cannot read config: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: not a config: larger than {MAX_CONFIG_BYTES >> 20} MB")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{source}: not a config: UTF-16 or UTF-32 text (its byte-order mark); save it as UTF-8")
    nul = raw.find(b"\0")
    if nul >= 0:  # no text config has one (PyYAML refuses it too, with a less helpful message)
        raise ConfigError(f"{source}: not a config: a binary file (a NUL byte at offset {nul})")
    try:
        text = raw.decode("utf-8-sig" if raw.startswith(b"\xef\xbb\xbf") else "utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not a config: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    loaded = parse_yaml(text, source)
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
