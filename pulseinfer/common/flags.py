"""CLI flags derived from frozen config dataclasses: one field, one `--flag`."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

# Flags that took a secret on the command line, which every local user can read (`ps`), by the
# field that replaced them: refused with a message that does not echo the value (argparse would
# otherwise take `--api-key K` as an abbreviation of `--api-key-file K`).
REMOVED_SECRET_FLAGS = {"api_key_file": ("--api-key", "put the key in a file (--api-key-file PATH) or in $PULSEINFER_API_KEY")}


class _RefuseSecretFlag(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, instead: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not accepted: a command line is visible to every local user; {self.instead}")


def _plain_type(hint: Any) -> type:
    """int | None -> int; bool/int/float/str pass through."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Adds a flag per field of cls (recursing into nested config dataclasses)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            add_flags(parser, hint, skip)
            continue
        if field.name in skip:
            continue
        kind = _plain_type(hint)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if kind is bool:
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(_flag(field.name), type=kind, default=default, help=f"(default: {default})")
        if field.name in REMOVED_SECRET_FLAGS:
            removed, instead = REMOVED_SECRET_FLAGS[field.name]
            parser.add_argument(removed, action=_RefuseSecretFlag, instead=instead, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def parse_config(cls: type[T], prog: str, description: str, argv: list[str] | None = None) -> T:
    """A service's whole command line: one flag per config field."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cls)
    return from_flags(cls, parser.parse_args(argv))


def from_flags(cls: type[T], args: argparse.Namespace) -> T:
    """Builds cls (and its nested configs) from parsed flags; fields without a flag keep defaults."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            values[field.name] = from_flags(hint, args)
        elif hasattr(args, field.name):
            values[field.name] = getattr(args, field.name)
    return cls(**values)


def to_flags(config: object) -> list[str]:
    """The inverse of from_flags: argv that rebuilds config (nested configs flattened), for child processes."""
    argv = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            argv += to_flags(value)
        elif isinstance(value, bool):
            argv.append(_flag(field.name) if value else "--no-" + field.name.replace("_", "-"))
        elif value is not None:
            argv += [_flag(field.name), str(value)]
    return argv
