"""Typed configuration: dataclass trees built from TOML or dicts, unknown keys rejected by path.

Every config class is a `@dataclass(kw_only=True)` that lives next to the code it configures and
validates itself in `__post_init__` with `check()`. A recipe TOML maps 1:1 onto the tree, and
`--set a.b=value` overrides use the same dotted paths. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from rlx.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(UserError):
    """A config value is invalid; `key` is the field name, prefixed with its section path on the way up. `others`: the
    other fields of the same table that the error is about (two keys that conflict), prefixed alike, so a caller that
    knows where each value came from (a recipe file, --set) can say so for each."""

    def __init__(self, key: str, message: str, others: tuple[str, ...] = ()):
        self.key, self.message, self.others = key, message, tuple(others)
        super().__init__(f"{key}: {message}")

    def under(self, prefix: str) -> ConfigError:
        """This error with its keys under the table `prefix` (`tp` -> `rollout.tp`)."""
        return ConfigError(f"{prefix}.{self.key}", self.message, tuple(f"{prefix}.{k}" for k in self.others))


def check(condition: bool, key: str, message: str, others: tuple[str, ...] = ()) -> None:
    """Raise a ConfigError for `key` unless `condition` holds (use in `__post_init__`); `others`: the other keys of the
    same table that it is about."""
    if not condition:
        raise ConfigError(key, message, others)


def check_choices(obj: Any) -> None:
    """Check every Literal-typed field of dataclass `obj` (values set from the CLI skip `from_dict`)."""
    for name, tp in get_type_hints(type(obj)).items():
        if get_origin(tp) is typing.Literal:
            value = getattr(obj, name)
            check(value in get_args(tp), name, f"expected one of {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


_SCALARS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    Path: lambda v: isinstance(v, (str, Path)),
}


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    others = [arg for arg in args if arg is not type(None)]
    if len(others) == 1:  # an optional table or value: its own error names the inner key
        return _coerce(value, others[0], key)
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, key)
        except ConfigError:
            continue
    raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")


def _coerce_sequence(value: Any, tp: Any, key: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, f"expected a list, got {value!r}")
    (item,) = get_args(tp)[:1] or (Any,)
    items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    return items if get_origin(tp) is list else tuple(items)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting where TOML's types are narrower."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ConfigError(key, f"expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (list, tuple):
        return _coerce_sequence(value, tp, key)
    if origin is dict or dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(tp) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {value!r}")
        return from_dict(tp, value, prefix=key) if dataclasses.is_dataclass(tp) else dict(value)
    accepts = _SCALARS.get(tp, lambda v: isinstance(v, tp))
    if not accepts(value):
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    return Path(value) if tp is Path else float(value) if tp is float else value


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from a (possibly nested) dict; unknown keys and bad types name their path."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            valid = ", ".join(sorted(fields))
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(key, f"unknown key ({hint}valid keys here: {valid})")
        kwargs[name] = _coerce(_over_default(fields[name], value), hints[name], key)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            key = f"{prefix}.{name}" if prefix else name
            raise ConfigError(key, "missing required key")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not e.key.startswith(prefix + "."):
            raise e.under(prefix) from None
        raise


def _over_default(f: dataclasses.Field, value: Any) -> Any:
    """A table given for a field whose default is a config built by its factory (`OptimConfig(lr=1e-5)`): the keys
    it leaves out keep that default's values, not its class's. A factory that is the class itself adds nothing: the
    keys stay left out, so its `__post_init__` still tells them from given ones (RolloutConfig's tp_degree)."""
    if not isinstance(value, dict) or f.default_factory is dataclasses.MISSING:
        return value
    default = f.default_factory()
    if not dataclasses.is_dataclass(default) or f.default_factory is type(default):
        return value
    kept = {g.name: getattr(default, g.name) for g in dataclasses.fields(default) if g.init and g.name not in value}
    return {**kept, **value}


def move_keys(data: dict, moved: dict[str, str]) -> list[tuple[str, str]]:
    """Move each old dotted key of `moved` that nested dict `data` holds to its new dotted key (in place), e.g.
    `train.lr` -> `train.optim.lr`; returns the (old, new) pairs moved. An old key whose value is a table while the
    new key lies under it (`rollout.agent` -> `rollout.agent.agent`) is already the new layout and stays."""
    done = []
    into_itself = sorted(moved, key=lambda old: not moved[old].startswith(old + "."))  # `agent` before `env`
    for old in into_itself:
        new = moved[old]
        *path, name = old.split(".")
        node = _table_at(data, path)
        if node is None or name not in node or (isinstance(node[name], dict) and new.startswith(old + ".")):
            continue
        value = node.pop(name)
        *new_path, new_name = new.split(".")
        target = data
        for part in new_path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(".".join(new_path), f"expected a table (it holds {old}'s new key {new})")
        if new_name in target:
            raise ConfigError(old, f"give {new} only (the old key {old} and the new one are both set)")
        target[new_name] = value
        done.append((old, new))
    return done


def moved_override(text: str, moved: dict[str, str]) -> tuple[str, tuple[str, str] | None]:
    """A `--set old.key=value` override rewritten to its new key (the override, (old, new) or None)."""
    key, sep, value = text.partition("=")
    old = key.strip()
    if sep and old in moved:
        return f"{moved[old]}={value}", (old, moved[old])
    return text, None


def _table_at(data: dict, path: list[str]) -> dict | None:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (Paths as strings), suitable for JSON or TOML."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b.c=value`: the value is read as a TOML literal, else taken as a plain string."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.optim.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"--set {text!r}: bad key {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of nested dict `data` with each `a.b=value` override applied (tables created)."""
    import copy

    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"--set {text!r}: {part!r} is a value, not a table")
            node = child
        node[parts[-1]] = value
    return data


def load_toml(path: str | Path) -> dict:
    """Read a TOML file, reporting syntax errors with the file name and position."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"{p}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: invalid TOML ({e})") from None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under each dataclass field (for help text and printed configs), those of
    the dataclasses it extends included."""
    import ast
    import inspect
    import textwrap

    docs = {}
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(getattr(after, "value", None), ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def help_for(cls: type, name: str) -> str:
    """Help text for a CLI option, taken from the field's docstring so CLI and recipe read the same."""
    return field_docs(cls).get(name, "")
