"""Derive command-line flags and SPLITSERVE_* environment variables from a config dataclass.

Each field becomes `--field-name` (underscores to dashes) whose default comes from
`SPLITSERVE_FIELD_NAME` when set, else the dataclass default. Field metadata may carry
`help`, `choices`, `flag` (an explicit flag name), `cli` (False: no flag) and `group` (the
heading `--help` lists the flag under; common/config_groups.py sets it for a whole group). A
config class may replace a field's help for its role in a `FIELD_HELP` dict (name -> text).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

ENV_PREFIX = "SPLITSERVE_"


def _base_type(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _convert(raw: str, tp: Any) -> Any:
    if tp is bool:
        return _parse_bool(raw)
    if tp in (int, float, str):
        return tp(raw)
    return raw


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def env_name(field: dataclasses.Field) -> str:
    return ENV_PREFIX + field.name.upper()


def field_heading(field: dataclasses.Field, default: str) -> str:
    """The `--help` heading a field's flag is listed under."""
    return field.metadata.get("group", default)


def _declaration_order(cls: type) -> list[dataclasses.Field]:
    """The fields in the order their classes are named (a config's bases left to right, each
    group's fields as declared), not dataclasses' (the last base's first)."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    ordered: dict[str, dataclasses.Field] = {}
    for klass in cls.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            if name in by_name and name not in ordered:
                ordered[name] = by_name[name]
    for name, f in by_name.items():
        ordered.setdefault(name, f)
    return list(ordered.values())


def _argument_group(parser: argparse.ArgumentParser, title: str):
    for group in parser._action_groups:  # one section per heading, whichever config adds to it
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: tuple[str, ...] = (),
    heading: str | None = None,
) -> None:
    """A flag per field of `cls`, listed under its group's heading (fields without one: under
    `heading`, default the class's name)."""
    hints = typing.get_type_hints(cls)
    overrides: dict[str, str] = getattr(cls, "FIELD_HELP", {})
    for field in _declaration_order(cls):
        if field.name in skip or field.metadata.get("cli") is False:
            continue
        group = _argument_group(parser, field_heading(field, heading or cls.__name__))
        tp = _base_type(hints[field.name])
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        else:
            default = None
        env = env_name(field)
        if env in os.environ:
            try:
                default = _convert(os.environ[env], tp)
            except ValueError as exc:
                raise SystemExit(f"environment variable {env}: {exc}") from exc
        help_text = overrides.get(field.name, field.metadata.get("help", ""))
        help_text = f"{help_text} [env {env}; default {default!r}]".strip()
        kwargs: dict[str, Any] = {"dest": field.name, "default": default, "help": help_text}
        if "choices" in field.metadata:
            kwargs["choices"] = field.metadata["choices"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
        group.add_argument(flag_name(field), **kwargs)


def dataclass_from_args(cls: type, namespace: argparse.Namespace, **overrides: Any) -> Any:
    values = {}
    for field in dataclasses.fields(cls):
        if hasattr(namespace, field.name):
            values[field.name] = getattr(namespace, field.name)
    values.update(overrides)
    return cls(**values)


def to_argv(config: Any, cls: type | None = None) -> list[str]:
    """The flags that recreate `config` (for starting child processes)."""
    argv: list[str] = []
    for field in dataclasses.fields(cls or type(config)):
        if field.metadata.get("cli") is False:
            continue
        value = getattr(config, field.name)
        if value is None:
            continue
        name = flag_name(field)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv
