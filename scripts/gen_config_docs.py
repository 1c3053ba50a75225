"""Write docs/config.md: every key of shardtune.config.TrainConfig with its section, type and default.

    .venv/bin/python scripts/gen_config_docs.py          # rewrite docs/config.md
    .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is out of date

Keys, types and defaults come from the dataclasses themselves, so they cannot drift; tests/test_docs_config.py
fails when the file differs from what this script writes. Descriptions come from DESCRIPTIONS below, else from
the comment beside the field in shardtune/config/schema.py (or shardtune/data/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC_PATH = ROOT / "docs" / "config.md"

DESCRIPTIONS = {
    "model_name_or_path": "Local model folder (config.json + weights + tokenizer) or a hub name.",
    "attn_implementation": "Attention kernel: sdpa, eager, flash_attention_2, flash_attention_3.",
    "use_flash_attn": "Use flash_attention_2 when installed and on CUDA; sdpa otherwise, with a warning.",
    "trust_remote_code": "Run a model's own Python code from its folder. Off unless you trust the model.",
    "torch_dtype": "TRL's model dtype: auto or float32 (unset) train fp32 weights under mixed precision; bfloat16 "
                   "trains pure bf16: weights, gradients and AdamW moments in bf16, no fp32 master (half the "
                   "optimizer memory), updates stochastically rounded so small steps are kept, FSDP reducing "
                   "gradients in bf16, final/ saved in bf16. With LoRA the base and the adapters are bf16. Runs "
                   "adamw_torch/adamw_torch_fused with every distributed_type; float16 is refused (use fp16 mixed "
                   "precision).",
    "dtype": "Transformers 5's name for torch_dtype; give one of the two (different values are refused).",
    "dataset_name": "A JSONL/JSON/Parquet/CSV file or folder, a saved `datasets` folder, or a hub name.",
    "dataset_config_name": "The hub data set's configuration (subset).",
    "splits": "Comma-separated split names; names containing `train` train, the others evaluate.",
    "dataset_text_field": "The column of raw-text rows.",
    "data_format": "The row format; auto looks at the first row.",
    "chat_template_format": "none (the tokenizer's own template), chatml, llama-3, mistral, alpaca, zephyr.",
    "add_special_tokens": "Add the named template's special tokens to the tokenizer (and resize the embeddings).",
    "append_concat_token": "When packing, end every document with EOS if it does not already.",
    "max_seq_len": "Tokens per row; longer examples are truncated, packed rows are filled up to it.",
    "packing": "Pack several examples into each row (attention never crosses examples).",
    "group_by_length": ("Unpacked rows: each global batch holds rows of about one length, longest first, so "
                        "micro-batches carry less padding; the batches stay the same for any world size and "
                        "accumulation, and resume exactly (packing must be false)."),
    "train_on_prompt": "Also compute the loss on system/user/prompt tokens, not only on the answers.",
    "eval_split_ratio": "Hold out this fraction of the train rows for eval when there is no eval split.",
    "dataset_num_proc": "Processes that tokenise (unset: one).",
    "skip_bad_rows": "Drop malformed rows and count them instead of stopping at the first.",
    "use_peft_lora": "Train LoRA adapters (PEFT) on a frozen base instead of every weight.",
    "lora_r": "LoRA rank.",
    "lora_alpha": "LoRA scaling numerator (the update is scaled by alpha / r).",
    "lora_dropout": "Dropout on the LoRA input.",
    "lora_target_modules": ("all-linear; comma-separated module names (q_proj,v_proj: each matches a module whose "
                            "name ends with it); or `re:` and a regular expression that must match a module's whole "
                            "name (PEFT's regex form), e.g. `re:.*layers\\.[0-3]\\..*(q_proj|v_proj)`."),
    "use_dora": ("DoRA (Liu et al. 2024): a trained magnitude per output feature of each adapted layer; sharded "
                 "by FSDP with its layer, saved in checkpoints and final/, folded in by merge."),
    "use_rslora": "rsLoRA: scale the update by lora_alpha / sqrt(r) instead of lora_alpha / r.",
    "lora_modules_to_save": ("Modules trained in full beside the adapters and saved in the adapter (PEFT's "
                             "modules_to_save), e.g. lm_head or embed_tokens; a list or comma-separated names."),
    "init_lora_weights": ("true (A random, B zero), false (both random: for tests), gaussian, pissa or "
                          "pissa_niter_N (A, B from the base's top singular vectors), olora (from a QR of the base). "
                          "PiSSA/OLoRA change the base: final/ and export hold the equivalent plain adapter of rank "
                          "2r for the unmodified base. Not with use_4bit_quantization, use_dora or PP."),
    "lora_bias": ("PEFT's bias: none, all (every bias of the model trains) or lora_only (the biases of adapted "
                  "layers); trained biases are saved in the adapter. PEFT's boolean lora_bias is refused."),
    "use_4bit_quantization": "QLoRA: load the frozen base in 4 bits (bitsandbytes); needs use_peft_lora.",
    "bnb_4bit_quant_type": "The 4-bit data type.",
    "use_nested_quant": "Double quantisation of the quantisation constants (QLoRA paper, section 3).",
    "bnb_4bit_compute_dtype": "The dtype 4-bit weights are dequantised to for the matmuls.",
    "bnb_4bit_quant_storage_dtype": "Storage dtype of the packed 4-bit weights; bf16 lets FSDP shard them with the "
                                    "rest.",
    "learning_rate": "Peak learning rate.",
    "optim": "Transformers' optimizer name, run as Transformers runs it: adamw_torch(_fused) is torch's AdamW "
             "(fused on CUDA); adamw_8bit/adamw_bnb_8bit, paged_adamw_8bit, paged_adamw_32bit, lion_8bit, "
             "lion_32bit, paged_lion_8bit, paged_lion_32bit are bitsandbytes' (paged ones need CUDA; under FSDP "
             "each rank steps its shard); adafactor is Transformers' Adafactor (not with FSDP); sgd is torch's SGD "
             "without momentum. State bytes per weight: docs/estimator.md.",
    "lr_scheduler_type": "The learning-rate schedule after warm-up.",
    "warmup_ratio": "Fraction of the steps spent warming up (warmup_steps wins when set).",
    "warmup_steps": "Steps of linear warm-up.",
    "weight_decay": "Weight decay of the matrices (biases and norms are not decayed), for every optimizer.",
    "max_grad_norm": "Clip the global gradient norm to this (0: no clipping).",
    "adam_beta1": "AdamW's and Lion's beta1; refused with adafactor and sgd, which have none.",
    "adam_beta2": "AdamW's and Lion's beta2; refused with adafactor and sgd, which have none.",
    "adam_epsilon": "AdamW's epsilon; refused with Lion, adafactor and sgd, which have none.",
    "output_dir": "Where metrics.jsonl, config.yaml, checkpoints/ and final/ go.",
    "overwrite_output_dir": ("A folder holding an earlier run is refused unless resuming; true deletes that run's "
                             "files (checkpoints/, final/, metrics.jsonl, ...) first."),
    "seed": "Seeds data order, LoRA initialisation and dropout.",
    "num_train_epochs": "Epochs to train when max_steps is -1.",
    "max_steps": "Optimizer steps to train; -1 trains num_train_epochs.",
    "per_device_train_batch_size": "Rows per micro-batch per process.",
    "per_device_eval_batch_size": "Rows per eval batch per process.",
    "gradient_accumulation_steps": "Micro-batches per optimizer step; the loss is normalised over all of them.",
    "gradient_checkpointing": "Recompute activations in the backward pass: less memory, about a third more compute.",
    "use_reentrant": "Use the reentrant checkpointing implementation (PyTorch's older one).",
    "activation_offloading": "Keep the input each checkpointed decoder layer saves (batch x seq x hidden per layer) "
                             "in pinned CPU memory: copied on a side CUDA stream while the forward goes on, brought "
                             "back one layer ahead in backward. The GPU holds about two layers' inputs instead of "
                             "all; host RAM holds the rest. Needs gradient_checkpointing (refused without it). "
                             "torchtune's name (enable_activation_offloading).",
    "use_liger_kernel": "Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) patched into the model on CUDA; needs "
                        "`pip install liger-kernel` (or `shardtune[liger]`). On a CPU: a warning and transformers' "
                        "modules. The loss stays shardtune's fused one (no logits kept). TRL's key.",
    "bf16": "bf16 mixed precision (fp32 master weights). Unset: on where the hardware computes bf16 natively (CUDA "
            "compute capability 8.0+, CPUs with AVX512-BF16 or AMX), off elsewhere; the run prints its choice and why, "
            "and config.yaml records it. false opts out (fp32); true where the hardware only emulates bf16 runs as "
            "asked, with a warning that fp32 is faster there. A LoRA base is stored in bf16 (no fp32 copy), and "
            "under autocast its embeddings' output is cast up to fp32, so the residual stream runs in fp32 as with "
            "fp32 weights.",
    "fp16": "fp16 mixed precision with a gradient scaler.",
    "torch_compile": "Compile each decoder layer with torch.compile (its forward, checkpointing included; FSDP2's "
                     "hooks stay outside), the sequence length dynamic so packed batches do not recompile; the "
                     "count of compilations and recompilations is logged at the end and written to summary.json. "
                     "If the backend cannot compile (no C++ compiler, a backend error), one warning and the run goes "
                     "on eager. Off by default: on a CPU it did not pay for a real model "
                     "(docs/choosing-a-setup.md, 'torch_compile: when it pays'). Accelerate's `dynamo_config` / `dynamo_backend` / `dynamo_mode` set this and the "
                     "two keys below (NO: off); `dynamo_use_dynamic` and `dynamo_use_regional_compilation` are "
                     "accepted (compilation is always per layer, dynamic); `dynamo_use_fullgraph: true` is refused.",
    "torch_compile_backend": "The torch.compile backend (inductor, aot_eager, eager, cudagraphs, or one registered "
                             "in the process); setting it turns torch_compile on. Unset: inductor.",
    "torch_compile_mode": "inductor's mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, "
                          "lite; setting it turns torch_compile on.",
    "logging_steps": "Write a metrics.jsonl record every this many steps.",
    "logging_strategy": "When to write metrics.jsonl records.",
    "log_level": "Log level of rank 0 (passive: info); the other ranks log warnings only.",
    "eval_strategy": "When to evaluate: every eval_steps, at the end of each epoch, or never.",
    "eval_steps": "Evaluate every this many steps (unset: logging_steps).",
    "eval_on_start": "Evaluate once before the first step, as a baseline (it takes no part in early stopping).",
    "early_stopping_patience": ("Stop when metric_for_best_model has not improved for this many evaluations "
                                "(the run then finishes as usual: final/ is written, exit 0)."),
    "early_stopping_threshold": "How much an evaluation must beat the best one by to count as an improvement.",
    "neftune_noise_alpha": ("NEFTune: uniform noise of +-alpha/sqrt(seq_len x hidden) on the input embeddings "
                            "while training (the paper uses 5); none in evaluation and generation."),
    "report_to": ("Experiment trackers that get every metrics.jsonl record (at its step) and this config, on rank 0: "
                  "tensorboard, wandb, mlflow, trackio, a list of them (comma-separated on the command line), "
                  "all (every installed one) or none. A tracker whose package is missing is refused at start "
                  "(pip install 'shardtune[trackers]'). None needs the network: wandb runs offline in "
                  "output_dir/wandb unless WANDB_MODE or credentials say otherwise; mlflow writes a file store "
                  "in output_dir/mlruns unless MLFLOW_TRACKING_URI is set; trackio its local store "
                  "(TRACKIO_DIR); tensorboard event files in output_dir/tensorboard/RUN_NAME."),
    "run_name": "The run's name in every report_to tracker (default: the output_dir's folder name).",
    "ddp_timeout": "Seconds a collective may wait before the run stops, naming the rank and operation.",
    "dry_run": "Print the resolved config, trace one step of the job it describes on fake tensors (per-GPU peak: "
               "tensors and reserved memory, by category and module), and exit without training.",
    "push_to_hub": "Accepted so recipes run unchanged; acts only where the hub is reachable.",
    "hub_model_id": "Accepted so recipes run unchanged; acts only where the hub is reachable.",
    "hub_token": "Accepted so recipes run unchanged; acts only where the hub is reachable.",
    "hub_private_repo": "Accepted so recipes run unchanged; acts only where the hub is reachable.",
    "callbacks": "Your callback classes, package.module:Class (a YAML list, or comma-separated on the command "
                 "line); every process makes its own, with no arguments. See docs/callbacks.md.",
    "hub_strategy": "When push_to_hub uploads: end, the final model once, after training (Transformers' every_save, "
                    "checkpoint and all_checkpoints are refused).",
    "save_strategy": "When to save a resumable checkpoint: every save_steps, each epoch, or never.",
    "save_steps": "Save a resumable checkpoint every this many steps.",
    "save_total_limit": ("Keep at most this many checkpoints (oldest deleted first); the best one is kept beyond "
                         "it with load_best_model_at_end."),
    "load_best_model_at_end": ("Write final/ from the best checkpoint by metric_for_best_model, not the last step "
                               "(needs save_strategy equal to eval_strategy, save_steps a multiple of eval_steps)."),
    "metric_for_best_model": "The eval metric that picks the best checkpoint: eval_loss (default) or eval_perplexity.",
    "greater_is_better": "Whether a larger metric is better (default: false for a loss or perplexity).",
    "resume_from_checkpoint": "A checkpoint folder, or true for the newest complete one in output_dir.",
    "distributed_type": "How processes share the work (Accelerate's MULTI_GPU / MULTI_CPU mean DDP); unset: DDP "
                        "when launched on several processes.",
    "fsdp_sharding_strategy": "What FSDP shards (FSDP1's numbers 1-5 are accepted too); see "
                              "docs/choosing-a-setup.md.",
    "fsdp_offload_params": "Keep parameters, gradients and optimizer states in CPU memory.",
    "fsdp_auto_wrap_policy": "What becomes one FSDP unit (gathered and freed together).",
    "fsdp_transformer_layer_cls_to_wrap": "Class name of the unit to wrap (default: the model's decoder layer).",
    "fsdp_min_num_params": "SIZE_BASED_WRAP: parameters per unit.",
    "fsdp_cpu_ram_efficient_loading": "Only rank 0 reads the weights (into CPU RAM, as every FSDP rank does: "
                                      "each GPU only ever holds its shards); the others build on the meta device "
                                      "and receive them. Not with QLoRA: each rank quantises its own copy in CPU "
                                      "RAM.",
    "fsdp_sync_module_states": "Broadcast rank 0's weights so every rank starts identical.",
    "fsdp_state_dict_type": "Checkpoints: each rank writes its shard (SHARDED) or rank 0 writes all (FULL).",
    "fsdp_reshard_after_forward": "FSDP2's name; overrides what the sharding strategy implies.",
    "fsdp_activation_checkpointing": "Checkpoint every wrapped unit (Accelerate's key; same as "
                                     "gradient_checkpointing).",
    "fsdp_backward_prefetch": "BACKWARD_PRE (what FSDP2 does: the next unit is gathered before this one's "
                              "backward); BACKWARD_POST and NO_PREFETCH are refused.",
    "fsdp_forward_prefetch": "Gather the next decoder layer while this one runs forward (FSDP2's explicit forward "
                             "prefetch); needs TRANSFORMER_BASED_WRAP.",
    "fsdp_version": "2: shardtune runs FSDP2 (fully_shard); 1 (FSDP1's FullyShardedDataParallel) is refused.",
    "mixed_precision": "Accelerate's key; the bf16/fp16 flags win when set (bf16 false opts out of it); unset with "
                       "them, the hardware decides (see bf16).",
    "ddp_find_unused_parameters": "DDP's find_unused_parameters (true when some parameters get no gradient).",
    "logging_first_step": "Log the first step (shardtune's default; Transformers' is false).",
    "disable_tqdm": "No progress bar; log lines and metrics.jsonl are unchanged.",
    "save_safetensors": "Weights are written as safetensors; false (pickled .bin files) is refused.",
    "deepspeed": ("A DeepSpeed config JSON (Transformers/TRL's --deepspeed), mapped onto FSDP2 and printed at "
                  "start; what cannot be mapped is refused (docs/deepspeed.md)."),
    "num_processes": "Processes over all machines (set by shardtune launch).",
    "num_machines": "Machines in the job (set by shardtune launch).",
    "machine_rank": "This machine's rank, 0 on the main one.",
    "main_process_ip": "Address of machine rank 0.",
    "main_process_port": "Port of the rendezvous on machine rank 0.",
    "rdzv_backend": "static, or c10d (elastic rendezvous).",
    "predict_memory": "At the end, trace the job and record the predicted peak memory beside the measured one "
                      "(the environment variable SHARDTUNE_PREDICT_MEMORY=0 turns the default off).",
    "pipeline_schedule": "Pipeline parallel (PP): the schedule.",
    "pipeline_microbatches": "Pipeline parallel (PP): pipeline micro-batches each batch is split into.",
}

# Keys whose accepted values are a tuple in shardtune.config (or shardtune.data.config): listed from the code.
CHOICES = {"distributed_type": "DISTRIBUTED_TYPES", "fsdp_sharding_strategy": "SHARDING_STRATEGIES",
           "fsdp_auto_wrap_policy": "WRAP_POLICIES", "fsdp_state_dict_type": "STATE_DICT_TYPES",
           "mixed_precision": "MIXED_PRECISIONS", "lr_scheduler_type": "SCHEDULERS",
           "logging_strategy": "STRATEGIES_STEPS", "eval_strategy": "STRATEGIES_STEPS",
           "save_strategy": "STRATEGIES_STEPS", "log_level": "LOG_LEVELS", "pipeline_schedule": "PIPELINE_SCHEDULES",
           "data_format": "DATA_FORMATS", "optim": "ACCEPTED_OPTIMS", "hub_strategy": "HUB_STRATEGIES"}
_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def _source_comments(cls: type) -> dict[str, str]:
    """The ``# comment`` beside each field in the dataclass's source."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = _FIELD_COMMENT.match(line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def _type_name(hint: object) -> str:
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace(" | None", " or unset")


def _choices(key: str) -> str:
    import shardtune.config as config
    import shardtune.data.config as data_config

    name = CHOICES.get(key)
    values = getattr(config, name, None) or getattr(data_config, name, None) if name else None
    return f" One of: {', '.join(values)}." if values else ""


def _default_text(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def default_config():
    """``TrainConfig()`` as a user without SHARDTUNE_* environment variables gets it (some defaults read them)."""
    import os

    from shardtune.config import TrainConfig

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SHARDTUNE_")}
    try:
        return TrainConfig()
    finally:
        os.environ.update(saved)


def render() -> str:
    """docs/config.md as it should be for the code in this checkout."""
    cfg = default_config()
    out = ["# Configuration keys", "",
           "Every key `shardtune train` accepts, with its default. Generated by `scripts/gen_config_docs.py` from",
           "`shardtune.config.TrainConfig`; `tests/test_docs_config.py` fails when this file is out of date.", "",
           "Give keys in a YAML recipe (`key: value`), as `key=value` or as `--key value`; an Accelerate config",
           "file is read with `--config_file`. Precedence, lowest first: defaults < Accelerate config < YAML recipe",
           "< `key=value` < `--key value`. `shardtune train --help` prints the same list. Unknown keys are an error",
           "that names the closest known key.", ""]
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        comments = _source_comments(type(part))
        out += [f"## {section.name}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(part):
            text = (DESCRIPTIONS.get(f.name) or comments.get(f.name) or "(not documented yet)") + _choices(f.name)
            default = _default_text(getattr(part, f.name)).replace("|", "\\|")
            out.append(f"| `{f.name}` | {_type_name(f.type)} | `{default}` | {text.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out + _no_op_section())


def _no_op_section() -> list[str]:
    """The keys accepted from recipes and Accelerate files that change nothing here (shardtune/config/no_ops.py)."""
    from shardtune.config.no_ops import NO_OPS

    out = ["## Accepted, changing nothing", "",
           "Recipes and `accelerate config` files carry these; shardtune reads them and does nothing with them. A",
           "value that would change what runs is refused, naming what to do instead.", "",
           "| key | why it changes nothing | refused values |", "|---|---|---|"]
    for key, entry in NO_OPS.items():
        refused = entry.instead and f"anything else: {entry.instead}"
        out.append(f"| `{key}` | {entry.why} | {refused or '-'} |")
    return out + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is out of date: run .venv/bin/python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    tmp = DOC_PATH.with_name(DOC_PATH.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(DOC_PATH)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
