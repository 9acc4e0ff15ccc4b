"""Command options derived from config dataclasses: each field of a stage's config (`RolloutConfig`,
`ScoreConfig`, `TrainConfig`) is one typer option, with the field's name, type, default and docstring (as the
help), so a field added to a config appears in its command and `--help` with no second edit. A field that is
itself a config table (e.g. `vision: VisionConfig`, `optim: OptimConfig`, `sampling: SamplingParams`) contributes its
own fields as flat options (`--max-pixels`, `--lr`, `--temperature`), from which the wrapper builds the table; their
defaults are those of the config the field's factory builds (SFTConfig's `optim` has lr 1e-5, EvalConfig's
`sampling` temperature 0), so the flags a recipe's `[train.optim]` or `[rollout.sampling]` table sets stay flat.

    @config_command(ScoreConfig, "score", metavars={"reward": "NAME[=W]"})
    def score(cfg: ScoreConfig, rollouts: Annotated[str, typer.Option(...)], ...) -> None:

The decorated function keeps its own options (files, paths); the wrapper typer sees takes those plus one
keyword per config field, builds the config (validation errors name the option) and calls the function.

A field that is itself a config dataclass (`lora: LoraConfig | None`, a recipe's `[lora]` table) is flattened into
options prefixed with its name (`--lora-rank`, `--lora-alpha`, ...): an optional one is built only when one of its
options is given (else it stays None: the table is absent). `nested_config("lora", LoraConfig)` does the same for a
command whose config class has no such field (the function then receives `lora=`), and `config_fields` takes some
fields of another config as options (`rlx eval`: the rollout engine's settings).
No torch import: `rlx --help` stays instant.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import typer

from rlx.commands._common import reporting
from rlx.config import ConfigError, help_for
from rlx.errors import UserError

_PLAIN = (bool, int, float, str)


def _option_type(tp: Any) -> tuple[Any, str | None] | None:
    """(the type typer parses, a metavar) for a field annotation, or None when it is no CLI option (tables)."""
    origin = get_origin(tp)
    if tp in _PLAIN:
        return tp, None
    if tp is dict or origin is dict:  # a JSON object on the command line (a recipe gives a TOML table)
        return str | None, "JSON"
    if origin is typing.Literal:
        return str, "|".join(str(a) for a in get_args(tp))
    if origin in (list, tuple):  # repeat the option; a tuple[str, ...] field gets a tuple of the values
        item = get_args(tp)[0]
        return list[item] | None, None
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        listed = [a for a in args if get_origin(a) is list]
        if listed:  # e.g. `list[str] | str`: repeat the option
            return _option_type(listed[0])
        if len(args) == 1 and args[0] in _PLAIN:
            return args[0] | None, None
    return None


def _tables(cls: type) -> dict[str, type]:
    """Fields of `cls` that are config tables themselves (dataclasses): their fields become options."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def nested_class(tp: Any) -> type | None:
    """The config dataclass of a field typed `Config` or `Config | None` (flattened into options), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def _table_default(f: dataclasses.Field, base: Any) -> Any:
    """The config a table field starts from: the parent default's (`base`), else what the field's factory builds
    (SFTConfig's `optim` is `OptimConfig(lr=1e-5)`, not `OptimConfig()`), else None (the class's own defaults)."""
    if base is not None:
        return getattr(base, f.name)
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def _is_sequence(tp: Any) -> bool:
    """A list or tuple field (a repeated option): left out, it keeps its default."""
    return get_origin(tp) in (list, tuple)


def field_options(cls: type, exclude=(), metavars: dict | None = None, decls: dict | None = None,
                  help_extra: dict | None = None, prefix: str = "",
                  base: Any = None) -> list[inspect.Parameter]:  # fmt: skip
    """One keyword-only typer parameter per CLI-able field of dataclass `cls`, in field order; a table field (a
    config dataclass such as `vision`) gives its own fields in its place under their own names, and an optional
    nested config field's fields follow as `<field>_<name>` (`--lora-rank`). With a `prefix` (nested fields), every
    option defaults to None (so a given one can be told from a left-out one) and the help names the default. A table's
    defaults are those of the config its field's factory builds (`base`, passed down)."""
    hints, out, tables = get_type_hints(cls), [], _tables(cls)
    metavars, decls, help_extra = metavars or {}, decls or {}, help_extra or {}
    own = cls.__dict__.get("__annotations__", {})
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):  # the class's own fields first
        if f.name in tables:  # a table is never left out whole: `exclude` names its fields
            table_base = _table_default(f, base)
            out += field_options(tables[f.name], exclude, metavars, decls, help_extra, prefix, table_base)
            continue
        if f.name in exclude:
            continue
        nested = nested_class(hints[f.name])
        if nested is not None:
            out += field_options(nested, prefix=_join(prefix, f.name))
            continue
        found = _option_type(hints[f.name])
        if found is None:
            continue
        tp, metavar = found
        default = None if f.default is dataclasses.MISSING else f.default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and not prefix:
            default = inspect.Parameter.empty  # a required field: a required option
        if base is not None and f.default_factory is dataclasses.MISSING:
            default = getattr(base, f.name)
        if _is_sequence(hints[f.name]):
            default = None
        kwargs = {"help": help_for(cls, f.name) + help_extra.get(f.name, "")}
        if prefix:
            shown = default if f.default_factory is dataclasses.MISSING else f.default_factory()
            kwargs["help"] += f" [default: {shown}]"
            tp, default = (tp if get_origin(tp) in (Union, types.UnionType) else tp | None), None
        if metavars.get(f.name, metavar):
            kwargs["metavar"] = metavars.get(f.name, metavar)
        option = typer.Option(*decls.get(f.name, ()), **kwargs)
        out.append(inspect.Parameter(_join(prefix, f.name), inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[tp, option]))  # fmt: skip
    return out


def build_from_options(cls: type, values: dict, prefix: str = "", optional: bool = False, base: Any = None):
    """Config `cls` from the option values `field_options(cls, prefix=prefix)` declared (popped from `values`), the
    options left out keeping `base`'s values; None when `optional` and none of its options was given. Validation
    errors name the option (`lora_rank`)."""
    hints, kwargs, tables = get_type_hints(cls), {}, _tables(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        if f.name in tables:  # a table's options sit beside its parent's, under the same prefix
            kwargs[f.name] = build_from_options(tables[f.name], values, prefix, base=_table_default(f, base))
            continue
        nested = nested_class(hints[f.name])
        if nested is not None:
            optional_field = nested is not hints[f.name]
            value = build_from_options(nested, values, key, optional=optional_field)
            if value is not None or optional_field:
                kwargs[f.name] = value
        elif key in values:
            value = values.pop(key)
            if isinstance(value, str) and (hints[f.name] is dict or get_origin(hints[f.name]) is dict):
                value = _json_object(value, key)
            if isinstance(value, list) and get_origin(hints[f.name]) is tuple:
                value = tuple(value)
            if value is not None or not (prefix or _has_factory(cls, f.name) or _is_sequence(hints[f.name])):
                kwargs[f.name] = value
    if optional and not kwargs:
        return None
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_join(prefix, e.key), e.message) from None


def _json_object(text: str, key: str) -> dict:
    """The value of a dict-typed option: a JSON object such as '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(key, f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a JSON object such as '{{\"name\": value}}', got {text!r}")
    return value


def nested_config(name: str, cls: type, **options) -> Callable:
    """Decorator: config dataclass `cls` as options `--<name>-<field>` (see `field_options`, which takes `options`);
    the function receives `<name>=cls(...)` when any of them is given, else `<name>=None`. Errors name the option."""

    def wrap(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != name]
        fields = field_options(cls, prefix=name, **options)
        names = [p.name for p in fields]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            values = {k: kwargs.pop(k) for k in names if k in kwargs}
            with reporting(fn.__name__.replace("_", "-")):
                config = _build(cls, values, name, optional=True)
            return fn(*args, **{name: config}, **kwargs)

        _set_signature(command, own + fields)
        return command

    return wrap


def _build(cls: type, values: dict, prefix: str = "", optional: bool = False):
    """`build_from_options` with validation errors as UserErrors naming the option (`--lora-rank: ...`)."""
    try:
        return build_from_options(cls, values, prefix, optional)
    except ConfigError as e:
        flag = e.key.rsplit(".", 1)[-1]  # flags are flat: `sampling.n` (a check of the parent's) is --n
        raise UserError(f"--{flag.replace('_', '-')}: {e.message}") from None


def _set_signature(command: Callable, params: list[inspect.Parameter]) -> None:
    """What typer (and an outer decorator) sees of `command`: these parameters, not the wrapped function's."""
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer must see the new signature, not the wrapped function's


def config_fields(name: str, cls: type, include: tuple[str, ...], **options) -> Callable:
    """Decorator: the fields `include` of config `cls` as options under their own names (`--engine`, `--device`),
    checked by building `cls` from them (errors name the option); the function receives `<name>=` a dict of their
    values (`rlx eval` takes a rollout engine's settings so)."""

    def wrap(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != name]
        left_out = [f.name for f in dataclasses.fields(cls) if f.name not in include]
        fields = [p for p in field_options(cls, exclude=left_out, **options) if p.name in include]
        names = [p.name for p in fields]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            values = {k: kwargs.pop(k) for k in names if k in kwargs}
            with reporting(fn.__name__.rstrip("_").replace("_", "-")):
                _build(cls, dict(values))  # option errors name the option before any model is loaded
            return fn(*args, **{name: values}, **kwargs)

        _set_signature(command, own + fields)
        return command

    return wrap


def config_command(cls: type, name: str, **options) -> Callable:
    """Decorator for a stage command whose first parameter is the config `cls` (see the module docstring);
    `options` go to `field_options` (exclude, metavars, decls, help_extra)."""

    def wrap(fn: Callable) -> Callable:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        fields = field_options(cls, **options)
        names = {p.name for p in fields}
        if len(names) != len(fields):
            raise TypeError(f"{cls.__name__}: a table's field has the name of another option")
        clash = names & {p.name for p in own}
        if clash:
            raise TypeError(f"{fn.__name__}: {sorted(clash)} are both config fields and own options")

        @functools.wraps(fn)
        def command(**kwargs):
            values = {k: kwargs.pop(k) for k in names}
            with reporting(name):
                cfg = _build(cls, values)
            return fn(cfg, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + fields
        _set_signature(command, params)
        return command

    return wrap


@functools.cache
def _factories(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING)


def _has_factory(cls: type, name: str) -> bool:
    """Fields whose default comes from a factory (lists): an option left out keeps that default."""
    return name in _factories(cls)
