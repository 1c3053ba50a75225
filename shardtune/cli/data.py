"""``shardtune data inspect``: what the model will learn from a data set, before any training.

Prints the data report (rows, tokens, target tokens, truncation, length histogram, packing efficiency) and one
rendered row with its target tokens highlighted.
"""

from __future__ import annotations

import argparse

from shardtune.data.config import DATA_FORMATS, DataConfig
from shardtune.data.encode import IGNORE


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="inspect a fine-tuning data set", description=__doc__)
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))
    q = data_sub.add_parser("inspect", help="print the data report and one rendered example",
                            description=__doc__)
    q.add_argument("dataset", metavar="DATASET", help="JSONL/JSON/Parquet/CSV file or folder, saved data set, hub name")
    q.add_argument("--model_name_or_path", required=True, help="the model whose tokenizer is used")
    defaults = DataConfig()
    q.add_argument("--dataset_config_name", default=None)
    q.add_argument("--splits", default=defaults.splits)
    q.add_argument("--dataset_text_field", default=defaults.dataset_text_field)
    q.add_argument("--data_format", default=defaults.data_format, help=" | ".join(DATA_FORMATS))
    q.add_argument("--chat_template_format", default=defaults.chat_template_format,
                   help="none (the tokenizer's own) | chatml | llama-3 | mistral | alpaca | zephyr")
    for flag in ("add_special_tokens", "append_concat_token", "packing", "train_on_prompt", "skip_bad_rows"):
        q.add_argument(f"--{flag}", type=_bool, nargs="?", const=True, default=getattr(defaults, flag),
                       metavar="BOOL")
    q.add_argument("--max_seq_len", type=int, default=defaults.max_seq_len)
    q.add_argument("--eval_split_ratio", type=float, default=defaults.eval_split_ratio)
    q.add_argument("--dataset_num_proc", type=int, default=None)
    q.add_argument("--seed", type=int, default=42)
    q.add_argument("--example", type=int, default=0, help="index of the row to render (default: 0)")
    q.add_argument("--cache_dir", default=None, help="where tokenised data is cached (default: $SHARDTUNE_CACHE/data)")
    q.add_argument("--trust_remote_code", action="store_true")
    q.set_defaults(func=main)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def config_from_args(args: argparse.Namespace) -> DataConfig:
    return DataConfig(dataset_name=args.dataset, dataset_config_name=args.dataset_config_name, splits=args.splits,
                      dataset_text_field=args.dataset_text_field, data_format=args.data_format,
                      chat_template_format=args.chat_template_format, add_special_tokens=args.add_special_tokens,
                      append_concat_token=args.append_concat_token, max_seq_len=args.max_seq_len,
                      packing=args.packing, train_on_prompt=args.train_on_prompt,
                      eval_split_ratio=args.eval_split_ratio, dataset_num_proc=args.dataset_num_proc,
                      skip_bad_rows=args.skip_bad_rows)


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


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from shardtune.data.pipeline import prepare_datasets
    from shardtune.data.templates import load_tokenizer
    from shardtune.errors import UsageError

    cfg = config_from_args(args)
    problems = cfg.validate()
    if problems:
        raise UsageError(" ".join(problems))
    tokenizer = load_tokenizer(args.model_name_or_path, cfg, trust_remote_code=args.trust_remote_code)
    data = prepare_datasets(cfg, tokenizer, seed=args.seed, cache_dir=args.cache_dir)
    console = Console()
    console.print(data.report.format(), highlight=False)
    if not 0 <= args.example < len(data.train):
        raise UsageError(f"--example {args.example} is out of range: the train split has {len(data.train)} rows.")
    row = data.train[args.example]
    plain = not console.is_terminal or console.no_color  # no colours: mark targets with brackets instead
    console.rule(f"train row {args.example}: {len(row['input_ids'])} tokens, "
                 f"{sum(1 for x in row['labels'] if x != IGNORE)} targets {'in ⟦ ⟧' if plain else '(bold green)'}, "
                 f"{len(row['seq_lens'])} document(s)")
    console.print(render_row(tokenizer, row, brackets=plain), highlight=False)
    console.rule()
    return 0
