"""``shardtune train [CONFIG.yaml] [key=value ...] [--key value ...]``: supervised fine-tuning.

Keys are Transformers / TRL / PEFT / Accelerate names (``shardtune train --help`` lists them with defaults).
The recipe may also be given as TRL takes it, ``--config CONFIG.yaml``, or as a JSON file of the same keys, as
Transformers' example scripts take one (``args.json``; a DeepSpeed JSON goes in ``--deepspeed``). An Accelerate
config file is read as it is with ``--config_file``. Precedence, lowest first: defaults < Accelerate config <
recipe < the command line (key=value and --key value alike; one key given two different values there is refused).
Run it directly for one process, or under ``shardtune launch`` (torchrun) for DDP / FSDP2 on one or many machines.
"""

from __future__ import annotations

import argparse
import os
import sys

from shardtune.cli.common import (TRAIN_HELP, leave_out_bitsandbytes_unless, load_job_config, plain, print_config_notes,
                                  sigterm_raises)
from shardtune.errors import UsageError, first_line
from shardtune.strategies import resolve


def register(sub: argparse._SubParsersAction) -> None:
    # The keys are parsed by shardtune.config, not argparse (there are too many, and recipes pass them all).
    p = sub.add_parser("train", help="fine-tune a model (LoRA, QLoRA or full; 1 process, DDP, FSDP2, model or "
                                     "pipeline parallel)", description=__doc__, add_help=False)
    p.set_defaults(func=None)


def keys_help() -> str:
    """Every accepted key, by section: its type, default and what it does (its declaration's own words)."""
    import textwrap

    from shardtune.config.keys import shown
    from shardtune.config.schema import all_keys, published_defaults

    cfg, lines, section = published_defaults(), [__doc__.strip()], None
    for d in all_keys():
        if d.section != section:
            lines += ["", f"[{d.section}]"]
        section = d.section
        lines.append(f"  --{d.name} ({d.type_text()}, default {shown(getattr(getattr(cfg, d.section), d.name))})")
        lines += textwrap.wrap(d.described(), 110, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False, break_long_words=False)
    return plain("\n".join(lines))


def run(argv: list[str]) -> int:
    """Entry point of ``shardtune train`` (also what torchrun starts on every rank)."""
    if any(a in TRAIN_HELP for a in argv):
        print(keys_help())
        return 0
    from shardtune.cli.launch import die_with_launcher

    die_with_launcher()
    with sigterm_raises():  # until the training loop can answer it with a checkpoint
        return _run(argv)


def _run(argv: list[str]) -> int:
    from shardtune.hub import offline_unless_reachable

    # The run's own checks (placeholder data, missing paths, the resume folder) before any model is loaded.
    notes: list[str] = []
    cfg = load_job_config(argv, notes)
    refuse_processes_without_launcher(cfg, argv)
    from shardtune.bitsandbytes_use import needs_bitsandbytes

    leave_out_bitsandbytes_unless(lambda: needs_bitsandbytes(cfg))
    print_config_notes(notes, argv)
    offline_unless_reachable(cfg.model.model_name_or_path, None if cfg.run.dry_run else cfg.data.dataset_name)
    from shardtune.config.loading import placed

    if cfg.run.dry_run:
        import yaml

        from shardtune.memory.trace_setup import render_text, trace_or_formula

        print(yaml.safe_dump(cfg.to_flat(), sort_keys=False), end="")
        # Trace the job this config describes (two steps on fake tensors: the second holds the optimizer
        # states) instead of running it.
        world_size = int(os.environ.get("WORLD_SIZE", cfg.distributed.num_processes))
        nodes = cfg.distributed.num_machines if world_size % cfg.distributed.num_machines == 0 else 1
        try:
            print(render_text(trace_or_formula(cfg, world_size, num_nodes=nodes)))
        except UsageError as exc:  # found as the trace built the model: said where the key was set, as a run does
            raise placed(exc, argv) from None
        return 0
    from shardtune.cli.launch import report_finished, report_stop
    from shardtune.errors import EXIT_FAILED, EXIT_PREEMPTED, TrainingStopped
    from shardtune.train.loop import train

    rank = os.environ.get("RANK", "0")
    try:
        summary = train(cfg, job_callbacks(cfg), stage_bounds=job_stage_bounds(cfg))
    except UsageError as exc:  # found once the model loaded (a LoRA target it lacks): said where the key was set
        raise placed(exc, argv) from None
    except TrainingStopped as exc:
        if not getattr(exc, "quiet", False):  # a rank that died: the lowest survivor says it, once
            print(f"shardtune train: rank {rank}: stopped: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as exc:
        first, text = first_line(str(exc), type(exc).__name__), str(exc).lower()
        if "connection refused" in text or "connectfullmesh" in text:  # at once, not after ddp_timeout
            print(f"shardtune train: rank {rank}: could not connect to the other ranks ({first}). One of them "
                  f"ended or never started (read its messages above), or the rendezvous address is unreachable",
                  file=sys.stderr)
            return EXIT_FAILED
        if "timed out" not in text and "timeout" not in text:
            raise
        print(f"shardtune train: rank {rank}: a collective timed out after ddp_timeout={cfg.run.ddp_timeout} s "
              f"({first}). Another rank is stuck or died: read its messages above; if a step legitimately takes "
              f"longer, raise ddp_timeout", file=sys.stderr)
        return EXIT_FAILED
    if summary["stopped_by"] == "SIGTERM":
        report_stop(summary, f"shardtune train: stopped by SIGTERM at step {summary['steps']} of "
                             f"{summary['max_steps']}; checkpoint {summary['last_checkpoint']} saved and verified: "
                             f"run the same command with resume_from_checkpoint true to finish")
        return EXIT_PREEMPTED
    report_finished(summary)
    return 0


# What shardtune launch reads of a job's config to start its processes; their defaults start none.
LAUNCH_KEYS = ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend")


def refuse_processes_without_launcher(cfg, argv: list[str]) -> None:
    """Outside torchrun (no WORLD_SIZE), ``shardtune train`` starts no processes itself: num_processes above 1
    would run on one process, unlike the dry run and the estimate of the same recipe (MP drives its devices from
    one process), and the launcher's keys would place it in no job. Each refusal names where the key was set."""
    from shardtune.config.loading import key_origins
    from shardtune.config.schema import DistributedConfig

    d, defaults = cfg.distributed, DistributedConfig()
    if cfg.run.dry_run or "WORLD_SIZE" in os.environ:
        return
    if d.num_processes > 1 and not resolve(d.distributed_type, False).drives_several_devices:
        raise UsageError(f"{key_origins(argv).get('num_processes', 'config')}: num_processes={d.num_processes}: "
                         f"shardtune train runs one process; start "
                         f"{d.num_processes} with shardtune launch --num_processes {d.num_processes} train ..., or "
                         f"set num_processes 1")
    given = [name for name in LAUNCH_KEYS if getattr(d, name) != getattr(defaults, name)]
    if given:
        origins = key_origins(argv)
        where = "; ".join(dict.fromkeys(str(origins.get(name, "config")) for name in given))
        raise UsageError(f"{where}: {', '.join(f'{name}={getattr(d, name)}' for name in given)}: shardtune launch "
                         f"reads {'these' if len(given) > 1 else 'this'} to "
                         f"start a job's processes, and shardtune train alone starts none; run shardtune launch ... "
                         f"train ..., or leave {'them' if len(given) > 1 else 'it'} out")


def job_callbacks(cfg) -> list:
    """What the command adds to the loop: the end-of-run memory check, unless ``predict_memory`` is off."""
    if not cfg.run.predict_memory:
        return []
    from shardtune.memory.run_check import MemoryCheck

    return [MemoryCheck()]


def job_stage_bounds(cfg) -> tuple[tuple[int, int], ...] | None:
    """MP/PP: stages balanced by memory (the estimator's model-parallel plan), for the trainer to apply."""
    if not resolve(cfg.distributed.distributed_type, False).splits_layers:
        return None
    from shardtune.memory.stages import stage_bounds_for_run

    return stage_bounds_for_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
