"""Run the README's shell commands in order, as a newcomer would on a fresh clone, and fail on any traceback.

    python benchmarks/newcomer.py --venv bench_results/newcomer-venv        # a fresh venv there, then every command
    python benchmarks/newcomer.py --venv .venv --reuse-venv --list   # only print the commands it would run

Commands come from the README's ```bash blocks (a line ending in a backslash continues; a `#` comment is dropped).
`batchserve serve ...` starts in the background: the script waits for its /health, runs the commands after it (curl,
`bench --base-url`), and stops it (SIGTERM) before the next server or at the end. Commands that take far longer than
a first look (`make test`, peer and throughput benchmarks) are skipped unless --skip '' says otherwise. A command
fails when it exits non-zero or prints "Traceback (most recent call last)"; the script prints one line per command
and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACEBACK = "Traceback (most recent call last)"
DEFAULT_SKIP = r"^make (test|bench)\b|peer_compare|engine_throughput|--replicas|tune --workload|/path/to/"


@dataclass
class Command:
    text: str
    server: bool  # `batchserve serve`: runs in the background until the next server or the end

    @property
    def port(self) -> int:
        match = re.search(r"--port[ =](\d+)", self.text)
        return int(match.group(1)) if match else 8000


def extract_commands(readme: str) -> list[Command]:
    """The shell commands of every ```bash block, continuation lines joined, comments and blank lines dropped."""
    commands, in_block, pending = [], False, ""
    for line in readme.splitlines():
        if line.strip().startswith("```"):
            in_block = line.strip() == "```bash" if not in_block else False
            pending = ""
            continue
        if not in_block:
            continue
        text = pending + _without_comment(line).strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        if text:
            commands.append(Command(text, is_server(text)))
    return commands


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a comment (outside quotes, after whitespace)."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote == char else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def is_server(text: str) -> bool:
    words = shlex.split(text)
    return len(words) >= 2 and words[0].endswith("batchserve") and words[1] == "serve" and "--help" not in words


def failed(returncode: int | None, output: str) -> str | None:
    """Why a command failed, or None."""
    if TRACEBACK in output:
        return "printed a traceback"
    if returncode not in (0, None):
        return f"exited {returncode}"
    return None


def prepare_venv(venv: Path, reuse: bool) -> dict[str, str]:
    """The environment the commands run in: the venv's bin first on PATH (created and installed unless reused)."""
    if not reuse:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e", f"{ROOT}[bench]"], check=True)
    return os.environ | {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            time.sleep(1)
    return False


def start(text: str, env: dict[str, str]) -> subprocess.Popen:
    """The command in a session of its own, so that stopping it stops everything it started (make's children)."""
    return subprocess.Popen(text, shell=True, env=env, cwd=ROOT, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def stop(process: subprocess.Popen) -> str:
    """SIGTERM to the command's whole process group (a server drains), SIGKILL a minute later; its output."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return process.communicate(timeout=wait_s)[0]
        except subprocess.TimeoutExpired:
            continue
    return ""


def run_one(text: str, env: dict[str, str], timeout_s: float) -> tuple[str, str | None]:
    """(output, why it failed or None)."""
    process = start(text, env)
    try:
        output = process.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        return stop(process), f"ran past {timeout_s:.0f} s"
    return output, failed(process.returncode, output)


def run_all(commands: list[Command], env: dict[str, str], timeout_s: float, log_dir: Path) -> list[str]:
    """Every command in order; returns one line per command ("ok" or why it failed)."""
    results, server, server_cmd = [], None, None
    log_dir.mkdir(parents=True, exist_ok=True)

    def end_server() -> None:
        if server is not None:
            output = stop(server)
            (log_dir / f"{len(results):02d}-server.log").write_text(output)
            results.append(_line(server_cmd.text, failed(0, output)))  # a drained server may exit 1: not a failure

    for command in commands:
        if command.server:
            end_server()
            server_cmd = command
            server = start(command.text, env)
            if not wait_healthy(command.port, server, timeout_s):
                results.append(_line(command.text, f"not healthy within {timeout_s:.0f} s: {stop(server)[-2000:]}"))
                server = None
            continue
        output, reason = run_one(command.text, env, timeout_s)
        (log_dir / f"{len(results):02d}.log").write_text(f"$ {command.text}\n{output}")
        results.append(_line(command.text, reason))
    end_server()
    return results


def _line(text: str, reason: str | None) -> str:
    return f"{'ok  ' if reason is None else 'FAIL'} {text}" + ("" if reason is None else f"\n     {reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("bench_results/newcomer-venv"), help="the venv to use")
    parser.add_argument("--reuse-venv", action="store_true", help="use --venv as it is (no fresh install)")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--skip", default=DEFAULT_SKIP, help="regex of commands not to run ('' runs all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a command may take")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench_results" / "newcomer")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    commands = extract_commands(args.readme.read_text())
    skipped = [c for c in commands if args.skip and re.search(args.skip, c.text)]
    commands = [c for c in commands if c not in skipped]
    for c in skipped:
        print(f"skip {c.text}")
    if args.list:
        for c in commands:
            print(f"{'serve' if c.server else 'run  '} {c.text}")
        return 0
    results = run_all(commands, prepare_venv(args.venv, args.reuse_venv), args.timeout, args.log_dir)
    print("\n".join(results))
    return 1 if any(line.startswith("FAIL") for line in results) else 0


if __name__ == "__main__":
    sys.exit(main())
