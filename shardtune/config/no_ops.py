"""Keys that recipes and Accelerate files carry and that change nothing in shardtune, with the values that would.

Every other accepted key acts (tests/test_key_vocabulary.py holds that). These are accepted, so copied recipes and
``accelerate config`` files load as they are, but only with values that mean nothing here: a value that would
change what runs (``use_cpu: true``, a TP size in ``parallelism_config``) is refused in one line naming the key and
what to use instead. docs/config.md lists them (scripts/gen_config_docs.py reads ``NO_OPS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from shardtune.config.keys import parse_bool


_UNSET_VALUES = (None, "", "none", "null")  # unset, as YAML files and command lines write it


def _unset(value: Any) -> bool:
    return value is None or str(value).strip().lower() in _UNSET_VALUES


def _word(value: Any) -> bool | None:
    """parse_bool's reading of ``value``, None where it is not a boolean word."""
    try:
        return parse_bool(value.strip() if isinstance(value, str) else value)
    except ValueError:
        return None


def off(value: Any) -> bool:
    """False, empty or unset, as YAML files and command lines write it."""
    if isinstance(value, (dict, list, tuple)):
        return all(off(v) for v in (value.values() if isinstance(value, dict) else value))
    return _unset(value) or _word(value) is False


@dataclass(frozen=True)
class Inert:
    """The values of a no-op key that change nothing (``test``), those values in words for the docs, and as
    YAML values for the recipe's JSON Schema (``values``: booleans, null and words in any case; None: any)."""
    test: Callable[[Any], bool]
    says: str
    values: tuple[Any, ...] | None = None

    def __call__(self, value: Any) -> bool:
        return self.test(value)


ANY = Inert(lambda _value: True, "any value")
OFF = Inert(off, "false or unset", (False, 0, "false", "no", "n", "off", "0", *_UNSET_VALUES))


# Whether the job being checked will see a GPU, where that is not this machine's answer: a cluster job checked on
# a login node (shardtune launch --slurm/--kubernetes) runs where its --gpus_per_node says. None: ask torch here.
_JOB_HAS_GPUS: ContextVar[bool | None] = ContextVar("job_has_gpus", default=None)


@contextmanager
def job_gpus(has_gpus: bool) -> Iterator[None]:
    """Check keys for a job that runs elsewhere, with GPUs or without (a cluster job's nodes)."""
    token = _JOB_HAS_GPUS.set(has_gpus)
    try:
        yield
    finally:
        _JOB_HAS_GPUS.reset(token)


def _gpu_visible() -> bool:
    """Whether the job will see a CUDA GPU: where none is, Accelerate's use_cpu true (which its MULTI_CPU files
    always carry) asks for what runs anyway. torch is imported only for that question, and only where the job
    runs here."""
    job = _JOB_HAS_GPUS.get()
    if job is not None:
        return job
    import torch

    return torch.cuda.is_available()


def _one_of(*words: str) -> Inert:
    return Inert(lambda value: off(value) or str(value).strip().lower() in words,
                 f"{', '.join(words)}, false or unset", (*words, *OFF.values))


# TRL's two keys for the trained tokens, which train_on_prompt decides here.
TRAINED_TOKEN_KEYS = ("assistant_only_loss", "completion_only_loss")
TRAINED_TOKENS = ("remove it: shardtune trains the assistant turns and completions, or every token with "
                  "train_on_prompt true (beside which false is accepted)")


UNSET = Inert(_unset, "unset", _UNSET_VALUES)
# unset, or PEFT's empty default (rank_pattern: {}, a written-out LoraConfig's)
EMPTY = Inert(lambda value: _unset(value) or value in ([], {}), "unset or empty", (*_UNSET_VALUES, [], {}))


def _zero_or_unset(value: Any) -> bool:
    try:
        return _unset(value) or float(value) == 0
    except (TypeError, ValueError):
        return False


ZERO_OR_UNSET = Inert(_zero_or_unset, "0 or unset", (0, 0.0, "0", *_UNSET_VALUES))


TRUE_OR_UNSET = Inert(lambda value: _unset(value) or _word(value) is True, "true or unset",
                      (True, 1, "true", "yes", "y", "on", "1", *_UNSET_VALUES))


def _sizes_one(value: Any) -> bool:
    """Accelerate's parallelism_config: every *_size is 1 (data parallel size aside, which the launch decides)."""
    if not isinstance(value, dict):
        return off(value)
    return all(str(v) in ("1", "None", "none") or k.startswith("parallelism_config_dp")
               for k, v in value.items() if k.endswith("_size"))


SIZES_ONE = Inert(_sizes_one, "every tp/cp size 1, or unset")
# Accelerate's use_cpu true where the job sees no GPU asks for what runs anyway.
NO_GPU_OR_OFF = Inert(lambda value: off(value) or not _gpu_visible(), "false or unset; true where the job sees no GPU")


def _dataset_kwargs_inert(value: Any) -> bool:
    """TRL's dataset_kwargs: skip_prepare_dataset (and its former append_concat_token) off; its former
    add_special_tokens at any value, as BOS is written once here either way."""
    if not isinstance(value, dict):
        return off(value)
    return off({name: entry for name, entry in value.items() if name != "add_special_tokens"})


@dataclass(frozen=True)
class NoOp:
    why: str  # what the key means elsewhere and why it changes nothing here
    inert: Inert = ANY  # the values that change nothing; others are refused
    instead: str = ""  # for a refused value: what to do instead
    # a refused value that asks for every token's loss: what it asks for (the message then names train_on_prompt,
    # which does it, not "shardtune does not do it")
    asks_for: str = ""


NO_OPS: dict[str, NoOp] = {
    # TrainingArguments / TRL
    "do_train": NoOp("read by example scripts, not by the trainer"),
    "do_eval": NoOp("read by example scripts; shardtune evaluates when eval_strategy says"),
    "prediction_loss_only": NoOp("Transformers' evaluation returning the loss alone (false also keeps logits for "
                                 "compute_metrics): evaluation here computes only the loss, whichever it says"),
    "remove_unused_columns": NoOp("shardtune reads only the columns its data format needs"),
    "model_revision": NoOp("TRL's hub revision of the model: shardtune loads model_name_or_path as it is (the hub's "
                           "main)", _one_of("main"), "download that revision into a folder (hf download NAME "
                           "--revision REV --local-dir DIR) and give the folder as model_name_or_path"),
    "assistant_only_loss": NoOp("TRL's loss on the assistant turns only, what shardtune trains unless "
                                "train_on_prompt is true", TRUE_OR_UNSET, TRAINED_TOKENS,
                                "TRL's loss on every token of a conversation"),
    "completion_only_loss": NoOp("TRL's loss on the completions only, what shardtune trains unless train_on_prompt "
                                 "is true", TRUE_OR_UNSET, TRAINED_TOKENS, "TRL's loss on the prompt too"),
    **{name: NoOp(f"{whose} task type: shardtune fine-tunes causal language models, PEFT's CAUSAL_LM",
                  _one_of("causal_lm"), "set it to CAUSAL_LM, or leave it out")
       for name, whose in (("lora_task_type", "TRL's PEFT"), ("task_type", "PEFT's"))},
    # PEFT's LoraConfig: what a written-out one holds loads; a value that would pick layers or ranks is refused with
    # the lora_target_modules regex that picks those layers, where there is one
    "layers_to_transform": NoOp("PEFT's adapters on the listed layers only", EMPTY,
                                "adapt those layers with a lora_target_modules regex that names them, e.g. "
                                "re:.*\\.layers\\.(0|1)\\..*\\.(q_proj|v_proj) for q_proj and v_proj of layers 0 "
                                "and 1"),
    "layers_pattern": NoOp("the name of the layer list layers_to_transform counts in", EMPTY,
                           "name the layers in a lora_target_modules regex instead, e.g. re:.*\\.h\\.(0|1)\\..*c_attn"),
    "exclude_modules": NoOp("PEFT's modules taken out of the targets", EMPTY,
                            "name only the modules to adapt in lora_target_modules, or give a regex that leaves the "
                            "others out, e.g. re:(?!.*\\.mlp\\.).*_proj (every *_proj outside the MLPs)"),
    **{name: NoOp(f"PEFT's {what} per module", EMPTY, f"every adapted module here has {key}: remove it, and set "
                  f"{key} to the one value you want")
       for name, what, key in (("rank_pattern", "ranks", "lora_r"), ("alpha_pattern", "alphas", "lora_alpha"))},
    "fan_in_fan_out": NoOp("PEFT's transposed weights, which PEFT sets true by itself on layers stored so (GPT-2's "
                           "Conv1D)", OFF, "leave it out: PEFT sets it where a layer needs it"),
    # Transformers' BitsAndBytesConfig (its 4-bit keys are keys here, or other names of them)
    **dict.fromkeys(("llm_int8_threshold", "llm_int8_has_fp16_weight"),
                    NoOp("read by 8-bit (LLM.int8) loading only; the 4-bit base here never reads it")),
    "llm_int8_enable_fp32_cpu_offload": NoOp("layers a device_map puts on the CPU, kept in fp32", OFF,
                                             "set fsdp_offload_params true to hold the weights in CPU memory"),
    "llm_int8_skip_modules": NoOp("modules the 4-bit load leaves unquantised", EMPTY,
                                  "the 4-bit base here quantises every linear layer but the output head; leave it "
                                  "out, or set use_4bit_quantization false to keep every layer unquantised"),
    "quant_method": NoOp("the quantisation library, bitsandbytes for QLoRA here (use_4bit_quantization)",
                         _one_of("bitsandbytes"), "QLoRA here loads the base with bitsandbytes: set it to "
                         "bitsandbytes, or leave it out"),
    # PEFT's examples/sft script's ModelArguments: their defaults (off, unset) are what runs here
    **dict.fromkeys(("use_loftq", "use_loftq_callback"),
                    NoOp("LoftQ initialisation of the adapters from a quantised base", OFF,
                         "LoftQ is not run here; init_lora_weights names the initialisations that are (true, "
                         "gaussian, pissa, olora): remove it")),
    "use_unsloth": NoOp("Unsloth's patched model and kernels", OFF,
                        "Unsloth is not run here (use_liger_kernel true fuses the loss and norms): remove it"),
    "tokenizer_name_or_path": NoOp("a tokenizer from elsewhere than the model", UNSET,
                                   "the tokenizer is read from model_name_or_path here: put its files in the model "
                                   "folder, or leave it out"),
    # TRL's ModelConfig (load_in_8bit) and PEFT's examples/sft script (use_8bit_quantization): false, their
    # default, is the unquantised base LoRA trains on here
    **dict.fromkeys(("load_in_8bit", "use_8bit_quantization"),
                    NoOp("8-bit loading of the frozen base (bitsandbytes' LLM.int8)", OFF,
                         "remove it: the quantised base here is 4-bit (load_in_4bit true, QLoRA)")),
    "peft_type": NoOp("PEFT's adapter type: shardtune trains LoRA (use_peft_lora)", _one_of("lora"),
                      "set it to LORA, or leave it out"),
    # TRL's SFTConfig: its defaults (and the values that mean them) are what runs here; another value is refused,
    # saying what runs
    "truncation_mode": NoOp("TRL's side of a too-long row that is kept: keep_start, its only value, as here (a row "
                            "keeps its first max_seq_len tokens)", _one_of("keep_start"),
                            "rows keep their first max_seq_len tokens here; leave it out"),
    "packing_strategy": NoOp("TRL's packing: bfd (best-fit decreasing, a too-long row truncated), how packing true "
                             "packs here", _one_of("bfd"), "packing true packs by best-fit decreasing here, a document "
                             "never split across rows; leave it out"),
    "loss_type": NoOp("TRL's loss: nll, the cross-entropy averaged over every target token of the global batch, the "
                      "loss here", _one_of("nll"), "the loss here is nll; leave it out"),
    "padding_free": NoOp("speed and memory only: packing true packs rows with no padding here, each document "
                         "attending only to itself; unpacked rows are padded to the longest of their batch"),
    "shuffle_dataset": NoOp("rows are shuffled every epoch here, by seed (packing sorts them by length first), so a "
                            "shuffle before training changes nothing"),
    "pad_to_multiple_of": NoOp("TRL's padding to a multiple (auto pads on AWS Neuron only); rows are padded to the "
                               "longest of their batch here", _one_of("auto"),
                               "rows are padded to the longest of their batch here (packed rows need none); leave it "
                               "out"),
    "router_aux_loss_coef": NoOp("the weight of a mixture-of-experts router's auxiliary loss, which is not added "
                                 "here (a model whose config sets output_router_logits is refused)", ZERO_OR_UNSET,
                                 "leave it out"),
    "pad_token": NoOp("TRL's deprecated pad token: the tokenizer's own is used here, or one set that is not EOS (so "
                      "EOS stays a target)", UNSET, "leave it out"),
    "dataset_kwargs": NoOp("TRL's dataset preparation ({skip_prepare_dataset: false}): rows are read from their "
                           "columns and tokenised here (data_format sets the format), each with the tokenizer's BOS "
                           "once, whatever TRL's former add_special_tokens entry says",
                           Inert(_dataset_kwargs_inert, "false or unset entries (add_special_tokens: any)"),
                           "rows are tokenised here from their text or chat columns (skip_prepare_dataset true is not "
                           "run); remove it, and give TRL's former append_concat_token entry as the key "
                           "append_concat_token (with packing)"),
    "dataset_streaming": NoOp("TRL's streamed reading of a hub data set", OFF,
                              "rows are read, tokenised and cached before training here: leave it out"),
    "ignore_bias_buffers": NoOp("TRL's scripts' fix for boolean buffers under DDP", OFF,
                                "set ddp_broadcast_buffers false, which stops DDP broadcasting any buffer"),
    "dataloader_num_workers": NoOp("speed only: rows are tokenised once, before training, and collated in-process"),
    **dict.fromkeys(("dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor"),
                    NoOp("speed only: batches are collated in-process, with no loader workers, and copied to the "
                         "device as they are")),
    "include_num_input_tokens_seen": NoOp("metrics.jsonl's train records always carry tokens_seen, the input "
                                           "tokens of every step so far (padding excluded), and tokens per step"),
    "logging_nan_inf_filter": NoOp("a non-finite loss stops the run with its step, so none is ever averaged in"),
    "average_tokens_across_devices": NoOp(
        "Transformers' loss over the target tokens of every process's batch, what shardtune always computes (over "
        "every micro-batch of every process)", TRUE_OR_UNSET, "remove it: the loss here is always the mean over the "
        "whole global batch's target tokens, so it does not change with the number of processes"),
    "dataloader_drop_last": NoOp(
        "leaving out an incomplete last batch, what shardtune does: each epoch leaves out the rows past its last "
        "whole global batch (they come back, in another order, next epoch)", TRUE_OR_UNSET,
        "remove it: every step here trains a whole global batch, whatever the processes; to use every row each "
        "epoch, make per_device_train_batch_size x gradient_accumulation_steps x processes divide the rows"),
    # Accelerate config files
    "compute_environment": NoOp("where Accelerate runs", _one_of("local_machine"),
                                "launch on the cluster with shardtune launch (--slurm / --kubernetes)"),
    "debug": NoOp("Accelerate's collective-shape checks; shardtune names a stuck rank on a timeout itself"),
    "main_training_function": NoOp("Accelerate's notebook launcher"),
    "downcast_bf16": NoOp("TPU-only", _one_of("no"), "shardtune does not run on TPUs"),
    "same_network": NoOp("a hint for Accelerate's multi-machine set-up"),
    "enable_cpu_affinity": NoOp("speed only (NUMA pinning)"),
    **{name: NoOp(what, OFF, "shardtune does not run on TPUs") for name, what in (
        ("tpu_env", "TPU-only"), ("tpu_use_cluster", "TPU-only"), ("tpu_use_sudo", "TPU-only"),
        ("tpu_name", "TPU-only"), ("tpu_zone", "TPU-only"), ("commands", "TPU pod commands"),
        ("command_file", "TPU pod commands"))},
    "use_cpu": NoOp("Accelerate's switch to the CPU", NO_GPU_OR_OFF,
                    "hide the GPUs instead: CUDA_VISIBLE_DEVICES= shardtune train ... (a cluster job: "
                    "--gpus_per_node 0)"),
    # gpu_ids 0 is GPU 0 alone, not false: only all (or nothing) leaves every GPU in use
    "gpu_ids": NoOp("which GPUs Accelerate uses", Inert(lambda value: _unset(value) or str(value).strip().lower()
                                                        == "all", "all, or unset", ("all", *_UNSET_VALUES)),
                    "choose them with CUDA_VISIBLE_DEVICES=0,1"),
    "megatron_lm_config": NoOp("Megatron-LM", OFF, "shardtune does not run Megatron-LM: remove it"),
    "ipex_config": NoOp("Intel Extension for PyTorch", OFF, "remove it"),
    "mpirun_config": NoOp("mpirun launching", OFF, "launch with shardtune launch (torchrun)"),
    "fp8_config": NoOp("FP8 training", OFF, "shardtune trains in bf16, fp16 or fp32: remove it"),
    "parallelism_config": NoOp("tensor/context parallel sizes", SIZES_ONE,
                               "shardtune runs data parallel, FSDP, MP and PP: set tp/cp sizes to 1 or remove it"),
    "fsdp_use_orig_params": NoOp("FSDP1's flat parameters; FSDP2 keeps every parameter itself, whatever the value"),
    "fsdp_offload_optimizer": NoOp("FSDP2 offloads the optimizer step with the parameters", OFF,
                                   "set fsdp_offload_params true, which offloads both"),
}


def no_op_problem(key: str, value: Any) -> str | None:
    """Why ``key: value`` is refused (a value of a no-op key that would change what runs), or None."""
    entry = NO_OPS[key]
    if entry.inert(value):
        return None
    if entry.asks_for:
        return (f"{key}={value!r} asks for {entry.asks_for}, which shardtune trains with train_on_prompt true "
                f"(it trains the assistant turns and completions unless that is set): set that instead")
    return f"{key}={value!r} would change what runs ({entry.why}), and shardtune does not do it: {entry.instead}"


# Transformers' TrainingArguments keys with no counterpart here (config/loading.py's OTHER_TOOLS_KEYS and
# UNKNOWN_ELSEWHERE), at the value a TrainingArguments left at its defaults holds (transformers 5.24,
# ``TrainingArguments(output_dir=...).to_dict()``; tests/test_key_vocabulary.py checks them against the installed
# one). A recipe written out from a TrainingArguments or an SFTConfig holds every one of them: at that value each
# asks for what Transformers does when it is not set, which is what runs here or changes nothing here (no label
# smoothing, the data resumed where it stopped, evaluation metrics off, logging on rank 0), so it loads; any other
# value is refused, with what to do instead.
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "accelerator_config": {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                           "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None},
    "auto_find_batch_size": False,
    "batch_eval_metrics": False, "bf16_full_eval": False, "data_seed": None, "dataloader_in_order": True,
    "dataloader_multiprocessing_context": None, "ddp_backend": None, "do_predict": False,
    "enable_jit_checkpoint": False, "eval_accumulation_steps": None, "eval_do_concat_batches": True,
    "eval_use_gather_object": False, "fp16_full_eval": False, "fsdp": None, "fsdp_config": None,
    "hub_always_push": False, "hub_revision": None, "ignore_data_skip": False, "include_for_metrics": [],
    "label_names": None, "label_smoothing_factor": 0.0, "length_column_name": "length", "liger_kernel_config": None,
    "local_rank": -1, "log_level_replica": "warning", "log_on_each_node": True, "optim_args": None,
    "optim_target_modules": None,
    "restore_callback_states_from_checkpoint": False, "save_on_each_node": False, "save_only_model": False,
    "skip_memory_metrics": True, "trackio_bucket_id": None, "trackio_space_id": None,
    "trackio_static_space_id": None, "train_sampling_strategy": "random", "use_cache": False,
}


def at_transformers_default(key: str, value: Any) -> bool:
    """Whether ``key: value`` is a TRANSFORMERS_DEFAULTS key at Transformers' default, as YAML files and command
    lines write it (null, '' or [] for an unset default; true/false words; numbers as text)."""
    if key not in TRANSFORMERS_DEFAULTS:
        return False
    default = TRANSFORMERS_DEFAULTS[key]
    if default is None or default == []:
        return _unset(value) or value == [] or value == {}
    if isinstance(default, bool):
        return _word(value) is default
    if isinstance(default, (int, float)):
        try:
            return not isinstance(value, bool) and float(value) == default
        except (TypeError, ValueError):
            return False
    if isinstance(default, str):
        return isinstance(value, str) and value.strip().lower() == default
    return value == default
