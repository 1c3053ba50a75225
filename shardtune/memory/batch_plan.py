"""``--find-batch-size`` and ``--emit-config``: the largest micro-batch that fits, and a config to run it.

The micro-batch is searched with the analytic estimator (instant): the largest that leaves more to spare than the
estimate's mean error on measured peaks (``MEASURED_ERROR``), or, where none does, the largest that fits at all
(the report then says tight). Gradient accumulation then restores the global batch the command line asked for
(``--batch-size`` x ``--gradient-accumulation-steps`` x GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from shardtune import catalog
from shardtune.errors import UsageError
from shardtune.hardware import GIB, Gpu
from shardtune.memory.setup import Setup


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int  # per device
    gradient_accumulation_steps: int
    global_batch_size: int  # micro x accumulation x world size
    requested_global_batch_size: int
    largest_fitting_micro_batch: int
    # the largest with more to spare than the estimate's error (0: none), what the plan takes where there is one
    roomy_micro_batch: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def applied_to(self, setup: Setup) -> Setup:
        """``setup`` at this plan's micro-batch and accumulation."""
        return setup.with_(per_device_train_batch_size=self.micro_batch_size,
                           gradient_accumulation_steps=self.gradient_accumulation_steps)


def plan_batch(largest_fitting: int, setup: Setup, roomy: int = 0) -> BatchPlan:
    """The micro-batch (at most ``roomy``, or ``largest_fitting`` where that is 0) and accumulation that keep the
    requested global batch:
    exactly, with a micro-batch that divides each rank's share and uses more than half of what fits; otherwise
    with the fewest accumulation steps that hold it, the share spread evenly over them (37 per GPU where 29 fit:
    2 x 19 = 38, not 2 x 29 = 58)."""
    # MP and PP split the layers, not the data: one batch goes through all their GPUs.
    world = 1 if setup.splits_layers else setup.world_size
    requested = setup.batch_size * setup.gradient_accumulation_steps * world
    per_rank = requested // world
    # PP with its micro-batch count given: the micro-batch stays a multiple of it (train refuses another), so the
    # plan is made in units of it.
    unit = setup.pipeline_microbatches if setup.strategy.pipelined and setup.pipeline_microbatches else 1
    share, most = per_rank // unit, max(1, (roomy or largest_fitting) // unit)
    cap = max(1, min(most, share))
    fewest = math.ceil(share / cap)
    exact = next((steps for steps in range(fewest, share + 1) if share % steps == 0 and share // steps * 2 > cap),
                 None)
    accumulation = exact or fewest
    micro = math.ceil(share / accumulation) * unit
    return BatchPlan(micro, accumulation, micro * accumulation * world, requested, largest_fitting, roomy)


def find_batch_size(model: str, setup: Setup, gpu: Gpu, *, recipe: bool = False) -> BatchPlan:
    """The batch plan for ``setup`` on ``gpu``; a UsageError when not even one sequence per GPU fits, naming what
    else to try as options, or as recipe keys where the setup came from ``--config`` files (``recipe``)."""
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.recommend import evaluate_setup, max_batch_size

    analysis = analysis_for(model, setup.config)
    # Searched without accumulation first: accumulating keeps each micro-batch's gradients until the optimizer step,
    # so a plan that accumulates is made again from what fits while they are kept (45 fit alone, 42 accumulating).
    alone = setup.with_(gradient_accumulation_steps=1)
    largest, roomy = max_batch_size(analysis, alone, gpu), max_batch_size(analysis, alone, gpu, roomy=True)
    if largest and plan_batch(largest, setup, roomy).gradient_accumulation_steps > 1:
        accumulating = setup.with_(gradient_accumulation_steps=2)
        largest = max_batch_size(analysis, accumulating, gpu)
        roomy = max_batch_size(analysis, accumulating, gpu, roomy=True)
    if largest == 0:
        one = evaluate_setup(analysis, setup.with_(per_device_train_batch_size=1))
        need = (f"it needs {one.total / GIB:.2f} GiB and {one.cuda_context / GIB:.2f} GiB of CUDA context, against "
                f"{gpu.memory_bytes / GIB:.2f} GiB")
        fix = ("the CUDA context alone takes more than the card has" if one.cuda_context >= gpu.memory_bytes
               else _what_else(setup, recipe))
        raise UsageError(f"--find-batch-size: not even a micro-batch of 1 fits a {gpu.name} with {setup.label()}: "
                         f"{need}; {fix}")
    return plan_batch(largest, setup, roomy)


def _what_else(setup: Setup, recipe: bool) -> str:
    """What would make a step smaller, of what ``setup`` does not do already: estimate's options, or the recipe's
    keys (``recipe``)."""
    said = {"ckpt": "gradient_checkpointing true", "lora": "use_peft_lora true (or QLoRA's use_4bit_quantization)",
            "qlora": "use_4bit_quantization true", "offload": "fsdp_offload_params true",
            "gpus": "more processes (num_processes) with distributed_type FSDP (each holds a shard)",
            "seq": "a shorter max_seq_len"} if recipe else {
        "ckpt": "--gradient-checkpointing", "lora": "--method lora or qlora", "qlora": "--method qlora",
        "offload": "--offload-params", "gpus": "more GPUs with --num-gpus and --strategy FSDP (each holds a shard)",
        "seq": "a shorter --seq-len"}
    tries = []
    if not setup.gradient_checkpointing:
        tries.append(said["ckpt"])
    if setup.method != "qlora":
        tries.append(said["lora"] if setup.method == "full" else said["qlora"])
    if setup.strategy.shards_parameters and not setup.offload_params:
        tries.append(said["offload"])
    tries.append(said["gpus"])
    if setup.seq_len > 512:
        tries.append(said["seq"])
    return f"try {', '.join(tries[:-1])}{' or ' if len(tries) > 1 else ''}{tries[-1]}"


def emit_config(model: str, setup: Setup, path: str | Path) -> Path:
    """Write the ``shardtune train`` recipe of ``setup`` to ``path`` (flat YAML, written to a temp name first)."""
    from shardtune.config import save_resolved
    from shardtune.memory.trace_setup import config_from_setup

    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UsageError(f"--emit-config {path}: folder {path.parent} does not exist; create it or pick another path")
    cfg = config_from_setup(model, setup)
    if not Path(model).expanduser().exists() and (name := catalog.canonical(model)) in catalog.names():
        # A catalog name is shardtune's; the trainer loads the weights by their Hugging Face id (a variant's own).
        cfg.model.model_name_or_path = (model if catalog.variant_of(model) else
                                        catalog.metadata(name).get("hf_id") or name)
    save_resolved(cfg, path)
    return path
