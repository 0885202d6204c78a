"""Reading TOML into the config's dataclasses: the generic part of ``config.py``.

``build(cls, data, where)`` fills a dataclass from a nested dict, checking every key
against the fields (a did-you-mean for a typo) and every value against its annotation
(``Literal`` choices, unions, lists, nested tables; ints accepted for floats), so that a
bad recipe fails in one :class:`~parallel3d.errors.UserError` line naming the dotted key.
``parse_overrides`` turns ``--section.key=value`` arguments into such a dict (values
parsed as TOML literals), ``merge`` lays them over a recipe and ``read_toml`` reads one.
Nothing here knows the job's sections: ``config.py`` holds them.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from parallel3d.config_choices import choice
from parallel3d.errors import UserError, did_you_mean


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return choice(value, typing.get_args(tp), where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserError:
                pass
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise UserError(f"{where} expects {names}, got {value!r}")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{where} expects a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):  # a table inside a list ([[data.blend]])
        if not isinstance(value, dict):
            raise UserError(f"'{where}' must be a table of keys, got {value!r}")
        return build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise UserError(f"{where} expects {_type_name(tp)}, got {value!r}")
    return value


def build(cls, data: dict[str, Any], where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            prefix = f"{where}." if where else ""
            hint = did_you_mean(key, names)
            hint = hint.replace("'", f"'{prefix}", 1) if hint else ""
            raise UserError(f"unknown config key '{path}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise UserError(f"'{path}' must be a table of keys, got {value!r}")
            kwargs[key] = build(tp, value, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def _parse_literal(text: str) -> Any:
    """Parse an override value as a TOML literal; anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--train.lr=3e-4", "--parallel.tp", "2"]`` into a nested dict."""
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unexpected argument '{arg}': overrides look like --section.key=value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise UserError(f"'{arg}' needs a value: --section.key=value")
            key, text = arg[2:], args[i + 1]
            i += 1
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"'{key}' overrides a value that is not a table")
        node[parts[-1]] = _parse_literal(text)
        i += 1
    return nested


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"recipe '{path}' is a directory: give the path of a TOML recipe file")
    if not path.is_file():
        raise UserError(f"recipe '{path}' not found: give the path of a TOML recipe")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"recipe '{path}' is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"recipe '{path}' is not UTF-8 text (byte {e.start}): "
                        "save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"recipe '{path}' cannot be read: {e.strerror}") from None
