"""The ``shardtune`` command: one module per subcommand, each a parser factory plus a function that does the work."""

from __future__ import annotations

import argparse
import os
import sys

from shardtune import __version__
from shardtune.errors import UsageError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line (exit 2) instead of the usage block plus the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


SUBCOMMANDS = ("estimate", "train", "launch", "data", "generate", "plot", "demo", "export", "bench")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one (some subcommand modules import torch: ~3 s)."""
    import importlib

    parser = OneLineParser(prog="shardtune", description="Fine-tune open LLMs, and know before you rent GPUs "
                                                         "whether it fits.")
    parser.add_argument("--version", action="version", version=f"shardtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in SUBCOMMANDS if only is None else (only,):
        importlib.import_module(f"shardtune.cli.{name}").register(sub)
    return parser


# Subcommands that take free-form --key value pairs (training keys), parsed by their own code, not argparse.
PASSTHROUGH = ("train", "launch")


def _passthrough(command: str, argv: list[str]) -> int:
    from shardtune.cli import data, launch, train

    try:
        return {"train": train.run, "launch": launch.run, "data inspect": data.run_inspect}[command](argv)
    except UsageError as exc:
        # Every rank of a launched job checks the same config: one copy of the message is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"shardtune {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH:
        return _passthrough(argv[0], argv[1:])
    if argv[:2] == ["data", "inspect"]:  # reads training arguments too
        return _passthrough("data inspect", argv[2:])
    # `estimate` promises an instant answer, so it is parsed without importing the other subcommands.
    parser = build_parser("estimate" if argv and argv[0] == "estimate" else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"shardtune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a write that failed (full disk, no permission, a file where a folder goes)
        print(f"shardtune {args.command}: error: {exc}; free disk space, fix the permissions or give another path",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
