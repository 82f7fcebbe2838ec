"""Derive command-line flags and SPLITSERVE_* environment variables from a config dataclass.

Each field becomes `--field-name` (underscores to dashes) whose default comes from
`SPLITSERVE_FIELD_NAME` when set, else the dataclass default. Field metadata may carry
`help`, `choices` and `flag` (an explicit flag name).
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


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip or field.metadata.get("cli") is False:
            continue
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
        help_text = field.metadata.get("help", "")
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
