"""`serve` options of chat output: --tool-call-parser, --reasoning-parser, --chat-template (a file, or the name of a
template shipped with batchserve: chatml_tools)."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.serving.reasoning import REASONING_PARSERS
from batchserve.serving.tool_parsers import PARSERS
from batchserve.serving.tools import SHIPPED_TEMPLATES, shipped_template


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="how tool calls are read from the output (default: from the chat template)")  # fmt: skip
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split <think> reasoning into reasoning_content (default: none)")  # fmt: skip
    parser.add_argument("--chat-template", default=None,
                        help=f"a Jinja chat template file, or a shipped one: {', '.join(SHIPPED_TEMPLATES)} "
                        "(default: the model's; with tools, chatml_tools for ChatML models without tools)")  # fmt: skip


def apply_chat_options(front: OpenAIFrontEnd, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    front.tool_call_parser, front.reasoning_parser = args.tool_call_parser, args.reasoning_parser
    if args.chat_template is None:
        return
    if args.chat_template in SHIPPED_TEMPLATES:
        front.chat_template = shipped_template(args.chat_template)
        return
    path = Path(args.chat_template)
    if not path.is_file():
        parser.error(f"--chat-template: no such file or shipped template: {args.chat_template}")
    front.chat_template = path.read_text()
