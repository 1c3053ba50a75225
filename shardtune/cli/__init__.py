"""The ``shardtune`` command: one module per subcommand, each a parser factory plus a function that does the work."""

from __future__ import annotations

import argparse
import sys

from shardtune import __version__
from shardtune.errors import UsageError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line (exit 2) instead of the usage block plus the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from shardtune.cli import demo, estimate

    parser = OneLineParser(prog="shardtune", description="Fine-tune open LLMs, and know before you rent GPUs "
                                                         "whether it fits.")
    parser.add_argument("--version", action="version", version=f"shardtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module in (estimate, demo):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"shardtune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
