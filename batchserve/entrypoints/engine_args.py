"""Every engine option as a command-line flag (help, choices and defaults from the one schema, engine_options.py),
plus --config file.json; shared by all subcommands. vLLM's and TensorRT-LLM's names are flags too
(--max-num-seqs is --max-batch-size); the flags of theirs we lack are answered with what to use instead, and a
mistyped flag gets one of ours of the same meaning as a suggestion."""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Callable
from typing import Any

from batchserve.config import EngineConfig
from batchserve.entrypoints.engine_options import (
    SPECS,
    OptionSpec,
    canonical_value,
    engine_config,
    read_config_file,
    validate_options,
)
from batchserve.entrypoints.foreign_flags import flag_error, screen_flags


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless it says it already or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in --help, vLLM's and llama.cpp's flags answered with what to use instead
    (foreign_flags.py), and "did you mean" for an unrecognized flag among our names of the same meaning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Foreign flags first: refused with the table's answer, or dropped where they ask for what we do anyway
        (--data-parallel-size 1)."""
        argv = list(sys.argv[1:] if args is None else args)
        screen = screen_flags(argv, self._option_string_actions, report_unknown=False)
        if screen.problems:
            self.exit(2, flag_error(self.prog, screen.problems))
        return super().parse_known_args(screen.argv, namespace)

    def error(self, message: str) -> Any:
        """The message and where to read more, without argparse's usage line (which lists every flag: ~40 lines)."""
        if message.startswith("unrecognized arguments:"):
            words = message.removeprefix("unrecognized arguments:").split()
            screen = screen_flags(words, self._option_string_actions)
            strays = [f"{word}: unexpected argument" for word in screen.argv]
            self.exit(2, flag_error(self.prog, screen.problems + strays))
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every option)\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(spec: OptionSpec) -> str:
    if spec.default is None or "(default:" in spec.help:
        return spec.help.replace("%", "%%")
    default = spec.default.value if isinstance(spec.default, enum.Enum) else spec.default
    return f"{spec.help} (default: {default})".replace("%", "%%")


def add_engine_arguments(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    group = parser.add_argument_group("engine options (also keys of --config; TensorRT-LLM and vLLM names accepted)")
    group.add_argument(
        "--config", "--extra-llm-api-options", "--extra_llm_api_options",
        help="JSON or YAML file of engine options, checked like the flags (a TensorRT-LLM LLM-API file's "
        "kv_cache_config / scheduler_config sections too); flags override it",
    )  # fmt: skip
    for spec in SPECS:
        if spec.name == "model" and not include_model:
            _add_model_flag_beside_positional(group, parser)
            continue
        flags = [_flag(spec.name), *(_flag(alias) for alias in spec.aliases)]
        common = {"dest": spec.name, "default": None, "help": _help(spec)}
        if spec.kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        elif spec.choices is not None:
            group.add_argument(*flags, type=_value_of(spec.name), choices=spec.choices, **common)
        elif spec.kind is dict:
            group.add_argument(*flags, type=_json_object, metavar="JSON", **common)
        else:
            group.add_argument(*flags, type=spec.kind, metavar=spec.kind.__name__.upper(), **common)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _value_of(name: str) -> Callable[[str], Any]:
    """A flag's value as ours: any case, and the other spellings the schema accepts (half, STATIC_BATCH)."""

    def convert(text: str) -> Any:
        value = canonical_value(name, text)
        return value.lower() if isinstance(value, str) else value

    convert.__name__ = name  # argparse names the type in its "invalid value" message
    return convert


def _add_model_flag_beside_positional(group: argparse._ArgumentGroup, parser: argparse.ArgumentParser) -> None:
    """`--model X` as vLLM takes it, where the command's model is a positional argument (`serve MODEL`): both fill
    args.model. The positional's default is suppressed, or its empty match would overwrite --model's value."""
    positional = next((a for a in parser._actions if a.dest == "model" and not a.option_strings), None)
    if positional is None or "--model" in parser._option_string_actions:
        return
    positional.default = argparse.SUPPRESS
    group.add_argument("--model", dest="model", default=None, help="the model, as the positional argument gives it")


def engine_options_from_args(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The engine options of --config, overridden by flags given on the command line (and `extra` options not
    None), checked by type; options given nowhere are left out (they keep their defaults)."""
    given = {spec.name: getattr(args, spec.name) for spec in SPECS if getattr(args, spec.name, None) is not None}
    given.update({name: value for name, value in extra.items() if value is not None})
    config_file = getattr(args, "config", None)
    merged = read_config_file(config_file) if config_file else {}
    merged.update(validate_options(given, "the command line"))
    return merged


def engine_config_from_args(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """Flags given on the command line (and `extra` options not None) override those of --config; options given
    nowhere keep their defaults."""
    return engine_config(engine_options_from_args(args, **extra))
