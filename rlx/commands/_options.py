"""Command options derived from config dataclasses: each field of a stage's config (`RolloutConfig`,
`ScoreConfig`, `TrainConfig`) is one typer option, with the field's name, type, default and docstring (as the
help), so a field added to a config appears in its command and `--help` with no second edit. A field that is
itself a config table (e.g. `vision: VisionConfig`) contributes its own fields as options (`--max-pixels`), from
which the wrapper builds the table.

    @config_command(ScoreConfig, "score", metavars={"reward": "NAME[=W]"})
    def score(cfg: ScoreConfig, rollouts: Annotated[str, typer.Option(...)], ...) -> None:

The decorated function keeps its own options (files, paths); the wrapper typer sees takes those plus one
keyword per config field, builds the config (validation errors name the option) and calls the function.
No torch import: `rlx --help` stays instant.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for

_PLAIN = (bool, int, float, str)


def _option_type(tp: Any) -> tuple[Any, str | None] | None:
    """(the type typer parses, a metavar) for a field annotation, or None when it is no CLI option (tables)."""
    origin = get_origin(tp)
    if tp in _PLAIN:
        return tp, None
    if origin is typing.Literal:
        return str, "|".join(str(a) for a in get_args(tp))
    if origin is list:
        (item,) = get_args(tp)
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


def field_options(cls: type, exclude=(), metavars: dict | None = None, decls: dict | None = None,
                  help_extra: dict | None = None) -> list[inspect.Parameter]:  # fmt: skip
    """One keyword-only typer parameter per CLI-able field of dataclass `cls`, in field order (a table field's
    own fields in its place; `exclude` names fields at either level)."""
    hints, out, tables = get_type_hints(cls), [], _tables(cls)
    metavars, decls, help_extra = metavars or {}, decls or {}, help_extra or {}
    for f in dataclasses.fields(cls):
        if f.name in tables and f.name not in exclude:
            out += field_options(tables[f.name], exclude, metavars, decls, help_extra)
            continue
        found = None if f.name in exclude else _option_type(hints[f.name])
        if found is None:
            continue
        tp, metavar = found
        kwargs = {"help": help_for(cls, f.name) + help_extra.get(f.name, "")}
        if metavars.get(f.name, metavar):
            kwargs["metavar"] = metavars.get(f.name, metavar)
        default = None if f.default is dataclasses.MISSING else f.default
        option = typer.Option(*decls.get(f.name, ()), **kwargs)
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[tp, option]))  # fmt: skip
    return out


def _build(cls: type, values: dict):
    """`cls` from option values (a table field built from its own options first)."""
    for name, table in _tables(cls).items():
        own = {f.name for f in dataclasses.fields(table)}
        values[name] = _build(table, {k: values.pop(k) for k in list(values) if k in own})
    values = {k: v for k, v in values.items() if v is not None or not _has_factory(cls, k)}
    return build_config(cls, **values)


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
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must see the new signature, not fn's
        return command

    return wrap


@functools.cache
def _factories(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING)


def _has_factory(cls: type, name: str) -> bool:
    """Fields whose default comes from a factory (lists): an option left out keeps that default."""
    return name in _factories(cls)
