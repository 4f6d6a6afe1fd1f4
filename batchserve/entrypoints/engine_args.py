"""Every EngineConfig option as a command-line flag, plus --config file.json; shared by all subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig

_SKIP = {"scheduler", "cache"}


def _flag_type(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation


def add_engine_arguments(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    group = parser.add_argument_group("engine options (also settable in --config)")
    group.add_argument("--config", help="JSON file of engine options (TensorRT-LLM names accepted); flags override it")
    for cls in (EngineConfig, SchedulerConfig, CacheConfig):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _SKIP or (f.name == "model" and not include_model):
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _flag_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
            elif isinstance(kind, type) and issubclass(kind, enum.StrEnum):
                choices = [member.value for member in kind]
                group.add_argument(flag, dest=f.name, type=str.lower, choices=choices, default=None,
                                   help=f"default: {f.default}")  # fmt: skip
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=None)


def engine_config_from_args(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """Options given on the command line override those of --config; unset flags keep the defaults."""
    names = {f.name for cls in (EngineConfig, SchedulerConfig, CacheConfig) for f in dataclasses.fields(cls)} - _SKIP
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    given.update(extra)
    if getattr(args, "config", None):
        return EngineConfig.from_json_file(args.config, **given)
    return EngineConfig.from_options(**given)
