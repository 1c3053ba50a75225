"""``shardtune data inspect``: what the model will learn from a data set, before any training.

Reads the same arguments as ``shardtune train`` (a YAML or JSON recipe, ``key=value``, ``--key value``), so a
recipe is inspected exactly as it will be trained; a first argument that is not a recipe is the data set
(``--dataset_name``). Prints the data report (rows, tokens, target tokens, truncation, length histogram, packing
efficiency) and one rendered row with its target tokens highlighted. Its own options: ``--example N`` (the row to
render, default 0) and ``--cache_dir DIR`` (where tokenised data is cached, default ``data/`` under
$SHARDTUNE_CACHE, else $XDG_CACHE_HOME/shardtune, else ~/.cache/shardtune: where ``shardtune train`` keeps it).

    shardtune data inspect recipe.yaml
    shardtune data inspect chat.jsonl --model_name_or_path ./model --max_seq_len 2048 --packing
"""

from __future__ import annotations

import argparse

from shardtune.cli.common import action_parsers
from shardtune.data.encode import IGNORE
from shardtune.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    actions = action_parsers(sub, "data", "inspect a fine-tuning data set", __doc__)
    q = actions.add_parser("inspect", help="print the data report and one rendered example",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("train_args", nargs="*", metavar="[RECIPE.yaml | DATASET] [KEY=VALUE | --KEY VALUE ...]",
                   help="the training arguments whose data is inspected")


class _OwnOptions(argparse.ArgumentParser):
    """``data inspect``'s own options; a bad one is a one-line UsageError, not argparse's usage block."""

    def error(self, message: str):
        raise UsageError(f"{message}; e.g. --example 3 (a train row) or --cache_dir ./cache")


def inspect_options() -> argparse.ArgumentParser:
    own = _OwnOptions(add_help=False)
    own.add_argument("--example", type=int, default=0)
    own.add_argument("--cache_dir", "--cache-dir", default=None)
    return own


OWN_OPTIONS = ("example", "cache_dir")


def refuse_near_own_options(rest: list[str]) -> None:
    """A --option that is no training key but is spelled like one of inspect's own (--examples): said so, rather
    than 'unknown key' with the training keys' list."""
    from shardtune.config.schema import ALIASES, known_keys
    from shardtune.errors import closest

    keys = {*known_keys(), *ALIASES}
    for arg in rest:
        name = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else ""
        if name and name not in keys and (near := closest(name, [*keys, *OWN_OPTIONS])) in OWN_OPTIONS:
            raise UsageError(f"{arg.partition('=')[0]}: no option of 'shardtune data inspect' and no training key; "
                             f"did you mean --{near}?")


def run_inspect(argv: list[str]) -> int:
    """``shardtune data inspect ARGS``: the training arguments go through ``load_train_config``."""
    from rich.console import Console

    from shardtune.config import load_train_config, raise_problems
    from shardtune.config.loading import is_json_recipe, repeated_cli_keys
    from shardtune.hub import offline_unless_reachable
    from shardtune.data.pipeline import prepare_datasets
    from shardtune.data.templates import load_tokenizer

    if any(a in ("-h", "--help") for a in argv):
        from shardtune.cli.common import build_parser

        build_parser("data").parse_args(["data", "inspect", "--help"])
    own, rest = inspect_options().parse_known_args(argv)
    refuse_near_own_options(rest)
    if rest and not rest[0].startswith("-") and "=" not in rest[0] and not rest[0].endswith((".yaml", ".yml")) and \
            not (rest[0].endswith(".json") and is_json_recipe(rest[0])):
        rest = ["--dataset_name", rest[0], *rest[1:]]
    # as train refuses it: a key given two values would otherwise be inspected with the last, trained with neither
    raise_problems(repeated_cli_keys(rest))
    cfg = load_train_config(rest, training=False)
    offline_unless_reachable(cfg.model.model_name_or_path, cfg.data.dataset_name)
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data, trust_remote_code=cfg.model.trust_remote_code)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.run.seed, cache_dir=own.cache_dir)
    console = Console()
    console.print(data.report.format(), highlight=False)
    console.print(data.cache_note(), highlight=False, soft_wrap=True)
    if not 0 <= own.example < len(data.train):
        raise UsageError(f"--example {own.example} is out of range: the train split has {len(data.train)} rows.")
    row = data.train[own.example]
    plain = not console.is_terminal or console.no_color  # no colours: mark targets with brackets instead
    console.rule(f"train row {own.example}: {len(row['input_ids'])} tokens, "
                 f"{sum(1 for x in row['labels'] if x != IGNORE)} targets {'in ⟦ ⟧' if plain else '(bold green)'}, "
                 f"{len(row['seq_lens'])} document(s)")
    console.print(render_row(tokenizer, row, brackets=plain), highlight=False)
    console.rule()
    return 0


def render_row(tokenizer, row: dict, *, brackets: bool = False):
    """One row as rich Text: target tokens bold green (and inside ⟦ ⟧ with ``brackets``, for plain output), the
    rest dim, a marker between packed documents."""
    from rich.text import Text

    def add(ids: list[int], is_target: bool) -> None:
        piece = tokenizer.decode(ids)
        text.append(f"⟦{piece}⟧" if is_target and brackets else piece, style="bold green" if is_target else "dim")

    text = Text()
    start = 0
    for doc, n in enumerate(row["seq_lens"]):
        if doc:
            text.append(f"\n──── document {doc + 1} ────\n", style="bold magenta")
        ids, labels = row["input_ids"][start:start + n], row["labels"][start:start + n]
        run: list[int] = []
        target = None
        for tok, lab in zip(ids, labels):
            is_target = lab != IGNORE
            if run and is_target != target:
                add(run, target)
                run = []
            run.append(tok)
            target = is_target
        if run:
            add(run, target)
        start += n
    return text
