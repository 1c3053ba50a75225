"""What the subcommand modules share: the one-line-error parser, the full parser, and the train job's checks.

A leaf below ``shardtune.cli`` (``__init__`` dispatches to the subcommands, which import this, never ``__init__``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune import __version__
from shardtune.config.schema import LAUNCHER_SET
from shardtune.errors import UsageError, closest

if TYPE_CHECKING:
    from collections.abc import Callable

    from shardtune.config import TrainConfig

# What asks ``shardtune train`` (and ``launch ... train``) for its list of keys instead of a run.
TRAIN_HELP = ("-h", "--help", "--help-keys", "--help_keys")
# "owned": this process runs one subcommand and ends (the `shardtune` command, torchrun's ranks), rather than being
# another program calling cli.main(); only then may a subcommand leave out a library its job does not use.
PROCESS = {"owned": False}


def leave_out_bitsandbytes_unless(needed: Callable[[], bool]) -> None:
    """In a process the ``shardtune`` command owns, mark bitsandbytes as not installed unless ``needed()`` says the
    work uses it (shardtune/bitsandbytes_use.py); call it before PEFT is imported."""
    if PROCESS["owned"]:
        from shardtune.bitsandbytes_use import leave_out_unless

        leave_out_unless(needed)


def say_base_unquantised(adapter: str | Path, what: str) -> None:
    """Where ``adapter`` was trained by QLoRA (on a 4-bit base): a note on stderr that ``what`` (merge, generate,
    chat) uses its base unquantised, so that nobody takes the result for the 4-bit model the run trained."""
    from shardtune.train.layout import trained_base_quantization

    if quantization := trained_base_quantization(adapter):
        print(f"note: {adapter} was trained on a 4-bit ({quantization}) base (QLoRA); {what}, the weights the 4-bit "
              f"ones were quantised from, so its outputs differ slightly from those of the model the run trained",
              file=sys.stderr)


def plain(text: str) -> str:
    """A docstring's markup as a terminal should show it: ``name`` as 'name'."""
    return text.replace("``", "'")


AMBIGUOUS = "ambiguous option: "  # how argparse begins its message for a prefix of several options


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line (exit 2) instead of the usage block plus the error.

    A subcommand's parser reports an unknown option itself, naming the subcommand and the option meant, and
    before a missing required argument (``--promt hi`` leaves --prompt missing, but the typo is the news).
    """

    _argv: list[str] = []
    # Where an unknown option is known elsewhere: the rest of the message saying where it goes (None: a spelling
    # hint). ``shardtune launch`` says that a training key goes after 'train'.
    placed_elsewhere: Callable[[str], str | None] | None = None

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(self._argv, namespace)
        if extras and self._subparsers is None:  # the last parser on the line: nobody else will take them
            self.error(self._unrecognized(extras))
        return namespace, extras

    def format_help(self) -> str:
        return plain(super().format_help())  # descriptions are the commands' docstrings

    def error(self, message: str) -> None:  # type: ignore[override]
        ambiguous = message.startswith(AMBIGUOUS) and message[len(AMBIGUOUS):].split(" ", 1)[0].split("=", 1)[0]
        if ambiguous and self.placed_elsewhere is not None and (where := self.placed_elsewhere(ambiguous[2:])):
            message = f"unknown option {ambiguous}; {where}"  # Accelerate's --cpu, a prefix of --cpus_per_task
        elif message.startswith(("the following arguments are required", "one of the arguments")):
            extras = self._extras_if_nothing_required()
            if any(_is_option(a) for a in extras):
                message = self._unrecognized(extras)
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _extras_if_nothing_required(self) -> list[str]:
        """What the last line leaves over when parsed with no argument required."""
        # a required group of options (generate's --prompt or --prompt_file) as well as required arguments
        required = [*(action for action in self._actions if action.required),
                    *(group for group in self._mutually_exclusive_groups if group.required)]
        for action in required:
            action.required = False
        try:
            return super().parse_known_args(self._argv, None)[1]
        finally:
            for action in required:
                action.required = True

    def _unrecognized(self, extras: list[str]) -> str:
        option = next((a for a in extras if _is_option(a)), None)
        if option is None:
            return f"unrecognized arguments: {' '.join(extras)}"
        name = option.split("=", 1)[0]
        if self.placed_elsewhere is not None and (where := self.placed_elsewhere(name.lstrip("-"))):
            return f"unknown option {name}; {where}"
        # Without the dashes every option shares, and stricter than for values: short names look alike by chance.
        known = {s.lstrip("-"): s for action in self._actions for s in action.option_strings if s.startswith("--")}
        hint = closest(name.lstrip("-"), known, cutoff=0.6)
        return f"unknown option {name}" + (f"; did you mean {known[hint]}?" if hint else "")


def _is_option(arg: str) -> bool:
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)  # a negative number is a value
    except ValueError:
        return True
    return False


SUBCOMMANDS = ("estimate", "train", "launch", "data", "generate", "plot", "demo", "export", "bench", "config")


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


def action_parsers(sub: argparse._SubParsersAction, name: str, help: str,  # noqa: A002
                   description: str) -> argparse._SubParsersAction:
    """The actions of a subcommand made of actions (``data inspect``, ``config schema``); the subcommand without
    one prints its help and exits 2."""
    p = sub.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION", parser_class=type(p))


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside: SIGTERM (a scheduler's stop, ``kill``) raises ``Terminated`` in the main thread, so the ``finally``
    and ``except BaseException`` blocks on the way out run (a write's temporary files are removed) before the
    command reports it. A second SIGTERM during that clean-up is ignored: it would cut the clean-up short. One whose
    ``Terminated`` a finalizer swallowed is delivered again."""
    import os
    import threading

    from shardtune.errors import Terminated

    def terminate(signum, frame) -> None:  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    def swallowed(unraisable) -> None:
        # A handler that ran inside a finalizer (__del__, a weakref callback) raised there, and Python only prints
        # that: SIGTERM is armed again (where this one had set it aside; the training loop's stays) and sent
        # again, from a thread, so it lands once this hook has returned.
        if not isinstance(unraisable.exc_value, Terminated):
            return hook(unraisable)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
            signal.signal(signal.SIGTERM, terminate)
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM)).start()

    previous, hook = signal.signal(signal.SIGTERM, terminate), sys.unraisablehook
    sys.unraisablehook = swallowed
    try:
        yield
    finally:
        sys.unraisablehook = hook
        signal.signal(signal.SIGTERM, previous)


def check_output_path(path: str | Path, what: str, *, folder: bool) -> None:
    """An output path (a ``folder`` to make, or a file to write), refused before any work when it cannot be made:
    a symlink to nothing (or a loop of symlinks) in its place, a file where the folder goes (or a folder where the
    file goes), or a file where one of its parent folders goes. ``what`` names the option, as the user gave it."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise UsageError(f"{what} {path}: a symlink that leads nowhere (or a loop of symlinks) is in its place; "
                         f"remove it or give another path")
    if path.exists() and path.is_dir() != folder:
        raise UsageError(f"{what} {path}: a {'file' if folder else 'folder'} is there, where the "
                         f"{'folder' if folder else 'file'} goes; give another path")
    for parent in path.parents:
        if parent.is_symlink() and not parent.exists():
            raise UsageError(f"{what} {path}: {parent} is a symlink that leads nowhere (or a loop of symlinks); "
                             f"fix it or give another path")
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{what} {path}: {parent} is a file, not a folder; give another path")
            return


def check_output_file(path: str | Path, what: str) -> None:
    """A file a command writes where its user said (``check_output_path``), refused also when a file shardtune did
    not write is there: a user's file is never replaced, an earlier output of shardtune's is."""
    from shardtune.files import foreign_file

    check_output_path(path, what, folder=False)
    if (problem := foreign_file(path, what)) and not _resolved_recipe(Path(path)):
        raise UsageError(problem)


def _resolved_recipe(path: Path) -> bool:
    """A recipe shardtune wrote before it marked its files: every key of a resolved config, and nothing else (a
    person writes the keys they change), and no mark (a marked recipe whose mark no longer holds was edited: its
    user's)."""
    if path.suffix.lower() not in (".yaml", ".yml") or not path.is_file() or path.stat().st_size > 1 << 20:
        return False
    import yaml

    from shardtune.config.schema import TrainConfig
    from shardtune.files import DIGEST_MARK, WRITTEN_BY

    try:
        text = path.read_text(encoding="utf-8")
        values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    marked = WRITTEN_BY in text.lower() or DIGEST_MARK in text
    return not marked and isinstance(values, dict) and set(values) == set(TrainConfig().to_flat())


# What ``shardtune launch`` passes on to train itself, ahead of the user's train arguments: a different value for
# one of them after 'train' would configure the job for processes the launcher does not start.
LAUNCHER_KEYS = {key: f" (under 'shardtune launch', write --{key} before 'train': the launcher's value decides "
                      f"what starts)" for key in (*LAUNCHER_SET, "config_file")}


def load_job_config(argv: list[str], notes: list[str] | None = None) -> TrainConfig:
    """The config a ``train`` job is about to run, checked before any model loads: a key the command line gives
    two values, ``load_run_config``'s checks and the resume_from_checkpoint folder (train/layout.py), every
    problem reported together. A dry run reads neither data nor checkpoint, so neither is checked for it.
    ``notes``: the keys set back to their defaults (``run_config_problems``)."""
    from shardtune.config import raise_problems, run_config_problems
    from shardtune.config.loading import repeated_cli_keys
    from shardtune.train.layout import resume_problem

    repeated = repeated_cli_keys(argv, LAUNCHER_KEYS)
    cfg, given, problems = run_config_problems(argv, notes)
    spec = cfg.checkpoint.resume_from_checkpoint
    where = given.get("resume_from_checkpoint", "config")
    if not cfg.run.dry_run and (problem := resume_problem(spec, f"{where}: resume_from_checkpoint={spec}")):
        problems.append(problem)
    raise_problems(repeated + problems)
    return cfg


def print_config_notes(notes: list[str], argv: list[str]) -> None:
    """Rank 0: what a DeepSpeed config became (config/deepspeed.py), one line per key, before anything runs; and
    ``notes``, the keys a later setting turned off (set back to their defaults). On stderr, so that a command's
    JSON stays one document."""
    import os

    from shardtune.config.loading import deepspeed_mappings

    if os.environ.get("RANK", "0") != "0":
        return
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for source, lines in deepspeed_mappings(argv):
        print(f"DeepSpeed config {source}, as shardtune runs it:", file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)
