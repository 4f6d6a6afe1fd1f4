"""`batchserve` command line: generate | serve | bench | tune.

Each command's module is imported only when it runs, so `batchserve --help` and a flag the command does not take
answer without loading torch.
"""

from __future__ import annotations

import difflib
import logging
import sys

from batchserve import __version__
from batchserve.config import ConfigError

USAGE = """batchserve <command> [options]

commands:
  generate   generate text for prompts given on the command line (default model: SmolLM2-135M-Instruct)
  serve      start the OpenAI-compatible HTTP server (--replicas N: N engines on Ray Serve)
  bench      measure throughput and latency (offline or against any OpenAI-compatible server)
  tune       sweep scheduler settings against an SLO and print the best configuration (--simulate: in seconds)
  profile    time engine steps on this machine and save a step-time profile for simulate
  simulate   bench's workloads on the real scheduler in virtual time, step times from a profile: no model runs
  doctor     watch a running server (--url) or read a bench trace: what is wrong, what to change, the predicted effect

batchserve --version prints the installed version; `batchserve <command> --help` lists a command's options.
"""
COMMANDS = ("generate", "serve", "bench", "tune", "profile", "simulate", "doctor")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"batchserve {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS and (refusal := flags_refused(command, rest)):
        print(refusal, file=sys.stderr, end="")
        return 2
    if command == "generate":
        from batchserve.entrypoints.generate import main as command_main
    elif command == "serve":
        from batchserve.entrypoints.openai.launch import main as command_main
        from batchserve.entrypoints.openai.launch import wants_scale_out

        if wants_scale_out(rest):
            from batchserve.distributed.launch import main as command_main
    elif command == "bench":
        from batchserve.bench.cli import main as command_main
    elif command == "tune" and "--simulate" in rest:  # the search on the simulator: seconds, no model loaded
        from batchserve.simulator.tune_sim import main as command_main
    elif command == "tune":  # the search measured on the real engine
        from batchserve.bench.tune import main as command_main
    elif command == "profile":
        from batchserve.simulator.profiler import main as command_main
    elif command == "simulate":
        from batchserve.simulator.cli import main as command_main
    elif command == "doctor":
        from batchserve.doctor.cli import main as command_main
    else:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command_main(rest) or 0
    except ConfigError as exc:  # a model not found, options that cannot work: one message, not a traceback
        print(f"batchserve {command}: error: {exc}", file=sys.stderr)
        return 2


def flags_refused(command: str, argv: list[str]) -> str | None:
    """The error for flags `command` does not take (foreign ones answered with what to use), found before the
    command's module is imported: its imports (torch, FastAPI) take seconds, a mistyped flag must answer at once."""
    from batchserve.entrypoints.cli_flags import COMMAND_FLAGS
    from batchserve.entrypoints.foreign_flags import flag_error, screen_flags

    if "-h" in argv or "--help" in argv:
        return None
    screen = screen_flags(argv, COMMAND_FLAGS[command])
    return flag_error(f"batchserve {command}", screen.problems) if screen.problems else None


if __name__ == "__main__":
    sys.exit(main())
