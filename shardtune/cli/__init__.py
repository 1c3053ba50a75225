"""The ``shardtune`` command: one module per subcommand, each a parser factory plus a function that does the work."""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings

from shardtune.cli.common import PROCESS, build_parser
from shardtune.errors import EXIT_FAILED, Terminated, UsageError


class _DropMessage(logging.Filter):
    """Drops a logger's records whose message starts with ``prefix``; the logger's other records pass."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# bitsandbytes (imported by PEFT) on CPUs with AVX512-BF16: an optional kernel package is missing; the built-in
# fallback is used and nothing is wrong.
_BNB_KERNELS = _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community")


def quiet_library_noise() -> None:
    """Silence three library messages that every normal run prints and that call for no action, and nothing else:
    the bitsandbytes note above; transformers' FutureWarning about ``is_gradient_checkpointing``, which PEFT (not
    shardtune) reads; and torch's UserWarning that distributed checkpointing runs on one process, which is the
    intent of every single-process save and load."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BNB_KERNELS)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module="transformers")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)


# Subcommands that take free-form --key value pairs (training keys), parsed by their own code, not argparse.
PASSTHROUGH = ("train", "launch")


def _passthrough(command: str, argv: list[str]) -> int:
    from shardtune.cli import data, launch, train

    try:
        return {"train": train.run, "launch": launch.run, "data inspect": data.run_inspect}[command](argv)
    except UsageError as exc:
        # Every rank of a launched job checks the same config: one copy of the message on each machine is enough
        # (each machine's launcher says its ranks stopped, and points above). A launcher is no rank, nor is a
        # process whose RANK (left in the shell) belongs to no job: they say theirs.
        if command != "train" or os.environ.get("LOCAL_RANK", "0") == "0" or _no_job_around():
            print(f"shardtune {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:  # SIGTERM before the first step (shardtune train)
        from shardtune.cli.launch import report_stop

        report_stop(None, f"shardtune {command}: stopped by SIGTERM during start-up: no checkpoint was saved for it")
        return EXIT_FAILED
    except KeyboardInterrupt:
        if command == "train" and "RANK" not in os.environ:  # under launch, the launcher says it once
            from shardtune.cli.launch import RESUME_HINT

            print(f"shardtune train: interrupted; no checkpoint was saved for it: {RESUME_HINT}", file=sys.stderr)
        return 130


def _no_job_around() -> bool:
    from shardtune.dist import launch_environment_problem

    return launch_environment_problem() is not None


def reader_left() -> int:
    """The reader of stdout went away (``shardtune generate ... | head``): stop without a word, as Unix tools and
    rich's console do, with stdout pointed at /dev/null so the interpreter's last flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a file descriptor (a test's capture): nothing to flush there
        pass
    return 1


def command() -> int:
    """The ``shardtune`` executable and ``python -m shardtune``: this process runs one subcommand and ends."""
    PROCESS["owned"] = True
    code = main()
    # The interpreter's last collections, as it clears its modules, walk every object torch and transformers made:
    # about 1 s of every command's exit, every rank's too. Frozen, they are left to the OS; everything a command
    # writes is closed by then, and atexit handlers (logging, trackers) still run.
    gc.freeze()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_library_noise()  # before any subcommand imports them (torchrun's ranks come through here too)
    if argv and argv[0] in PASSTHROUGH:
        return _passthrough(argv[0], argv[1:])
    if argv[:2] == ["data", "inspect"]:  # reads training arguments too
        return _passthrough("data inspect", argv[2:])
    # `estimate` promises an instant answer, so it is parsed without importing the other subcommands.
    parser = build_parser("estimate" if argv and argv[0] == "estimate" else None)
    args = parser.parse_args(argv)
    args.argv = argv  # what was typed, for a command that must know which options were given at all
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"shardtune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return reader_left()
    except OSError as exc:  # a write that failed (full disk, no permission, a file where a folder goes)
        from shardtune.errors import os_error_fix

        print(f"shardtune {args.command}: error: {exc}; {os_error_fix(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(command())
