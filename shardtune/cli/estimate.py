"""``shardtune estimate``: per-GPU memory of a fine-tuning setup, before any GPU is rented."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from shardtune import catalog
from shardtune.cli.common import check_output_file, print_config_notes
from shardtune.config.deepspeed import is_deepspeed_json
from shardtune.config.schema import DATASET_PLACEHOLDER, LoraConfig, TrainConfig, published_defaults
from shardtune.errors import UsageError
from shardtune.hardware import (DEFAULT_GPU, GPUS, INTER_NODE_LINKS, INTRA_NODE_LINKS, PRICES_AS_OF, SPEC_EXAMPLE, Gpu,
                                custom_gpu, gpu_by_name, gpu_from_spec)
from shardtune.memory.report import Report, TimeReport, estimate_report
from shardtune.memory.setup import (ATTENTION, LOSSES, METHODS, MIXED_PRECISIONS, OPTIMIZERS, SHARDING_STRATEGIES,
                                    Setup, normalize_sharding, validate)
from shardtune.strategies import (DDP, FSDP, NAMES, NO, ZERO_STAGES, no_as_ddp, strategy_named, zero_mapping,
                                  zero_stage)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="per-GPU memory of a fine-tuning setup, and the setup to use",
                       description=__doc__ + " MODEL is a catalog name (--list), a local model folder or a "
                                             "config.json. The job options set the 'shardtune train' keys they "
                                             "name, and default to train's defaults: with none, the estimate is "
                                             "of the job 'shardtune train' runs with none.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a catalog name or its Hugging Face id (an -Instruct/-it/-chat variant's id too), a local "
                        "model folder, its config.json, a GGUF file, or a hub id whose config.json the local Hugging "
                        "Face cache holds ('hf download ID config.json')")
    p.add_argument("--list", action="store_true", help="print the catalog of known models and exit")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="estimate exactly the job these files describe: a shardtune/TRL YAML recipe, an Accelerate "
                        "config file, a DeepSpeed JSON (repeat for several); MODEL defaults to its "
                        "model_name_or_path, and the setup options come from the files, not the command line")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--gpu", default=None, help=f"{', '.join(GPUS)} (default: {DEFAULT_GPU})")
    hw.add_argument("--gpu-memory", type=float, default=None, metavar="GIB", help="GPU memory in GiB")
    hw.add_argument("--gpu-spec", default=None, metavar="SPEC",
                    help="a card outside --gpu's list, by its data sheet's numbers: tflops= (dense bf16 TFLOP/s), "
                         "memory= (GiB), bandwidth= (GB/s), optionally link=, host= and arch=hopper|blackwell; "
                         "e.g. " + SPEC_EXAMPLE[11:])
    job = p.add_argument_group("the job (with --config the files describe it instead)")
    _job_options(job)
    _output_options(p)
    _time_options(p.add_argument_group("time and cost (--time; any of these options turns it on)"))
    p.set_defaults(func=main, setup_options={action.dest: tuple(action.option_strings)
                                             for action in job._group_actions},
                   flag_options={action.dest for action in job._group_actions if action.nargs == 0})
    options = {action.dest: action.option_strings[0] for action in job._group_actions}
    p.placed_elsewhere = lambda name: _train_key_option(name, options)


# Train keys that an estimate option other than the one of their name says.
TRAIN_KEY_OPTIONS = {"use_peft_lora": "--method lora", "use_4bit_quantization": "--method qlora",
                     "distributed_type": "--strategy", "num_processes": "--num-gpus (per node) and --num-nodes",
                     "fsdp_activation_checkpointing": "--gradient-checkpointing",
                     # train's --deepspeed ds.json: the file itself is a --config (read as train reads it)
                     "deepspeed": "--config DS_CONFIG.json (with the recipe's --config beside it)"}


def _train_key_option(name: str, options: dict[str, str]) -> str | None:
    """Where the train key ``name`` (written as 'shardtune train' takes it) goes in an estimate: the option that sets
    it, or --config for a recipe; None for a name that is no train key."""
    from shardtune.config.schema import ALIASES, all_keys

    key = ALIASES.get(name.replace("-", "_"), name.replace("-", "_"))
    if key in ("model", "model_name_or_path"):  # TRL's and most tools' spelling of the one positional argument
        return ("the model is the first argument, not an option: 'shardtune estimate MODEL [options]' (a catalog "
                "name, a local model folder or a config.json)")
    if not any(d.name == key for d in all_keys()):
        return None
    if key in TRAIN_KEY_OPTIONS or key in options:
        return f"{key} is {TRAIN_KEY_OPTIONS.get(key) or options[key]} here"
    return f"{key} is a 'shardtune train' key with no estimate option: give the job as a recipe with --config FILE"


def _default(key: str) -> str:
    """``key``'s default in a help text: the trainer's, read from config/schema.py."""
    return f"default: {published_defaults().to_flat()[key]}"


def _job_options(job: argparse._ArgumentGroup) -> None:
    """The options that describe the job. Each one's dest is the train key it sets (``method`` sets
    use_peft_lora and use_4bit_quantization), left None when not given so that the key keeps train's default."""
    job.add_argument("--method", default=None, help=f"{' | '.join(METHODS)} (default: {LoraConfig().method})")
    job.add_argument("--num-gpus", type=int, default=1, help="GPUs per node (default: 1); with --config too, where "
                     "the files set no num_processes (the launch's --num_processes, over the nodes)")
    job.add_argument("--num-nodes", type=int, default=1, help="nodes (default: 1); with --config too, where the "
                     "files set no num_machines")
    job.add_argument("--strategy", default="auto",
                     help=f"auto | {' | '.join(NAMES)}, in any case (zero1/zero2/zero3: DeepSpeed's ZeRO stages, "
                          f"run as FSDP); default: auto")
    job.add_argument("--sharding-strategy", dest="fsdp_sharding_strategy", default=None,
                     help=f"{' | '.join(SHARDING_STRATEGIES)} (ZeRO-1/2/3 accepted); "
                          f"{_default('fsdp_sharding_strategy')}")
    job.add_argument("--offload-params", dest="fsdp_offload_params", action="store_const", const=True,
                     help="FSDP CPU offload of params, grads, optimizer")
    job.add_argument("--batch-size", dest="per_device_train_batch_size", type=int, default=None,
                     help=f"micro-batch per device ({_default('per_device_train_batch_size')})")
    job.add_argument("--seq-len", dest="max_seq_len", type=int, default=None,
                     help=f"tokens per sequence ({_default('max_seq_len')})")
    job.add_argument("--gradient-accumulation-steps", type=int, default=None,
                     help=f"micro-batches per optimizer step ({_default('gradient_accumulation_steps')})")
    job.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                     help=f"recompute each decoder layer in backward ({_default('gradient_checkpointing')})")
    job.add_argument("--activation-offloading", action="store_const", const=True,
                     help="keep the checkpointed layers' inputs in pinned host memory (the trainer's "
                          "activation_offloading; needs gradient checkpointing)")
    job.add_argument("--mixed-precision", default=None,
                     help=f"{' | '.join(MIXED_PRECISIONS)} (default: train's, {TrainConfig().precision_on(True)} on a "
                          f"GPU that computes bf16, {TrainConfig().precision_on(False)} on one that does not)")
    job.add_argument("--pure-bf16", dest="torch_dtype", action="store_const", const="bfloat16",
                     help="keep weights and optimizer states in bf16 (no fp32 master): the trainer's "
                          "torch_dtype bfloat16, with adamw_torch")
    job.add_argument("--optimizer", dest="optim", default=None,
                     help=f"the trainer's optim names: {' | '.join(OPTIMIZERS)} (adamw and adamw-8bit are the "
                          f"earlier spellings of adamw_torch and adamw_8bit; {_default('optim')})")
    job.add_argument("--lora-r", type=int, default=None, help=f"LoRA rank ({_default('lora_r')})")
    job.add_argument("--lora-target-modules", default=None,
                     help=f"all-linear or e.g. q_proj,v_proj ({_default('lora_target_modules')})")
    job.add_argument("--use-dora", dest="use_dora", action="store_const", const=True,
                     help="DoRA: a trained magnitude per output feature of each adapted layer (the trainer's use_dora)")
    job.add_argument("--lora-bias", dest="lora_bias", default=None, choices=("none", "all", "lora_only"),
                     help=f"which of the model's biases train beside the adapters, PEFT's bias "
                          f"({_default('lora_bias')})")
    job.add_argument("--lora-modules-to-save", dest="lora_modules_to_save", default=None, type=_names,
                     metavar="NAMES", help="modules trained in full beside the adapters, e.g. lm_head,embed_tokens "
                                           "(PEFT's modules_to_save)")
    job.add_argument("--pipeline-microbatches", type=int, default=None, metavar="M",
                     help="micro-batches each batch is split into under PP (a divisor of --batch-size; default: "
                          "one row each, as --emit-config writes it)")
    job.add_argument("--num-train-epochs", type=float, default=None, metavar="N",
                     help="passes over the data that --time prices (--data FILE or --tokens N, one pass); "
                          f"turns --time on ({_default('num_train_epochs')})")
    job.add_argument("--attn-implementation", default=None,
                     help=f"{' | '.join(ATTENTION)} ({_default('attn_implementation')})")


def _names(text: str) -> list[str]:
    """A comma-separated list of module names."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _output_options(p: argparse.ArgumentParser) -> None:
    """What the estimate models besides the job, and what it writes."""
    p.add_argument("--loss", default="shardtune", choices=LOSSES,
                   help="shardtune: shardtune train's loss (fused with the head: one chunk of tokens' logits at a "
                        "time, in fp32, recomputed in backward; no logits kept); full: transformers' loss, fp32 "
                        "logits of the whole micro-batch; full-shifted: transformers <= 4.44's, which also keeps a "
                        "shifted fp32 copy; chunked: torchtune's compiled chunked cross-entropy (default: shardtune)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also write a PNG: the per-GPU breakdown of each setup against the GPU's memory; with "
                        "--time also FILE-time.png, each setup's time and cost")
    p.add_argument("--trace", action="store_true",
                   help="also run the trainer's own step on fake tensors at this world size (no GPU, no memory) "
                        "and report its exact per-GPU peak, by category and by module")
    p.add_argument("--find-batch-size", action="store_true",
                   help="the largest micro-batch that fits with more to spare than the estimate's error (the "
                        "tightest fit where none does), with the gradient accumulation that keeps the global batch "
                        "(--batch-size x --gradient-accumulation-steps x GPUs)")
    p.add_argument("--emit-config", default=None, metavar="FILE.yaml",
                   help="write a ready-to-run 'shardtune train' recipe of the estimated setup (the recommended "
                        "one unless --strategy names one; set dataset_name); refused where it does not fit")
    p.add_argument("--measured", default=None, metavar="FILE.json",
                   help="rank the setups that fit by the speeds 'shardtune bench strategies --out FILE.json' "
                        "measured on your machine, instead of the usual order")


def _time_options(tm: argparse._ArgumentGroup) -> None:
    tm.add_argument("--time", action="store_true",
                    help="also predict each setup's step time, tokens/s, MFU, and the data's time and cost "
                         "(docs/estimator.md says how)")
    data = tm.add_mutually_exclusive_group()
    data.add_argument("--tokens", type=_token_count, default=None, metavar="N",
                      help=f"tokens in one pass over the data, e.g. 250M or 2e9, at most {MAX_TOKENS / 1e12:,.0f}T "
                           "(x the job's num_train_epochs; default: time and cost per billion tokens)")
    data.add_argument("--data", default=None, metavar="FILE.jsonl",
                      help="count the tokens of this data file (jsonl, json, parquet, csv): with the model's "
                           "tokenizer.json (its folder's, or the Hugging Face cache's for a hub or catalog model), "
                           "else about 4 characters a token (default with "
                           "--config: the recipe's dataset_name, where it is a local data file)")
    tm.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="USD",
                    help=f"what one GPU costs per hour (default: a typical on-demand list price, {PRICES_AS_OF})")
    tm.add_argument("--interconnect", default=None, metavar="NAME",
                    help=f"link between a node's GPUs: nvlink, pcie or {', '.join(INTRA_NODE_LINKS)} (default: the "
                         f"card's usual one, NVLink on H100/H200/A100, PCIe on the others)")
    tm.add_argument("--inter-node", default=None, metavar="NAME",
                    help=f"network between nodes: {', '.join(INTER_NODE_LINKS)} (default: infiniband for "
                         f"H100/H200, infiniband-hdr for A100, ethernet-100g otherwise)")


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# 1,000T: some 25 times the largest pre-training corpora published (about 40T tokens); more is a typo, and past
# float range (1e400, inf) the arithmetic itself breaks.
MAX_TOKENS = 1e15


def _token_count(text: str) -> int:
    """A token count as people write it: 1000000, 1e6, 250M, 1.5B."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a token count (e.g. 1000000, 2e9, 250M, 1.5B)") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"'{text}': give at least 1 token")
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"'{text}' is more than {MAX_TOKENS / 1e12:,.0f}T tokens, beyond any data "
                                         f"set trained on: give one pass over your data (e.g. 2e9, 250M, 15T)")
    return int(value)


def wants_time(args: argparse.Namespace) -> bool:
    return bool(args.time or args.tokens or args.data or args.price_per_gpu_hour is not None or args.interconnect
                or args.inter_node or args.num_train_epochs is not None)


def time_from_args(args: argparse.Namespace, report, measured=None):
    """The --time report for ``report``: links, data and price as the options say."""
    from shardtune.hardware import host_link, inter_node_link, intra_node_link
    from shardtune.memory.report import time_report
    from shardtune.memory.timing import Links

    if args.price_per_gpu_hour is not None and args.price_per_gpu_hour < 0:
        raise UsageError(f"--price-per-gpu-hour must be 0 or more US dollars (got {args.price_per_gpu_hour:g}).")
    gpu, setup = report.gpu, report.breakdown.setup
    links = Links(intra_node_link(gpu, args.interconnect), inter_node_link(gpu, args.inter_node), host_link(gpu))
    for option, given, idle in (("--interconnect", args.interconnect, setup.num_gpus == 1),
                                ("--inter-node", args.inter_node, setup.num_nodes == 1)):
        if given and idle:  # no collective crosses it: the option would change nothing
            where = "one GPU per node" if option == "--interconnect" else "one node"
            count = "--num-gpus" if option == "--interconnect" else "--num-nodes"
            raise UsageError(f"{option} {given}: the job runs on {where}, so nothing crosses that link; give "
                             f"{count} (or leave {option} out)")
    data = _data_tokens(args, report)

    def recipe_fix() -> str:  # the key to change is the files' own; read again only for the refusal
        from shardtune.config.loading import key_origins

        origins = key_origins(config_argv(args.config))
        return (f"set bf16 false (and fp16 true for fp16) at {origins['bf16']}" if "bf16" in origins else
                f"set mixed_precision fp16 (or no) at {origins.get('mixed_precision', ' or '.join(args.config))}")

    return time_report(report, links, data, args.price_per_gpu_hour, measured=measured,
                       fix=recipe_fix if args.config else None)


def _data_tokens(args: argparse.Namespace, report):
    """The tokens of one pass over the data --time prices: --data's file counted, --tokens as given, or else the
    data file a --config recipe trains on (its dataset_name); None where there is none (per billion tokens)."""
    from shardtune.hub import data_file_kind
    from shardtune.memory.timing import DataTokens, count_data_tokens

    if args.num_train_epochs is not None and not (math.isfinite(args.num_train_epochs) and args.num_train_epochs > 0):
        raise UsageError(f"--num-train-epochs must be a positive number of passes over the data, e.g. 3 or 0.5 (got "
                         f"{args.num_train_epochs:g})")
    if args.num_train_epochs is not None and not (args.data or args.tokens):
        raise UsageError(f"--num-train-epochs {args.num_train_epochs:g} multiplies the data's tokens: give the data "
                         f"with --data FILE (or its tokens with --tokens N), or leave --num-train-epochs out")
    if args.tokens:
        return DataTokens(args.tokens)
    read = report.breakdown.setup.config.data
    data, named = args.data, read.dataset_name
    if not data and args.config and named and data_file_kind(named) and Path(named).expanduser().is_file():
        data = named  # the file the recipe trains on, read from where train reads it
    if not data:
        return None
    counted = count_data_tokens(data, args.model, report.breakdown.setup.seq_len, read.dataset_text_field,
                                read.data_format, read.alpaca_as_chat)
    return counted.without_eval_rows(read.rows_held_out(counted.rows))  # one file: train holds eval rows out of it


ACCELERATE_KEYS = {"compute_environment", "fsdp_config", "deepspeed_config", "machine_rank", "num_machines",
                   "main_training_function"}


def config_argv(files: list[str]) -> list[str]:
    """``--config`` files as ``shardtune train`` takes them: a DeepSpeed JSON is --deepspeed, an Accelerate file
    --config_file, anything else a recipe."""
    import yaml

    argv: list[str] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            what = "a folder, not a file" if path.is_dir() else "no such file"
            raise UsageError(f"--config {name}: {what}; give a training recipe, an Accelerate config file or a "
                             f"DeepSpeed JSON")
        if path.suffix == ".json" and is_deepspeed_json(path):
            argv += ["--deepspeed", name]
            continue
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            data = None  # the recipe reader says what is wrong, with the line
        argv += ["--config_file", name] if isinstance(data, dict) and ACCELERATE_KEYS & set(data) else [name]
    return argv


# The process counts a recipe seldom holds: `shardtune launch --num_processes N train recipe.yaml` gives them.
COUNT_OPTIONS = {"--num-gpus": "num_processes", "--num-nodes": "num_machines"}


def _counts_of_the_launch(args: argparse.Namespace, counts: list[str]) -> list[str]:
    """--num-gpus and --num-nodes with --config, as the launch's num_processes (every node's) and num_machines;
    refused where the files set them (an Accelerate config's num_processes), which then decide."""
    from shardtune.config.loading import key_origins, load_given_values

    if not counts:
        return []
    argv = config_argv(args.config)
    origins, values = key_origins(argv), load_given_values(argv)
    if set_there := [f"{key} {values[key]} ({origins[key]})" for key in COUNT_OPTIONS.values() if key in origins]:
        raise UsageError(f"{', '.join(counts)}: the files set {', '.join(set_there)}, which decide with --config; "
                         f"change it there, or leave {' and '.join(counts)} out")
    return ["--num_processes", str(args.num_gpus * args.num_nodes), "--num_machines", str(args.num_nodes)]


def setup_from_config_files(args: argparse.Namespace) -> Setup:
    """``--config``: the Setup of the job the files describe (what ``shardtune train`` with them would run), and
    MODEL from them when not given. Setup options on the command line are refused: the files decide; except the
    process counts, which a launch gives (``_counts_of_the_launch``)."""
    from shardtune.config.loading import load_given_values, load_planned_config
    from shardtune.memory.trace_setup import setup_from_config

    typed = getattr(args, "argv", [])
    given = [options[0] for dest, options in args.setup_options.items()
             if any(arg == o or arg.startswith(o + "=") for arg in typed for o in options)]
    counts = [option for option in given if option in COUNT_OPTIONS]
    if given := [option for option in given if option not in counts]:
        raise UsageError(f"{', '.join(given)}: with --config the files describe the setup; set "
                         f"{'it' if len(given) == 1 else 'them'} there (or leave --config out)")
    argv = config_argv(args.config) + _counts_of_the_launch(args, counts)
    if args.model:
        argv += ["--model_name_or_path", args.model]
    elif not load_given_values(argv).get("model_name_or_path"):  # train's fix names --model_name_or_path
        raise UsageError(f"--config {', '.join(args.config)}: no model_name_or_path in it; give MODEL ('shardtune "
                         f"estimate MODEL --config ...'), or set model_name_or_path in the recipe")
    notes: list[str] = []
    cfg = load_planned_config(argv, notes)
    print_config_notes(notes, argv)  # what train says at start of the same files
    args.model = cfg.model.model_name_or_path
    d = cfg.distributed
    if d.distributed_type == "MP" and not d.mp_devices:
        raise UsageError("distributed_type MP without mp_devices splits the layers over every visible GPU, a count "
                         "the files do not hold: set mp_devices (e.g. cuda:0,cuda:1 for two GPUs) in the recipe")
    if d.distributed_type == "FSDP" and d.fsdp_auto_wrap_policy != "TRANSFORMER_BASED_WRAP" and not args.trace:
        # The trace builds the job's own units on fake tensors; the formula has only the per-layer ones.
        raise UsageError(f"fsdp_auto_wrap_policy {d.fsdp_auto_wrap_policy}: the estimate's formula counts one FSDP "
                         f"unit per decoder layer (TRANSFORMER_BASED_WRAP); add --trace, which wraps the job's model "
                         f"as it runs, or use TRANSFORMER_BASED_WRAP")
    if note := no_as_ddp(d.distributed_type, d.num_processes, "estimated"):
        print(f"note: {note}", file=sys.stderr)
    return validate(setup_from_config(cfg, d.num_processes, d.num_machines if d.num_processes % d.num_machines == 0
                                      else 1, native_bf16=gpu_from_args(args).bf16))


def setup_from_args(args: argparse.Namespace) -> tuple[Setup, bool]:
    """The Setup the options describe (train's defaults for the keys they leave out), and whether the strategy is
    left to the recommender."""
    keys = {dest: getattr(args, dest) for dest in args.setup_options
            if dest not in ("num_gpus", "num_nodes", "strategy", "pipeline_microbatches")
            and getattr(args, dest) is not None}
    # An FSDP option (offload, a sharding strategy) asks for FSDP: the recommender may not trade it away.
    left_open = args.strategy.lower() == "auto"
    auto = left_open and not (keys.get("fsdp_offload_params") or keys.get("fsdp_sharding_strategy"))
    if left_open and not auto:
        keys["distributed_type"] = FSDP
    stage = zero_stage(args.strategy)
    if stage is not None:
        keys["distributed_type"], sharding = ZERO_STAGES[stage]
        _check_zero_sharding(args, sharding)
        print(f"note: --strategy {args.strategy}: {zero_mapping(stage)}", file=sys.stderr)  # as train says a file's
        keys.update({"fsdp_sharding_strategy": sharding} if sharding else {})
    elif auto:  # what is estimated first; the recommender then compares the candidates
        keys["distributed_type"] = FSDP if args.num_gpus * args.num_nodes > 1 else NO
    elif "distributed_type" not in keys:
        keys["distributed_type"] = strategy_named(args.strategy)
    _check_strategy_options(args, keys, auto)
    _check_lora_options(args, keys)
    setup = validate(Setup(num_gpus=args.num_gpus, num_nodes=args.num_nodes, loss=args.loss,
                           native_bf16=gpu_from_args(args).bf16,
                           pipeline_microbatches=args.pipeline_microbatches).with_(**keys))
    from shardtune.memory.recommend import refusals

    if auto and setup.world_size > 1 and refusals(setup):  # FSDP first, unless train refuses it
        setup = validate(setup.with_(distributed_type=DDP))
    if problems := refusals(setup):  # what train would refuse, every one, naming the options as typed
        raise UsageError(" | ".join(as_typed(problem, args) for problem in problems))
    return setup, auto


LORA_OPTIONS = ("lora_r", "lora_target_modules", "use_dora", "lora_bias", "lora_modules_to_save")


def _check_lora_options(args: argparse.Namespace, keys: dict) -> None:
    """LoRA's options on a full fine-tune would be dropped without a word (train refuses those keys there)."""
    method = keys.get("method") or LoraConfig().method
    given = [args.setup_options[key][0] for key in LORA_OPTIONS if keys.get(key) is not None]
    if method == "full" and given:
        raise UsageError(f"{', '.join(given)}: LoRA's option{'s' if len(given) > 1 else ''} with --method full, "
                         f"which trains every weight and no adapters; add --method lora (or qlora), or leave "
                         f"{'them' if len(given) > 1 else 'it'} out")


def _check_zero_sharding(args: argparse.Namespace, sharding: str | None) -> None:
    """A ZeRO stage names its sharding itself: another --sharding-strategy beside it would be dropped without a
    word (--strategy zero3 --sharding-strategy SHARD_GRAD_OP estimated FULL_SHARD)."""
    given = args.fsdp_sharding_strategy
    if given is None or sharding is None or normalize_sharding(given) == sharding:
        return
    raise UsageError(f"--sharding-strategy {given} contradicts --strategy {args.strategy}, which is FSDP {sharding}; "
                     f"give one of them: --strategy FSDP --sharding-strategy {normalize_sharding(given)}, or "
                     f"--strategy {args.strategy} alone")


def _check_strategy_options(args: argparse.Namespace, keys: dict, auto: bool) -> None:
    """An option of another strategy than the one named would be dropped without a word: refused instead."""
    strategy = strategy_named(keys["distributed_type"])
    if not strategy.shards_parameters:
        for option, key in (("--sharding-strategy", "fsdp_sharding_strategy"), ("--offload-params",
                                                                                "fsdp_offload_params")):
            if keys.get(key) is not None and keys.get(key) is not False:
                raise UsageError(f"{option} sets up FSDP, and --strategy {args.strategy} is not FSDP; leave {option} "
                                 f"out or give --strategy FSDP")
    if args.pipeline_microbatches is not None and not strategy.pipelined and not (auto and args.measured):
        raise UsageError(f"--pipeline-microbatches splits the batch of pipeline parallel only, which --strategy "
                         f"{args.strategy} is not; give --strategy PP (or --measured with PP's speed) or leave it out")


def gpu_from_args(args: argparse.Namespace) -> Gpu:
    if args.gpu_spec is not None:
        return gpu_from_spec(args.gpu_spec)
    if args.gpu_memory is not None:
        if not math.isfinite(args.gpu_memory) or args.gpu_memory <= 0:
            raise UsageError(f"--gpu-memory must be a positive number of GiB (got {args.gpu_memory:g}).")
        return custom_gpu(args.gpu_memory)
    return gpu_by_name(args.gpu or DEFAULT_GPU)


def print_catalog(as_json: bool = False) -> None:
    """The catalog's models: a table, or with ``as_json`` one JSON list of {name, hf_id, parameters}."""
    from rich.console import Console
    from rich.table import Table

    rows = [(name, catalog.metadata(name)) for name in catalog.names()]
    if as_json:
        print(json.dumps([{"name": name, "hf_id": meta.get("hf_id"), "parameters": meta.get("published_parameters")}
                          for name, meta in rows], indent=2))
        return
    table = Table(title="shardtune catalog (shardtune estimate NAME)", title_justify="left")
    for col in ("name", "Hugging Face id", "parameters"):
        table.add_column(col, justify="right" if col == "parameters" else "left")
    for name, meta in rows:
        count = meta.get("published_parameters")
        table.add_row(name, meta.get("hf_id", ""), f"{count:,}" if count else "")
    Console().print(table)


def _recommend_for_global_batch(model: str, setup: Setup, gpu: Gpu, measured):
    """--find-batch-size with the setup left to shardtune: the micro-batch is free, only the global batch is
    asked. The setup is the one recommended where any micro-batch fits (1), and the report is made again at
    the micro-batch found for it, so the table, the recommendation and an emitted recipe all agree. (Chosen at
    the asked micro-batch instead, a batch only CPU offload could hold would keep offload after the search
    found that one GPU holds a smaller micro-batch.)"""
    from shardtune.memory.batch_plan import find_batch_size

    free = estimate_report(model, setup.with_(per_device_train_batch_size=1, gradient_accumulation_steps=1), gpu,
                           True, measured)
    asked = free.breakdown.setup.with_(per_device_train_batch_size=setup.batch_size,
                                       gradient_accumulation_steps=setup.gradient_accumulation_steps)
    plan = find_batch_size(model, asked, gpu)
    return estimate_report(model, plan.applied_to(setup), gpu, True, measured), plan


def _batch_and_config(args: argparse.Namespace, report, plan) -> dict:
    """--find-batch-size's plan and --emit-config's recipe of the report's setup (at the batch found, when
    searched)."""
    out: dict = {}
    if plan is not None:
        out["batch_plan"] = plan.to_dict()
    if args.emit_config:
        from shardtune.memory.batch_plan import emit_config

        _check_emittable(args, report)
        out["emitted_config"] = str(emit_config(args.model, report.breakdown.setup, args.emit_config))
    return out


def _check_emittable(args: argparse.Namespace, report) -> None:
    """A recipe is written only of a job that fits, and of the loss it trains with: 'shardtune train' computes its
    own fused loss, so an estimate made for another (--loss) would not describe the recipe's job."""
    if args.loss != "shardtune":
        raise UsageError(f"--emit-config writes a 'shardtune train' recipe, which trains with shardtune's own loss, "
                         f"not --loss {args.loss}; leave --loss out to estimate (and write) that job")
    breakdown, gpu = report.breakdown, report.gpu
    if not breakdown.fits(gpu.memory_bytes):
        need = (breakdown.total + breakdown.cuda_context) / 2**30
        fits = report.recommendation.suggestions[:1]
        raise UsageError(f"--emit-config {args.emit_config}: {breakdown.setup.label()} at micro-batch "
                         f"{breakdown.setup.batch_size} needs {need:.1f} GiB per GPU, more than the "
                         f"{gpu.memory_bytes / 2**30:.1f} GiB of the {gpu.label or gpu.name}, so no recipe is written"
                         + (f"; what would fit: {fits[0]}" if fits else "; change the job until it fits"))


def main(args: argparse.Namespace) -> int:
    """The estimate the options (or --config files) describe: the report, then what the extra options add."""
    try:
        return _estimate(args)
    except UsageError as exc:
        raise said_as_given(exc, args) from None


def said_as_given(error: UsageError, args: argparse.Namespace) -> UsageError:
    """A refusal about a job key (a LoRA target the model lacks) in the user's words: led by the recipe's file and
    line with --config, by the option that set the key otherwise."""
    from shardtune.config.loading import placed

    if args.config:
        return placed(error, config_argv(args.config))
    problem = error.args[0] if error.args else None
    typed = as_typed(problem, args) if isinstance(problem, str) else problem
    return error if typed is problem else UsageError(typed)


def as_typed(problem: str, args: argparse.Namespace) -> str:
    """A ``Problem`` about job keys with each key named by the option that set it (as it is where it names none)."""
    options = {**args.setup_options, "distributed_type": ("--strategy",)}
    keys = [key for key in getattr(problem, "keys", ()) if key in options]
    if not keys:
        return problem

    def option(match: re.Match) -> str:  # a flag's option takes no value: "torch_dtype=bfloat16" is --pure-bf16
        name = options[match[1]][0]
        return name if match[1] in args.flag_options else name + (match[2] or "").replace("=", " ", 1)

    return re.sub(rf"\b({'|'.join(keys)})\b(=\S+)?", option, str(problem))


def _estimate(args: argparse.Namespace) -> int:
    if args.list:
        # --list prints the catalog alone: an estimate's model or options beside it would do nothing
        given = ([f"MODEL {args.model}"] if args.model else []) + [
            arg.split("=")[0] for arg in getattr(args, "argv", []) if arg.startswith("-") and arg.split("=")[0]
            not in ("--list", "--json")]
        if given:
            raise UsageError(f"--list prints the catalog and estimates nothing, so {', '.join(given)} would do "
                             f"nothing beside it; run 'shardtune estimate --list' (--json for JSON) alone, then the "
                             f"estimate without --list")
        print_catalog(as_json=args.json)
        return 0
    if args.pipeline_microbatches is not None and args.pipeline_microbatches < 1:
        raise UsageError(f"--pipeline-microbatches must be a whole number >= 1 (got {args.pipeline_microbatches}).")
    for option, path in (("--emit-config", args.emit_config), ("--plot", args.plot),
                         ("--plot", args.plot and wants_time(args) and time_plot_path(args.plot))):
        if path:
            check_output_file(path, option)  # before the estimate, not after it
    if args.emit_config and not args.emit_config.endswith((".yaml", ".yml")):  # what train reads as a recipe
        raise UsageError(f"--emit-config {args.emit_config}: the recipe is written in YAML, which 'shardtune train' "
                         f"reads from a .yaml or .yml file; name it {Path(args.emit_config).with_suffix('.yaml')}")
    if args.plot:
        from shardtune.memory.plot import check_plot_path

        check_plot_path(args.plot)
    if args.config:
        setup, auto = setup_from_config_files(args), False
    elif not args.model:
        raise UsageError("give a MODEL (a catalog name, a model folder or a config.json); "
                         "'shardtune estimate --list' prints the catalog.")
    elif Path(args.model).suffix in (".yaml", ".yml") and Path(args.model).is_file():  # read as a config.json
        raise UsageError(f"MODEL {args.model}: a YAML file, not a model; to estimate the job a training recipe "
                         f"describes, give it as --config {args.model}")
    else:
        setup, auto = setup_from_args(args)
    _check_seq_len(args.model, setup.seq_len, "max_seq_len" if args.config else "--seq-len")
    from shardtune.memory.inventory import cached_hub_config

    if (not Path(args.model).expanduser().exists() and (base := catalog.variant_of(args.model))
            and not cached_hub_config(args.model)):
        print(f"note: {args.model} is estimated with its base model's config (catalog {catalog.canonical(base)}, "
              f"{base}): an instruction-tuned variant keeps its base's architecture; give its config.json for its "
              f"own", file=sys.stderr)
    _check_stages(args, setup)
    gpu = gpu_from_args(args)
    setup = _as_run_on(setup, gpu, recipe=bool(args.config))
    measured = None
    if args.measured:
        from shardtune.memory.recommend import Measured

        measured = Measured.load(args.measured)
    plan = None
    if args.find_batch_size and auto:
        report, plan = _recommend_for_global_batch(args.model, setup, gpu, measured)
    elif args.find_batch_size:
        from shardtune.memory.batch_plan import find_batch_size

        plan = find_batch_size(args.model, setup, gpu, recipe=bool(args.config))
        report = estimate_report(args.model, plan.applied_to(setup), gpu, False, measured)
    else:
        report = estimate_report(args.model, setup, gpu, auto, measured)
    # The tables, the JSON, the time, an emitted recipe and the trace: all of the report's setup (the batch found).
    extras = _batch_and_config(args, report, plan)
    if args.trace:
        extras["trace"] = _trace(args.model, report, gpu)
    timed = time_from_args(args, report, measured) if wants_time(args) else None
    if timed:
        from shardtune.memory.report import time_to_dict

        extras["timing"] = time_to_dict(timed, report.gpu)
    if args.json:
        from shardtune.memory.report import to_dict

        json.dump(to_dict(report) | extras, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_tables(report, timed, extras)
    if args.plot:
        _write_plots(args.plot, report, timed)
    return 0


def _as_run_on(setup: Setup, gpu: Gpu, *, recipe: bool) -> Setup:
    """``setup`` as the trainer runs it on ``gpu``. Options asking for what the card cannot compute are refused:
    bf16 on a card without it; flash attention before Ampere or in a job computing in fp32 (the trainer would
    take sdpa, which holds more). A recipe's job is estimated as it would run: its bf16 emulated (train warns),
    its use_flash_attn falling back to sdpa (said here); an attn_implementation flash_attention_2 it could not
    run is refused by its key."""
    card = gpu.label or gpu.name
    flash = setup.attn_implementation == "flash_attention_2"
    bf16 = setup.mixed_precision == "bf16" and not setup.pure_bf16
    why = (f"FlashAttention-2 runs on Ampere and newer GPUs, not on the {card}" if not gpu.bf16  # none before Ampere
           else f"flash attention computes in bf16 or fp16 only, and this job computes in fp32 on the {card}"
           if setup.mixed_precision == "no" and not setup.pure_bf16 else None)
    if not recipe:
        if bf16 and not gpu.bf16:
            raise UsageError(f"--mixed-precision bf16: the {card} does not compute bf16; give --mixed-precision fp16 "
                             f"(or no), or leave it out for what train picks there")
        if flash and why:
            raise UsageError(f"--attn-implementation flash_attention_2: {why}; leave --attn-implementation out "
                             f"(sdpa){', or give --mixed-precision fp16' if gpu.bf16 else ''}")
        return setup
    if flash and why and not setup.config.model.use_flash_attn:
        raise UsageError(f"attn_implementation flash_attention_2: {why}; set attn_implementation sdpa, with "
                         f"use_flash_attn true to take flash attention where it can run")
    if flash and why:
        print(f"note: use_flash_attn: {why}: the trainer takes {setup.config.model.attn_implementation} there, and "
              f"so does this estimate", file=sys.stderr)
        return setup.with_(use_flash_attn=False)
    return setup


def _model_number(model: str, from_config, from_model) -> tuple[int, str] | None:
    """A number of MODEL's architecture and where it was read (hub's ``config_context_length``/``context_length``
    pairs): from the catalog's config for a catalog name, else from the model itself."""
    from shardtune.memory.inventory import cached_hub_config

    name = catalog.canonical(model)
    if name in catalog.names() and not cached_hub_config(model):
        return from_config(catalog.load(name), f"catalog {name}")
    return from_model(model)


def _check_seq_len(model: str, seq_len: int, option: str) -> None:
    """What train refuses of the sequence length beyond its declared bound (checked with the setup's numbers),
    refused here too, so that an estimate (and the recipe --emit-config writes) is of a job that can run: more
    tokens than the model's positions."""
    from shardtune.config.validation import beyond_context
    from shardtune.hub import config_context_length, context_length

    found = _model_number(model, config_context_length, context_length)
    if problem := beyond_context(seq_len, found, f"{option} {seq_len}", model, option):
        raise UsageError(problem)


def _check_stages(args: argparse.Namespace, setup: Setup) -> None:
    """MP or PP with more GPUs than the model has decoder layers (some stage would hold none), refused as train
    refuses it, so that no estimate is made of a job that cannot start: a recipe's in train's own words."""
    from shardtune.config.loading import key_origins
    from shardtune.config.validation import stage_problems, too_many_stages
    from shardtune.hub import config_num_layers, num_layers

    if not setup.splits_layers:
        return
    found = _model_number(args.model, config_num_layers, num_layers)
    if args.config:
        problems = stage_problems(setup.config, key_origins(config_argv(args.config)), found)
    else:
        gpus = "--num-gpus" if setup.num_nodes == 1 else "--num-gpus x --num-nodes"
        problem = too_many_stages(setup.strategy, setup.world_size, found, f"--strategy {setup.strategy}",
                                  args.model, "GPU", f"use {{layers}} GPUs or fewer ({gpus}), or FSDP or DDP")
        problems = [problem] if problem else []
    if problems:
        raise UsageError(problems[0])


def _trace(model: str, report: Report, gpu: Gpu) -> dict:
    """--trace: the traced peak of the setup the report settled on, with the formula's beside it."""
    from shardtune.memory.trace_setup import trace_for_estimate

    breakdown = report.breakdown
    return trace_for_estimate(model, breakdown.setup, breakdown.total, gpu_memory=gpu.memory_bytes,
                              cuda_context=breakdown.cuda_context)


def _print_tables(report: Report, timed: TimeReport | None, extras: dict) -> None:
    """The tables for people: the report, the time and cost, the trace, the batch found, the recipe written."""
    from rich.console import Console

    from shardtune.memory.report import render

    console = Console()
    render(report, console)
    if timed:
        from shardtune.memory.report import render_time

        render_time(report, timed, console)
    if "trace" in extras:
        from shardtune.memory.trace_setup import render_text

        print(render_text(extras["trace"], extras["trace"]["formula_peak_bytes"]))
    if "batch_plan" in extras:
        bp = extras["batch_plan"]
        steps = bp["gradient_accumulation_steps"]
        print(f"batch: micro-batch {bp['micro_batch_size']} per GPU x {steps} accumulation "
              f"step{'s' if steps != 1 else ''} = global batch {bp['global_batch_size']} (asked "
              f"{bp['requested_global_batch_size']}; {_most_that_fits(bp)})")
    job = report.breakdown.setup
    if "emitted_config" in extras:
        data = job.config.data.dataset_name
        first = "set dataset_name, then: " if data in (None, DATASET_PLACEHOLDER) else ""
        print(f"wrote {extras['emitted_config']} ({first}{train_command(job, extras['emitted_config'])})")
    elif job.loss == "shardtune" and report.breakdown.fits(report.gpu.memory_bytes):  # the recipe --emit-config writes
        accumulation = job.gradient_accumulation_steps
        steps = f" x {accumulation} accumulation steps" if accumulation > 1 else ""
        console.print(f"to train it: add --emit-config FILE.yaml, which writes {job.label()} at micro-batch "
                      f"{job.batch_size}{steps} as a 'shardtune train' recipe")


def _most_that_fits(plan: dict) -> str:
    """--find-batch-size's largest micro-batch, in words (the search stops at MAX_BATCH, which is no limit), and
    the largest with more to spare than the estimate's error where that is smaller."""
    from shardtune.memory.formula import MEASURED_ERROR
    from shardtune.memory.recommend import MAX_BATCH

    largest, roomy = plan["largest_fitting_micro_batch"], plan["roomy_micro_batch"]
    text = (f"{largest} or more fit per GPU: the search stops there" if largest >= MAX_BATCH
            else f"at most {largest} fits per GPU")
    if roomy == largest:
        return text
    return text + (f", {roomy} with more to spare than the estimate's error ({MEASURED_ERROR:.1%})" if roomy else
                   f", none with more to spare than the estimate's error ({MEASURED_ERROR:.1%}): tight")


def train_command(setup: Setup, recipe: str) -> str:
    """The command that runs an emitted recipe: shardtune train starts one process (MP drives its GPUs from it),
    shardtune launch the others; on several machines, run on each with its rank and the main machine's address,
    which launch needs and the recipe cannot know."""
    if setup.strategy.drives_several_devices or setup.world_size == 1:
        return f"shardtune train {recipe}"
    if setup.num_nodes == 1:
        return f"shardtune launch --num_processes {setup.world_size} train {recipe}"
    others = "1" if setup.num_nodes == 2 else f"1 to {setup.num_nodes - 1}"
    return (f"on each of the {setup.num_nodes} machines: shardtune launch --num_processes {setup.world_size} "
            f"--num_machines {setup.num_nodes} --machine_rank RANK --main_process_ip ADDRESS train {recipe}, RANK "
            f"0 on the main machine and {others} on the others, ADDRESS the main machine's")


def _write_plots(plot: str, report: Report, timed: TimeReport | None) -> None:
    from shardtune.memory.plot import write_plot

    print(f"wrote {write_plot(report, plot)}", file=sys.stderr)
    if timed:
        from shardtune.memory.report import write_time_plot

        print(f"wrote {write_time_plot(report, timed, time_plot_path(plot))}", file=sys.stderr)


def time_plot_path(plot: str) -> Path:
    """--time's picture, beside --plot's: FILE-time.png."""
    path = Path(plot)
    return path.with_name(path.stem + "-time.png")
