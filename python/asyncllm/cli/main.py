"""The `asyncllm` command: `serve`, `generate` and `bench`, one module each
(`add_parser` and `run`); the flags they share live in `cli/args.py`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from asyncllm.cli import bench, generate, serve
from asyncllm.errors import AsyncLLMError

# Subcommand -> its module. The modules import the engine and the server lazily,
# so `asyncllm --help` stays cheap.
COMMANDS: dict[str, ModuleType] = {"serve": serve, "generate": generate, "bench": bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv), run the subcommand, return its exit status."""
    parser = argparse.ArgumentParser(prog="asyncllm", description="serve, generate and bench")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(ns, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[ns.command].run(ns)
    except AsyncLLMError as exc:
        print(f"asyncllm: error: {exc}", file=sys.stderr)
        return 2
