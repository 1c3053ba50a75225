"""The training configuration's schema: one small typed section per concern, each key declared once.

Each field is a key: its annotation is its type (a ``Literal`` lists the values it accepts), its default is the
default, and ``key(default, what it does, bounds, other spellings, other tools' names)`` says the rest (``keys``).
Loading, checking, ``--help-keys``, docs/config.md and the recipe JSON Schema all read these declarations.

Names are the ones users know from Transformers' ``TrainingArguments``, TRL's ``SFTConfig``, PEFT and Accelerate's
config files, so a recipe carries over.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from shardtune.config.keys import Declared, declared, key
from shardtune.config.optimizers import NOT_RUN, OPTIMIZERS
from shardtune.strategies import NAMES, STRATEGIES

DistributedType = Literal[NAMES]  # the strategies' names (shardtune/strategies.py)
PipelineSchedule = Literal["GPipe", "1F1B"]
ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
WrapPolicy = Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
StateDictType = Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
MixedPrecision = Literal["bf16", "fp16", "no"]
TorchDtype = Literal["auto", "float32", "bfloat16"]  # float16 is refused: pure fp16 diverges without an fp32 master
Scheduler = Literal["linear", "cosine", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "cosine_with_restarts",
                    "polynomial", "inverse_sqrt", "warmup_stable_decay", "constant", "constant_with_warmup",
                    "reduce_lr_on_plateau"]
WsdShape = Literal["linear", "cosine", "1-sqrt"]  # Transformers' get_wsd_schedule's warm-up and decay curves
Every = Literal["steps", "epoch", "no"]
LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]
HubStrategy = Literal["end"]  # the final model is uploaded once, after training (train/run_end.py push_to_hub)
FsdpVersion = Literal[2]  # the trainer shards with FSDP2's fully_shard
DataFormat = Literal["auto", "chat", "prompt_completion", "alpaca", "text"]
# none: the tokenizer's own template; the others are data/templates.py's TEMPLATES (a test holds them equal).
ChatTemplateFormat = Literal["none", "chatml", "llama-3", "mistral", "alpaca", "zephyr"]
# The attention kernels the collator makes packed batches for (a block mask for sdpa and eager, documents'
# boundaries for flash attention).
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"]

# The values of the choice keys that other modules read (the estimator's, data/templates.py's test).
SHARDING_STRATEGIES, MIXED_PRECISIONS = get_args(ShardingStrategy), get_args(MixedPrecision)
CHAT_TEMPLATES = get_args(ChatTemplateFormat)
ATTN_IMPLEMENTATIONS = get_args(AttnImplementation)
# report_to: each experiment tracker, the module it imports and the PyPI package that provides it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow-skinny"), "trackio": ("trackio", "trackio")}
MAX_SEED = 2**32 - 1  # what numpy's and torch's generators take
# The data set that ``shardtune estimate --emit-config`` writes (memory/trace_setup.py): the user fills it in.
DATASET_PLACEHOLDER = "REPLACE_WITH_YOUR_DATASET"
STRATEGY_SPELLINGS = {alias: s.name for s in STRATEGIES for alias in s.aliases}  # Accelerate's MULTI_GPU -> DDP
# FSDP1's enum values, which older Accelerate files write as numbers; HYBRID_SHARD_ZERO2 (5) keeps gathered
# parameters inside the node like SHARD_GRAD_OP, which FSDP2 spells HYBRID_SHARD without resharding (a file that
# says it also gets fsdp_reshard_after_forward false: loading.read_yaml_recipe).
SHARDING_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "HYBRID_SHARD",
                    "HYBRID_SHARD_ZERO2": "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}
ZERO2_HYBRID = ("5", "HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2")
# Accelerate's FSDP1 files (1.6 on) write the sharding strategy under fsdp_reshard_after_forward, where FSDP2 reads
# a boolean: read as fsdp_sharding_strategy where the file is FSDP1's (loading._fsdp1_spellings); beside
# fsdp_version 2, refused naming the key that takes it (and FSDP2's boolean where one says the same).
FSDP1_RESHARD = {name: f"a sharding strategy, as Accelerate's FSDP1 files write it; here (FSDP2) {{key}} is true or "
                       f"false: write fsdp_sharding_strategy: {name}"
                       + {"FULL_SHARD": " (or {key}: true)", "SHARD_GRAD_OP": " (or {key}: false)"}.get(name, "")
                 for name in (*SHARDING_STRATEGIES, *ZERO2_HYBRID[1:])}
FLOAT16 = ("pure fp16 training diverges without an fp32 master copy (fp16's range overflows and small updates "
           "vanish); leave {key} out and set fp16 true for fp16 mixed precision, or use {key} bfloat16")
# YAML 1.1 (PyYAML) reads an unquoted no as false: for keys whose choices include "no", that is what was written.
NO = {"FALSE": "no"}
HUB = "Accepted so recipes run unchanged; acts only where the hub is reachable."
# The settings some keys act under only (``needs=``; validation.SWITCHES decides each).
LORA, QLORA, PACKING, CHECKPOINTING = ("use_peft_lora true", "use_4bit_quantization true", "packing true",
                                       "gradient_checkpointing true")
PP, MP, DDP_ONLY = "distributed_type PP", "distributed_type MP", "distributed_type DDP"
# The job's keys that shardtune launch passes to every rank from its own options (written before 'train').
LAUNCHER_SET = ("num_processes", "num_machines")
EVAL_STEPS, SAVE_STEPS = "eval_strategy steps", "save_strategy steps"
EVALUATES = "eval_strategy steps or epoch, or eval_on_start true"
EVALS_EVERY = "eval_strategy steps or epoch"
PUSH, TRACKER, TRACKIO = "push_to_hub true", "report_to naming a tracker", "report_to trackio"
# Every schedule but constant and reduce_lr_on_plateau warms up first (Transformers' get_scheduler hands each of
# them num_warmup_steps; the plateau's rate moves on evaluations only).
_WARMING = [name for name in get_args(Scheduler) if name not in ("constant", "reduce_lr_on_plateau")]
WARMS_UP = f"lr_scheduler_type {', '.join(_WARMING[:-1])} or {_WARMING[-1]}"
MIN_LR = "lr_scheduler_type cosine_with_min_lr or cosine_warmup_with_min_lr"
FLOOR = "lr_scheduler_type cosine_with_min_lr, cosine_warmup_with_min_lr or reduce_lr_on_plateau"
PLATEAU = "lr_scheduler_type reduce_lr_on_plateau"
WARMUP_LR = "lr_scheduler_type cosine_warmup_with_min_lr"
COSINES = ("lr_scheduler_type cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts or "
           "warmup_stable_decay")
POLYNOMIAL, INVERSE_SQRT = "lr_scheduler_type polynomial", "lr_scheduler_type inverse_sqrt"
WSD = "lr_scheduler_type warmup_stable_decay"
FSDP_ONLY, SIZE_WRAP = "distributed_type FSDP", "fsdp_auto_wrap_policy SIZE_BASED_WRAP"
TRANSFORMER_WRAP = "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP under distributed_type FSDP"
LOGS_STEPS = "logging_strategy steps (or eval_strategy steps without eval_steps)"
EARLY_STOPPING = "early_stopping_patience"
FloatDtype = Literal["bfloat16", "float16", "float32"]  # bitsandbytes' 4-bit compute and storage dtypes
FLOAT_SPELLINGS = {"BF16": "bfloat16", "FP16": "float16", "FP32": "float32", "HALF": "float16", "FLOAT": "float32",
                   "TORCH.BFLOAT16": "bfloat16", "TORCH.FLOAT16": "float16", "TORCH.FLOAT32": "float32"}
DTYPE_SPELLINGS = {"TORCH.FLOAT32": "float32", "TORCH.BFLOAT16": "bfloat16", "TORCH.FLOAT16": "float16",
                   "HALF": "float16"}


@dataclass
class ModelConfig:
    model_name_or_path: str | None = key(None, "Local model folder (config.json + weights + tokenizer) or a hub name.")
    attn_implementation: AttnImplementation = key("sdpa", "Attention kernel. flash_attention_2 and 3 need their "
                                                          "package (flash-attn) and a CUDA GPU computing in bf16 or "
                                                          "fp16; use_flash_attn falls back to this one where they "
                                                          "cannot run. Also read from TRL's model_init_kwargs.")
    use_flash_attn: bool = key(False, "Use flash_attention_2 when installed and on CUDA; sdpa otherwise, with a "
                                      "warning.")
    trust_remote_code: bool = key(False, "Run a model's own Python code from its folder. Off unless you trust the "
                                         "model. Also read from TRL's model_init_kwargs.")
    torch_dtype: TorchDtype | None = key(
        None, "TRL's model dtype: auto or float32 (unset) train fp32 weights under mixed precision; bfloat16 trains "
        "pure bf16: weights, gradients and AdamW moments in bf16, no fp32 master (half the optimizer memory), updates "
        "stochastically rounded so small steps are kept, FSDP reducing gradients in bf16, final/ saved in bf16. With "
        "LoRA the base and the adapters are bf16; with QLoRA the adapters and the unquantised weights are, as in "
        "torchtune's and fsdp_qlora's bf16 QLoRA (PEFT and TRL keep adapters in fp32: leave torch_dtype out for "
        "that). Runs adamw_torch/adamw_torch_fused with every distributed_type; float16 is refused (use fp16 mixed "
        "precision). Also read from TRL's model_init_kwargs: {dtype: ...}.",
        spellings=DTYPE_SPELLINGS, refused={"float16": FLOAT16},
        aliases={"dtype": "Transformers 5's"})

    @property
    def weights_dtype(self) -> str:
        """auto, float32 or bfloat16."""
        return str(self.torch_dtype or "auto").lower().removeprefix("torch.")

    @property
    def pure_bf16(self) -> bool:
        return self.weights_dtype == "bfloat16"


@dataclass
class DataConfig:
    """Data settings, named as in TRL's SFT recipes and the Hugging Face PEFT examples."""

    dataset_name: str | None = key(None, "A JSONL/JSON/Parquet/CSV file (or one compressed whole: .jsonl.gz, .bz2, "
                                         ".xz) or folder, a saved `datasets` folder, or a hub name.")
    dataset_config_name: str | None = key(None, "The hub data set's configuration (subset).",
                                          aliases={"dataset_config": "TRL's"})
    splits: str = key("train,test", "Comma-separated split names; names containing `train` train, the others "
                                    "evaluate. TRL's dataset_train_split and dataset_test_split each name one side "
                                    "of it (dataset_train_split train_sft: splits train_sft,test).", commas=True)
    dataset_text_field: str = key("text", "The column of raw-text rows.")
    data_format: DataFormat = key("auto", "The row format; auto looks at the first row.")
    chat_template_format: ChatTemplateFormat = key("none", "The chat template: none is the tokenizer's own. A named "
                                                           "one whose end-of-turn token (chatml's <|im_end|>, "
                                                           "llama-3's <|eot_id|>) the tokenizer lacks needs "
                                                           "add_special_tokens true.")
    chat_template_path: str | None = key(
        None, "TRL's chat_template_path: a Jinja file (.jinja or .j2) whose template the tokenizer uses instead of its "
        "own (the tokens it writes must be the tokenizer's already); saved with the tokenizer in final/. A tokenizer "
        "folder or hub name is not read: give its chat_template.jinja.")
    add_special_tokens: bool = key(False, "Add the named template's special tokens to the tokenizer (and resize the "
                                          "embeddings).")
    eos_token: str | None = key(None, "TRL's eos_token: the token that ends each text and prompt/completion row (as "
                                      "a target, so the model learns to stop there) and that the saved tokenizer "
                                      "names as its EOS, e.g. <|im_end|> for a base model trained on ChatML text; it "
                                      "must be a token of the tokenizer. Unset: the tokenizer's own (a named template "
                                      "with add_special_tokens: its end of turn). A chat's turns end as its template "
                                      "writes them.")
    append_concat_token: bool = key(False, "When packing, end every document with EOS if it does not already.",
                                    needs=PACKING)
    max_seq_len: int = key(2048, "Tokens per row; longer examples are truncated, packed rows are filled up to it. "
                                 "Refused (not capped) beyond the positions the model covers (its config's "
                                 "max_position_embeddings).", ge=2,
                           aliases={"max_length": "TRL's", "max_seq_length": "TRL's former"})
    packing: bool = key(False, "Pack several examples into each row (attention never crosses examples).")
    eval_packing: bool | None = key(None, "Pack the eval rows (unset: as packing, TRL's default). The eval loss is "
                                          "the same either way (the same tokens; attention never crosses "
                                          "examples): packed eval batches carry less padding.", needs=EVALUATES)
    group_by_length: bool = key(False, "Unpacked rows: each global batch holds rows of about one length, longest "
                                       "first, so micro-batches carry less padding; the batches stay the same for "
                                       "any world size and accumulation, and resume exactly (packing must be "
                                       "false).")
    train_on_prompt: bool = key(False, "Also compute the loss on system/user/prompt tokens, not only on the answers.")
    eval_split_ratio: float = key(0.0, "Hold out this fraction of the train rows for eval when there is no eval "
                                       "split.", ge=0, lt=1)
    dataset_num_proc: int | None = key(None, "Processes that tokenise (unset: one).", ge=1)
    skip_bad_rows: bool = key(False, "Drop malformed rows and count them instead of stopping at the first.")

    @property
    def alpaca_as_chat(self) -> bool:
        """Alpaca rows become a user and an assistant turn of the named chat template; with none, the Alpaca
        prompt (and its completion)."""
        return self.chat_template_format != "none"

    def train_split_names(self) -> list[str]:
        return [s.strip() for s in self.splits.split(",") if "train" in s.strip()]

    def eval_split_names(self) -> list[str]:
        return [s.strip() for s in self.splits.split(",") if s.strip() and "train" not in s.strip()]

    def rows_held_out(self, rows: int) -> int:
        """How many of ``rows`` training rows eval_split_ratio holds out for evaluation where the data has no eval
        split: at least one where it is set (the data pipeline splits so, and ``estimate --time`` counts so)."""
        return max(1, round(self.eval_split_ratio * rows)) if self.eval_split_ratio > 0 and rows else 0


@dataclass
class LoraConfig:
    use_peft_lora: bool = key(False, "Train LoRA adapters (PEFT) on a frozen base instead of every weight.",
                              aliases={"use_peft": "TRL's"})
    lora_r: int = key(8, "LoRA rank.", ge=1, needs=LORA)
    lora_alpha: int = key(16, "LoRA scaling numerator (the update is scaled by alpha / r).", gt=0, needs=LORA)
    lora_dropout: float = key(0.0, "Dropout on the LoRA input.", ge=0, lt=1, needs=LORA)
    lora_target_modules: str = key(
        "all-linear", "all-linear; comma-separated module names (q_proj,v_proj: each matches a module whose name ends "
        "with it; the command line also takes TRL's --lora_target_modules q_proj v_proj); or `re:` and a regular "
        "expression that must match a module's whole name (PEFT's regex form), e.g. "
        "`re:.*layers\\.[0-3]\\..*(q_proj|v_proj)`.", needs=LORA, commas=True,
        refused={"null": "unset (TRL's default) asks PEFT for its own targets for the model type, q_proj,v_proj on "
                         "Llama; name the modules (e.g. q_proj,v_proj) or give all-linear"})
    use_dora: bool = key(False, "DoRA (Liu et al. 2024): a trained magnitude per output feature of each adapted "
                                "layer; sharded by FSDP with its layer, saved in checkpoints and final/, folded in by "
                                "merge.", needs=LORA)
    use_rslora: bool = key(False, "rsLoRA: scale the update by lora_alpha / sqrt(r) instead of lora_alpha / r.",
                           needs=LORA)
    lora_modules_to_save: list[str] = key(
        help="Modules trained in full beside the adapters and saved in the adapter (PEFT's modules_to_save), e.g. "
        "lm_head or embed_tokens; a list or comma-separated names (on the command line also TRL's space-separated "
        "ones).", factory=list, needs=LORA)
    init_lora_weights: str = key(
        "true", "true (A random, B zero), false (both random: for tests), gaussian, pissa or pissa_niter_N (A, B from "
        "the base's top singular vectors), olora (from a QR of the base). PiSSA/OLoRA change the base: final/ and "
        "export hold the equivalent plain adapter of rank 2r for the unmodified base. Not with "
        "use_4bit_quantization, use_dora or PP.", needs=LORA, takes_true=True)
    lora_bias: Literal["none", "all", "lora_only"] = key(
        "none", "PEFT's bias: which biases train, all of the model's or lora_only those of adapted layers; trained "
        "biases are saved in the adapter. PEFT's boolean lora_bias true (a bias on lora_B) is refused; false "
        "means none.", spellings={"FALSE": "none"},
        refused={"true": "here lora_bias is PEFT's `bias` (none, all, lora_only); PEFT's boolean lora_bias (a bias "
                         "on lora_B) is not run; use lora_bias all or lora_only, or leave it out"}, needs=LORA)
    use_4bit_quantization: bool = key(False, "QLoRA: load the frozen base in 4 bits (bitsandbytes); needs "
                                             "use_peft_lora.", aliases={"load_in_4bit": "TRL's"})
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = key("nf4", "The 4-bit data type.", needs=QLORA)
    use_nested_quant: bool = key(True, "Double quantisation of the quantisation constants (QLoRA paper, section 3). "
                                       "TRL, PEFT and Transformers default to false: a QLoRA run that leaves it out "
                                       "says so at start.",
                                 aliases={"use_bnb_nested_quant": "TRL's",
                                          "bnb_4bit_use_double_quant": "Transformers' BitsAndBytesConfig's"},
                                 needs=QLORA, idle=(False,))
    bnb_4bit_compute_dtype: FloatDtype | None = key(
        None, "The dtype 4-bit weights are dequantised to for the matmuls; unset: the run's compute dtype "
        "(bfloat16 under bf16, float16 under fp16, float32 in fp32), written down in config.yaml.",
        spellings=FLOAT_SPELLINGS, needs=QLORA)
    bnb_4bit_quant_storage_dtype: FloatDtype | None = key(
        None, "Storage dtype of the packed 4-bit weights, and the dtype the model loads in; unset: the run's "
        "compute dtype, as for bnb_4bit_compute_dtype (it lets FSDP shard them with the rest). A half dtype must be "
        "the mixed precision's own (float16 under fp16, bfloat16 under bf16); float32 goes with either.",
        spellings=FLOAT_SPELLINGS, needs=QLORA,
        aliases={"bnb_4bit_quant_storage": "TRL's"},
        refused={"uint8": "bitsandbytes' uint8 storage would load the whole model in uint8 here (the storage dtype "
                          "is the load dtype); leave it out (the run's compute dtype), or use bfloat16, float16 or "
                          "float32"})

    def with_4bit_dtypes(self, mixed_precision: str) -> LoraConfig:
        """The 4-bit dtypes left unset written down for a run computing in ``mixed_precision`` (bf16, fp16 or no):
        its compute dtype. A bf16 default on a card without bf16 (a T4 in fp16) would compute and keep the
        residual stream in an emulated dtype, and CPU autocast refuses fp16 beside bf16 weights."""
        if not self.use_4bit_quantization:  # the keys need QLoRA: a LoRA recipe holding them would be refused
            return self
        name = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision, "float32")
        return dataclasses.replace(self, bnb_4bit_compute_dtype=self.bnb_4bit_compute_dtype or name,
                                   bnb_4bit_quant_storage_dtype=self.bnb_4bit_quant_storage_dtype or name)

    @property
    def method(self) -> str:
        """What trains, in the estimator's words (``Setup.method``): full, lora or qlora."""
        return "qlora" if self.use_4bit_quantization else "lora" if self.use_peft_lora else "full"


@dataclass
class OptimConfig:
    learning_rate: float = key(5e-5, "Peak learning rate.", ge=0,
                               deepspeed=("optimizer.params.lr", "scheduler.params.warmup_max_lr"))
    lr_scheduler_type: Scheduler = key(
        "linear", "The learning-rate schedule after warm-up, as Transformers' get_scheduler runs it: linear or cosine "
        "decay to 0, cosine decay to min_lr_rate x learning_rate (cosine_with_min_lr; cosine_warmup_with_min_lr "
        "also warms up from warmup_lr_rate x learning_rate, as Transformers counts it), num_cycles cosine decays to 0 "
        "each starting at learning_rate (cosine_with_restarts), polynomial decay to lr_end (polynomial), an "
        "inverse square-root decay at the pace of timescale, whatever the run's length (inverse_sqrt), warm-up, a "
        "constant rate for num_stable_steps and a decay over the last num_decay_steps to min_lr_ratio x "
        "learning_rate (warmup_stable_decay), constant, or a rate cut by plateau_factor each time the eval "
        "metric (metric_for_best_model, eval_loss unset) has not improved for plateau_patience evaluations, as "
        "torch's ReduceLROnPlateau cuts it (reduce_lr_on_plateau: no warm-up; it needs eval_strategy).")
    min_lr_rate: float | None = key(None, "cosine_with_min_lr and cosine_warmup_with_min_lr (which need it or "
                                          "min_lr): the "
                                          "rate the cosine decays to, as a share of learning_rate; read from "
                                          "Transformers' lr_scheduler_kwargs: {min_lr_rate: ...} too.", ge=0, le=1,
                                    needs=MIN_LR)
    min_lr: float | None = key(
        None, "A floor for the learning rate, a rate (not a share of learning_rate): cosine_with_min_lr's and "
        "cosine_warmup_with_min_lr's (min_lr_rate = min_lr / learning_rate, as Transformers reads it; give one of "
        "the two), or the rate reduce_lr_on_plateau does not cut below (unset: 0). Read from Transformers' "
        "lr_scheduler_kwargs: {min_lr: ...} too.", ge=0, needs=FLOOR)
    # torch's ReduceLROnPlateau arguments, as Transformers hands them on from lr_scheduler_kwargs (its names there
    # are these without plateau_; early stopping's patience and threshold are other keys).
    plateau_factor: float = key(0.1, "reduce_lr_on_plateau: each cut multiplies the rate by this. Read from "
                                     "Transformers' lr_scheduler_kwargs: {factor: ...} too.", gt=0, lt=1,
                                needs=PLATEAU)
    plateau_patience: int = key(10, "reduce_lr_on_plateau: the evaluations without improvement it waits for, cutting "
                                    "the rate at the next one. Read from Transformers' lr_scheduler_kwargs: "
                                    "{patience: ...} too.", ge=0, needs=PLATEAU)
    plateau_threshold: float = key(1e-4, "reduce_lr_on_plateau: how much an evaluation must beat the best one by to "
                                         "count as an improvement, a share of the best (rel) or a difference (abs). "
                                         "Read from Transformers' lr_scheduler_kwargs: {threshold: ...} too.", ge=0,
                                   needs=PLATEAU)
    plateau_threshold_mode: Literal["rel", "abs"] = key(
        "rel", "reduce_lr_on_plateau: plateau_threshold as a share of the best metric (rel) or a difference (abs). "
        "Read from Transformers' lr_scheduler_kwargs: {threshold_mode: ...} too.", needs=PLATEAU)
    plateau_cooldown: int = key(0, "reduce_lr_on_plateau: the evaluations after a cut before it counts again. Read "
                                   "from Transformers' lr_scheduler_kwargs: {cooldown: ...} too.", ge=0, needs=PLATEAU)
    plateau_eps: float = key(1e-8, "reduce_lr_on_plateau: a cut smaller than this is not made. Read from "
                                   "Transformers' lr_scheduler_kwargs: {eps: ...} too.", ge=0, needs=PLATEAU)
    warmup_lr_rate: float | None = key(
        None, "cosine_warmup_with_min_lr: the rate its warm-up starts at, as a share of learning_rate, rising in a "
        "straight line to learning_rate at the last warm-up step (unset: Transformers' 1 / warm-up steps at the first "
        "step, k / warm-up steps at step k). Read from Transformers' lr_scheduler_kwargs: {warmup_lr_rate: ...} "
        "too.", ge=0, le=1, needs=WARMUP_LR)
    # Unset: each schedule's own default in Transformers, which differ (0.5 waves, 1 decay).
    num_cycles: float | None = key(
        None, "The cosine's cycles over the steps after warm-up, as Transformers' schedules read it: for cosine and "
        "cosine_with_min_lr the waves of one cosine (unset: 0.5, half a wave from learning_rate down to 0 or the "
        "floor; 1 goes down and back up), for cosine_with_restarts the decays from learning_rate to 0, each after "
        "the first starting again at learning_rate (unset: 1), for warmup_stable_decay the waves of its cosine "
        "decay (unset: 0.5). Read from Transformers' lr_scheduler_kwargs: {num_cycles: ...} too.", gt=0,
        needs=COSINES)
    lr_end: float = key(1e-7, "polynomial: the learning rate the decay reaches at the last step, a rate (not a share "
                              "of learning_rate) below learning_rate. Read from Transformers' lr_scheduler_kwargs: "
                              "{lr_end: ...} too.", ge=0, needs=POLYNOMIAL)
    power: float = key(1.0, "polynomial: the decay's power; the rate is lr_end + (learning_rate - lr_end) x (steps "
                            "left / steps after warm-up) ^ power (1: a straight line). Read from Transformers' "
                            "lr_scheduler_kwargs: {power: ...} too.", ge=0, needs=POLYNOMIAL)
    timescale: int | None = key(
        None, "inverse_sqrt: after warm-up the rate is learning_rate / sqrt((step - warm-up steps + timescale) / "
        "timescale): learning_rate when warm-up ends, half of it 3 x timescale steps later (unset: the warm-up "
        "steps, or 10000 without warm-up, as in Transformers). Read from Transformers' lr_scheduler_kwargs: "
        "{timescale: ...} too.", ge=1, needs=INVERSE_SQRT)
    # Transformers' get_wsd_schedule: warm-up, a stable stretch at learning_rate, a decay; its keys as it names them.
    num_decay_steps: int | None = key(
        None, "warmup_stable_decay (which needs it): the steps of the final decay, from learning_rate to min_lr_ratio "
        "x learning_rate; the rate stays there after them. Warm-up, stable and decay steps past the run's end are "
        "run as Transformers runs them, with a warning (a trial of a recipe meant for a longer run). Read from "
        "Transformers' lr_scheduler_kwargs: {num_decay_steps: ...} too.", ge=0, needs=WSD)
    num_stable_steps: int | None = key(
        None, "warmup_stable_decay: the steps at learning_rate between warm-up and decay (unset: the run's steps "
        "less the warm-up and decay steps). Read from Transformers' lr_scheduler_kwargs: {num_stable_steps: ...} "
        "too.", ge=0, needs=WSD)
    warmup_type: WsdShape = key("linear", "warmup_stable_decay: the warm-up's curve from min_lr_ratio x "
                                          "learning_rate up to learning_rate. Read from Transformers' "
                                          "lr_scheduler_kwargs: {warmup_type: ...} too.", needs=WSD)
    decay_type: WsdShape = key("cosine", "warmup_stable_decay: the decay's curve (cosine: num_cycles waves, half "
                                         "a wave unset). Read from Transformers' lr_scheduler_kwargs: "
                                         "{decay_type: ...} too.", needs=WSD)
    min_lr_ratio: float = key(0.0, "warmup_stable_decay: where warm-up starts and decay ends, as a share of "
                                   "learning_rate. Read from Transformers' lr_scheduler_kwargs: {min_lr_ratio: ...} "
                                   "too.", ge=0, le=1, needs=WSD)
    warmup_ratio: float = key(0.0, "Fraction of the steps spent warming up (warmup_steps wins when set).", ge=0, le=1,
                              needs=WARMS_UP)
    warmup_steps: int = key(0, "Steps of linear warm-up. A value below 1 is read as Transformers 5 reads it, a "
                               "fraction of the run's steps (warmup_ratio). More steps than the run has warns: "
                               "its rate never reaches learning_rate.", ge=0,
                            deepspeed=("scheduler.params.warmup_num_steps",), needs=WARMS_UP)
    weight_decay: float = key(0.0, "Weight decay of every trained parameter but biases and norm weights, told "
                                   "apart as Transformers' Trainer tells them (by name and nn.LayerNorm), for every "
                                   "optimizer.", ge=0, deepspeed=("optimizer.params.weight_decay",))
    max_grad_norm: float = key(1.0, "Clip the global gradient norm to this (0: no clipping).", ge=0,
                               deepspeed=("gradient_clipping",))
    adam_beta1: float = key(0.9, "AdamW's and Lion's beta1; refused with adafactor and sgd, which have none.",
                            ge=0, lt=1, deepspeed=("optimizer.params.betas[0]",))
    adam_beta2: float = key(0.999, "AdamW's and Lion's beta2; refused with adafactor and sgd, which have none.",
                            ge=0, lt=1, deepspeed=("optimizer.params.betas[1]",))
    adam_epsilon: float = key(1e-8, "AdamW's epsilon (0 is refused: it makes NaN of zero gradients); refused with "
                                    "Lion, adafactor and sgd, which have none.",
                              ge=0, deepspeed=("optimizer.params.eps",))
    optim: str = key(
        "adamw_torch", "Transformers' optimizer name, run as Transformers runs it: adamw_torch(_fused) is torch's "
        "AdamW (fused on CUDA); the 8-bit, 32-bit and paged AdamW and Lion are bitsandbytes' (paged ones need CUDA; "
        "under FSDP each rank steps its shard; the 8-bit ones keep the embeddings' state in fp32, as Transformers' "
        "Trainer does); adafactor is Transformers' Adafactor (not with FSDP); sgd is torch's "
        "SGD without momentum. State bytes per weight: docs/estimator.md.", choices=tuple(OPTIMIZERS),
        refused=NOT_RUN)


@dataclass
class RunConfig:
    output_dir: str | None = key(None, "Where metrics.jsonl, config.yaml, checkpoints/ and final/ go.")
    overwrite_output_dir: bool = key(False, "A folder holding an earlier run is refused unless resuming; true "
                                            "deletes that run's files (checkpoints/, final/, metrics.jsonl, ...) "
                                            "once the model and data have loaded (a run refused for bad input "
                                            "leaves them). With resume_from_checkpoint set the resume wins, as in "
                                            "Transformers, and nothing is deleted (said so).")
    seed: int = key(42, "Seeds data order, LoRA initialisation and dropout.", ge=0, le=MAX_SEED)
    full_determinism: bool = key(False, "Transformers' full determinism: PyTorch's deterministic algorithms only (an "
                                        "operation that has none stops the run naming it), cuBLAS's deterministic "
                                        "workspace and flash-attn's deterministic backward; repeated runs on one GPU "
                                        "then match exactly, at some speed. On the CPU runs already repeat exactly.")
    tf32: bool | None = key(None, "TensorFloat-32 for fp32 matmuls on NVIDIA Ampere and newer GPUs (faster, 10-bit "
                                  "mantissa): true or false sets it for the run, unset leaves PyTorch's setting (off). "
                                  "Matters where fp32 matmuls run: fp32 training, and the fp32 parts of mixed "
                                  "precision. true needs such a GPU.")
    num_train_epochs: float = key(1.0, "Epochs to train when max_steps is -1.")
    max_steps: int = key(-1, "Optimizer steps to train; -1 trains num_train_epochs.")
    per_device_train_batch_size: int = key(8, "Rows per micro-batch per process.", ge=1,
                                           deepspeed=("train_micro_batch_size_per_gpu",))
    per_device_eval_batch_size: int = key(8, "Rows per eval batch per process.", ge=1, needs=EVALUATES)
    gradient_accumulation_steps: int = key(1, "Micro-batches per optimizer step; the loss is normalised over all of "
                                              "them.", ge=1, deepspeed=("gradient_accumulation_steps",))
    gradient_checkpointing: bool = key(True, "Recompute each decoder layer's activations in the backward pass: "
                                             "it keeps only the layers' inputs, for about a third more compute. On "
                                             "by default, as TRL's SFTConfig has it; false where memory is plenty "
                                             "and speed counts.",
                                       aliases={"activation_checkpointing": "Transformers 5's"})
    use_reentrant: bool = key(False, "Use the reentrant checkpointing implementation (PyTorch's older one). Also "
                                     "read from TRL's gradient_checkpointing_kwargs: {use_reentrant: ...}.",
                              needs=CHECKPOINTING)
    activation_offloading: bool = key(
        False, "Keep the input each checkpointed decoder layer saves (batch x seq x hidden per layer) in pinned CPU "
        "memory: copied on a side CUDA stream while the forward goes on, brought back one layer ahead in backward. "
        "The GPU holds about two layers' inputs instead of all; host RAM holds the rest. Needs gradient_checkpointing "
        "(refused without it). summary.json's activation_offloading says the layers and the bytes rank 0 moved. "
        "torchtune's name (enable_activation_offloading).")
    torch_empty_cache_steps: int | None = key(
        None, "After every this many optimizer steps, hand the blocks PyTorch's CUDA allocator caches but no tensor "
        "uses back to the driver (torch.cuda.empty_cache), as Transformers' Trainer does: less memory held "
        "between steps and less fragmentation, for some speed (Transformers measured about 10%). Unset: never. On "
        "a CPU there is no such cache: accepted, and nothing is done.", ge=1)
    use_liger_kernel: bool = key(
        False, "Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) patched into the model on CUDA; needs `pip install "
        "liger-kernel` (or `shardtune[liger]`). On a CPU: a warning and transformers' modules. The loss stays "
        "shardtune's fused one (no logits kept). summary.json's liger names the kernels patched in, or why none "
        "were. TRL's key.")
    torch_compile: bool = key(
        False, "Compile each decoder layer with torch.compile (its forward, checkpointing included; FSDP2's hooks "
        "stay outside), the sequence length dynamic so packed batches do not recompile; the count of compilations "
        "and recompilations is logged at the end and written to summary.json. If the backend cannot compile (no C++ "
        "compiler, a backend error), one warning and the run goes on eager. Off by default: on a CPU it did not pay "
        "for a real model (docs/choosing-a-setup.md, 'torch_compile: when it pays'). Accelerate's `dynamo_config` / "
        "`dynamo_backend` / `dynamo_mode` set this and the two keys below (NO: off); `dynamo_use_dynamic` and "
        "`dynamo_use_regional_compilation` are accepted (compilation is always per layer, dynamic); "
        "`dynamo_use_fullgraph: true` is refused.")
    torch_compile_backend: str | None = key(
        None, "The torch.compile backend (inductor, aot_eager, eager, cudagraphs, or one registered in the process); "
        "setting it turns torch_compile on. Unset: inductor.")
    torch_compile_mode: str | None = key(None, "inductor's mode: default, reduce-overhead, max-autotune, "
                                               "max-autotune-no-cudagraphs, lite; setting it turns torch_compile on.")
    bf16: bool | None = key(
        None, "bf16 mixed precision (fp32 master weights). Unset: on where the hardware computes bf16 natively (CUDA "
        "compute capability 8.0+, CPUs with AVX512-BF16 or AMX), off elsewhere; the run prints its choice and why, "
        "and config.yaml records it. false opts out (fp32); true where the hardware only emulates bf16 runs as "
        "asked, with a warning that fp32 is faster there. A LoRA base is stored in bf16 (no fp32 copy), and under "
        "autocast its embeddings' output is cast up to fp32, so the residual stream runs in fp32 as with fp32 "
        "weights.")
    fp16: bool = key(False, "fp16 mixed precision with a gradient scaler.")
    logging_steps: int = key(10, "Write a metrics.jsonl record every this many steps. Its loss, lr (the rate its "
                                 "update used), grad_norm and tokens are that step's, its tokens_per_s the steps' "
                                 "since the last record, its tokens_seen every step's so far (Transformers' Trainer "
                                 "logs the mean loss since its last record).", ge=1,
                             needs=LOGS_STEPS)
    logging_strategy: Every = key("steps", "When to write metrics.jsonl records.", spellings=NO)
    log_level: LogLevel = key("passive", "Log level of rank 0 (passive: info). The other ranks print errors, and "
                                         "warnings about themselves alone: what every rank would say, rank 0 says "
                                         "once.")
    eval_strategy: Every = key("no", "When to evaluate: every eval_steps and at the run's last step (as Transformers' "
                                     "Trainer does), at the end of each epoch, or never. steps or epoch with no eval "
                                     "rows (no eval split, eval_split_ratio 0) is refused.",
                               spellings=NO, aliases={"evaluation_strategy": "Transformers' former"})
    eval_steps: int | None = key(None, "Evaluate every this many steps (unset: logging_steps).", ge=1,
                                 needs=EVAL_STEPS)
    eval_on_start: bool = key(False, "Evaluate once before the first step, as a baseline (it takes no part in early "
                                     "stopping).")
    eval_delay: float = key(0.0, "No evaluation before this step (eval_strategy steps) or epoch (epoch), as "
                                 "Transformers' eval_delay: early stopping and the best checkpoint then count only "
                                 "the evaluations from there.", ge=0, needs=EVALS_EVERY)
    early_stopping_patience: int | None = key(None, "Stop when metric_for_best_model has not improved for this many "
                                                    "evaluations (the run then finishes as usual: final/ is written, "
                                                    "exit 0).", ge=1)
    early_stopping_threshold: float = key(0.0, "How much an evaluation must beat the best one by to count as an "
                                               "improvement.", ge=0, needs=EARLY_STOPPING)
    neftune_noise_alpha: float | None = key(None, "NEFTune: uniform noise of +-alpha/sqrt(seq_len x hidden) on the "
                                                  "input embeddings while training (the paper uses 5); none in "
                                                  "evaluation and generation.", gt=0)
    report_to: list[str] = key(
        help="Experiment trackers that get every metrics.jsonl record (at its step, under Trainer's names there: "
        "train/loss, train/learning_rate, eval/loss; mlflow's unprefixed) and this config, on rank 0: "
        "a list of the names below (comma-separated on the command line); all is every installed one. A tracker "
        "whose package is missing is refused at start (pip install 'shardtune[trackers]'). None needs the network: "
        "wandb runs offline in output_dir/wandb (WANDB_DIR/wandb where it is set) unless WANDB_MODE or credentials "
        "say otherwise; mlflow writes a file store in output_dir/mlruns unless MLFLOW_TRACKING_URI is set; trackio "
        "its local store (TRACKIO_DIR); tensorboard event files in output_dir/tensorboard/RUN_NAME, or in "
        "TENSORBOARD_LOGGING_DIR where it is set.",
        factory=list, choices=(*TRACKER_PACKAGES, "all", "none"))
    run_name: str | None = key(None, "The run's name in every report_to tracker (default: the output_dir's folder "
                                     "name; W&B's: WANDB_NAME where it is set, as with Transformers).", needs=TRACKER)
    project: str | None = key(None, "The Trackio project of report_to trackio, as Transformers 5's project (unset: "
                                    "the environment variable TRACKIO_PROJECT, else shardtune). Transformers' default "
                                    "huggingface, as a written-out TrainingArguments holds it, is accepted without "
                                    "trackio.", needs=TRACKIO, idle=("huggingface",))
    ddp_timeout: int = key(1800, "Seconds a collective may wait before the run stops, naming the rank and "
                                 "operation.", ge=1)
    dry_run: bool = key(False, "Print the resolved config, trace two steps of the job it describes on fake tensors "
                               "(the second holds the optimizer states; per-GPU peak: tensors and reserved memory, "
                               "by category and module), and exit without training.")
    logging_first_step: bool | None = key(None, "Log the first step, under any logging_strategy (no too), as "
                                                    "Transformers does. Unset: under steps only (Transformers' "
                                                    "default is false).")
    disable_tqdm: bool = key(False, "No progress bars (training's, and each evaluation's): each training record "
                                    "(loss, lr, grad_norm, tokens/s), which the bar showed, is a log line instead; "
                                    "metrics.jsonl is unchanged.")
    save_safetensors: bool = key(True, "Weights are written as safetensors; false (pickled .bin files) is refused.")
    predict_memory: bool = key(help="At the end, trace the job and record the predicted peak memory beside the "
                                    "measured one; not after a SIGTERM, whose grace period is the checkpoint's (the "
                                    "environment variable SHARDTUNE_PREDICT_MEMORY=0 turns the default off).",
                               factory=lambda: os.environ.get("SHARDTUNE_PREDICT_MEMORY", "1") != "0")
    push_to_hub: bool = key(False, "Upload final/ to hub_model_id (or the output folder's name) at the end. A "
                                   "failed upload (no network, no token) leaves the run finished (exit 0), says how "
                                   "to upload it later, and is recorded in summary.json (push_to_hub_failed; "
                                   "hub_model_id where it was uploaded).")
    hub_model_id: str | None = key(None, HUB, needs=PUSH)
    hub_token: str | None = key(None, HUB, secret=True, needs=PUSH)
    hub_private_repo: bool | None = key(False, HUB, needs=PUSH)
    hub_strategy: HubStrategy = key("end", "When push_to_hub uploads: end, the final model once, after training "
                                           "(Transformers' every_save, checkpoint and all_checkpoints are refused "
                                           "there; every_save, Transformers' default, is accepted without it).",
                                    refusal="push_to_hub uploads the final model once, at the end of training; use "
                                            "hub_strategy end or leave it out", needs=PUSH, idle=("every_save",))
    callbacks: list[str] = key(help="Your callback classes, package.module:Class or path/to/file.py:Class (a YAML "
                                    "list, or comma-separated on the command line); every process makes its own, "
                                    "with no arguments. See docs/callbacks.md.", factory=list)


@dataclass
class CheckpointConfig:
    save_strategy: Every = key("steps", "When to save a resumable checkpoint: every save_steps and at the run's last "
                                        "step (as Transformers' Trainer does: a run given more max_steps carries on "
                                        "from there), each epoch, or never.", spellings=NO,
                               refused={"best": "Transformers' saving only on a new best is not done here; save on "
                                                "the eval steps instead (save_strategy as eval_strategy, save_steps a "
                                                "multiple of eval_steps) with load_best_model_at_end true, which "
                                                "keeps the best checkpoint beyond save_total_limit"})
    save_steps: int = key(500, "Save a resumable checkpoint every this many steps.", ge=1, needs=SAVE_STEPS)
    save_total_limit: int | None = key(None, "Keep at most this many checkpoints (oldest deleted first; a file of "
                                             "yours in one is kept, moved to checkpoints/superseded-*); the best one "
                                             "is kept beyond it with load_best_model_at_end.", ge=1)
    load_best_model_at_end: bool = key(False, "Write final/ from the best checkpoint by metric_for_best_model, not "
                                              "the last step (needs save_strategy equal to eval_strategy, save_steps "
                                              "a multiple of eval_steps); a last step that was evaluated and beats "
                                              "it, unsaved (early stopping between saves), keeps its weights. "
                                              "summary.json's final_step says whose weights final/ holds.")
    metric_for_best_model: str | None = key(None, "The eval metric that picks the best checkpoint: eval_loss "
                                                  "(default) or eval_perplexity.")
    greater_is_better: bool | None = key(None, "Whether a larger metric is better (default: false for a loss or "
                                               "perplexity).")
    resume_from_checkpoint: str | None = key(None, "A checkpoint folder, or true for the newest complete one in "
                                                   "output_dir.", takes_true=True)


@dataclass
class DistributedConfig:
    distributed_type: DistributedType | None = key(
        None, f"How processes share the work: one of the strategies {', '.join(NAMES)} (Accelerate's "
        f"{' / '.join(STRATEGY_SPELLINGS)} mean DDP); unset: DDP when launched on several processes.",
        spellings={**STRATEGY_SPELLINGS, "FALSE": "NO"},  # YAML reads an unquoted NO as false
        # Accelerate's value where its config file has a deepspeed_config block (such a file is mapped as it is)
        refused={"DEEPSPEED": "Accelerate's DeepSpeed runs as FSDP2 here: give its DeepSpeed config as --deepspeed "
                              "ds_config.json (its ZeRO stage picks the sharding), or set distributed_type FSDP with "
                              "fsdp_sharding_strategy SHARD_GRAD_OP (ZeRO-1/2) or FULL_SHARD (ZeRO-3)"})
    fsdp_sharding_strategy: ShardingStrategy = key("FULL_SHARD", "What FSDP shards (FSDP1's numbers 1-5 are accepted "
                                                                 "too); see docs/choosing-a-setup.md.",
                                                   spellings=SHARDING_NUMBERS, needs=FSDP_ONLY)
    fsdp_offload_params: bool = key(False, "Keep parameters, gradients and optimizer states in CPU memory.",
                                    needs=FSDP_ONLY)
    fsdp_auto_wrap_policy: WrapPolicy = key("TRANSFORMER_BASED_WRAP", "What becomes one FSDP unit (gathered and "
                                                                      "freed together).", needs=FSDP_ONLY)
    fsdp_transformer_layer_cls_to_wrap: str | None = key(None, "Class name of the unit to wrap (default: the model's "
                                                               "decoder layer); several comma-separated.", commas=True,
                                                         needs=TRANSFORMER_WRAP)
    fsdp_min_num_params: int = key(100_000_000, "SIZE_BASED_WRAP: parameters per unit.", needs=SIZE_WRAP)
    fsdp_cpu_ram_efficient_loading: bool = key(
        True, "Only rank 0 reads the weights (into CPU RAM, as every FSDP rank does: each GPU only ever holds its "
        "shards); the others build on the meta device and receive them. Not with QLoRA: each rank quantises its own "
        "copy in CPU RAM.", needs=FSDP_ONLY)
    fsdp_sync_module_states: bool = key(True, "Broadcast rank 0's weights so every rank starts identical.",
                                        needs=FSDP_ONLY)
    fsdp_state_dict_type: StateDictType = key("SHARDED_STATE_DICT", "Checkpoints: each rank writes its shard "
                                                                    "(SHARDED) or rank 0 writes all (FULL).",
                                              needs=FSDP_ONLY)
    fsdp_reshard_after_forward: bool | None = key(None, "FSDP2's name; overrides what the sharding strategy "
                                                  "implies (FULL_SHARD, HYBRID_SHARD and NO_SHARD reshard, "
                                                  "SHARD_GRAD_OP does not).", needs=FSDP_ONLY,
                                                  refused=FSDP1_RESHARD)
    fsdp_activation_checkpointing: bool = key(False, "Checkpoint every wrapped unit (Accelerate's key; same as "
                                                     "gradient_checkpointing).")
    fsdp_backward_prefetch: Literal["BACKWARD_PRE"] | None = key(
        None, "BACKWARD_PRE (what FSDP2 does: the next unit is gathered before this one's backward); BACKWARD_POST "
        "and NO_PREFETCH are refused.", refusal="FSDP2 always prefetches the next unit's parameters before the "
        "current one's backward (BACKWARD_PRE); set fsdp_backward_prefetch BACKWARD_PRE or leave it out",
        needs=FSDP_ONLY, aliases={"fsdp_backward_prefetch_policy": "Accelerate's former"})
    fsdp_forward_prefetch: bool = key(False, "Gather the next decoder layer while this one runs forward (FSDP2's "
                                             "explicit forward prefetch); needs TRANSFORMER_BASED_WRAP.",
                                      needs=FSDP_ONLY)
    fsdp_version: FsdpVersion = key(2, "2: shardtune runs FSDP2 (fully_shard). 1 (an Accelerate FSDP1 file, TRL's "
                                      "fsdp1.yaml) runs as FSDP2 too, said at start: the fsdp_* keys keep their "
                                      "meaning.",
                                   spellings={"1": 2},  # read as FSDP2 with a note (loading._other_spelling)
                                   refusal="shardtune runs FSDP2 (fully_shard), and FSDP1 files (fsdp_version 1) "
                                           "as FSDP2; set fsdp_version 2 or leave it out")
    ddp_find_unused_parameters: bool | None = key(False, "DDP's find_unused_parameters (true when some parameters get "
                                                        "no gradient).", needs=DDP_ONLY)
    ddp_bucket_cap_mb: int | None = key(None, "DDP's bucket_cap_mb: MB of gradients each all-reduce carries (unset: "
                                              "torch's 25).", gt=0, needs=DDP_ONLY)
    ddp_broadcast_buffers: bool | None = key(None, "DDP's broadcast_buffers: rank 0's buffers copied to the other "
                                                   "ranks before each forward (unset: torch's true).", needs=DDP_ONLY)
    ddp_static_graph: bool | None = key(None, "DDP's static_graph: the graph is the same every step, which lets DDP "
                                              "overlap more of the reduction (unset: torch's false).", needs=DDP_ONLY)
    mixed_precision: MixedPrecision | None = key(None, "Accelerate's key; the bf16/fp16 flags win when set, as in "
                                                       "Transformers, said at start (bf16 false opts out of it); "
                                                       "unset with them, the hardware decides (see bf16).",
                                                 spellings=NO,
                                                 refused={"fp8": "Accelerate's FP8 training (Transformer Engine, "
                                                                 "torchao or MS-AMP) is not run here; use bf16"})
    deepspeed: str | None = key(None, "A DeepSpeed config JSON (Transformers/TRL's --deepspeed), mapped onto FSDP2 "
                                      "and printed at start; what cannot be mapped is refused (docs/deepspeed.md).")
    num_processes: int = key(1, "Processes over all machines (set by shardtune launch).", ge=1)
    num_machines: int = key(1, "Machines in the job (set by shardtune launch).", ge=1)
    machine_rank: int = key(0, "This machine's rank, 0 on the main one.")
    main_process_ip: str | None = key(None, "Address of machine rank 0.")
    main_process_port: int | None = key(None, "Port of the rendezvous on machine rank 0.")
    rdzv_backend: str = key("static", "static, or c10d (elastic rendezvous).")
    pipeline_schedule: PipelineSchedule = key("1F1B", "Pipeline parallel (PP): the schedule.", needs=PP)
    pipeline_microbatches: int = key(2, "Pipeline parallel (PP): pipeline micro-batches each batch is split into.",
                                     ge=1, needs=PP)
    mp_devices: str | None = key(None, "MP: comma-separated devices (cuda:0,cuda:1); default: every visible GPU.",
                                 needs=MP, commas=True)

    @property
    def mp_device_names(self) -> tuple[str, ...]:
        """The devices mp_devices names, in order; none when it is unset (MP then takes every visible GPU)."""
        return tuple(name.strip() for name in (self.mp_devices or "").split(",") if name.strip())

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP2 frees each unit's gathered parameters after its forward and gathers them again for its
        backward: fsdp_reshard_after_forward, else what the sharding implies (FULL_SHARD and HYBRID_SHARD do,
        SHARD_GRAD_OP does not). NO_SHARD does too: its shard group is one GPU, so gathering again is a local copy,
        while keeping the gathered copies would hold every parameter twice (FSDP2 copies even a whole "shard" into
        its gather buffer), not once as DDP does. The trainer's plan and the estimate both read it here."""
        if self.fsdp_reshard_after_forward is not None:
            return self.fsdp_reshard_after_forward
        return self.fsdp_sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")


@dataclass
class TrainConfig:
    """The whole job, one section per concern; functions receive only the section they need."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def precision_on(self, native_bf16: bool) -> str:
        """bf16 / fp16 / no on hardware that does (or does not) compute bf16 natively: TrainingArguments' flags
        first, then Accelerate's ``mixed_precision``; where neither says, bf16 if native, else no (fp32)."""
        if self.run.bf16:
            return "bf16"
        if self.run.fp16:
            return "fp16"
        asked = self.distributed.mixed_precision
        if self.run.bf16 is False:  # the opt-out: a recipe's mixed_precision bf16 does not bring bf16 back
            return "fp16" if asked == "fp16" else "no"
        if asked is not None:
            return asked.lower()
        return "bf16" if native_bf16 else "no"

    @property
    def precision_left_to_hardware(self) -> bool:
        """Nothing in the config chooses the precision: the device decides (``precision_on``)."""
        return self.run.bf16 is None and not self.run.fp16 and self.distributed.mixed_precision is None

    @property
    def mixed_precision(self) -> str:
        """bf16 / fp16 / no for a job on this machine: ``precision_on`` this process's device, asked only where
        the config leaves the choice to the hardware."""
        if not self.precision_left_to_hardware:
            return self.precision_on(False)
        from shardtune.hardware import local_native_bf16

        return self.precision_on(local_native_bf16()[0])

    def with_4bit_dtypes(self) -> TrainConfig:
        """This config with the QLoRA dtypes it leaves unset written down for the precision it computes in (pure
        bf16: bf16); call it once the precision no longer depends on the machine."""
        compute = "bf16" if self.model.pure_bf16 else self.mixed_precision
        return dataclasses.replace(self, lora=self.lora.with_4bit_dtypes(compute))

    def __getattr__(self, name: str) -> Any:
        """A key by its flat name (``cfg.output_dir``, an alias such as ``max_length`` too): a callback written for
        Transformers reads its ``args`` so, and here they are this config, not ``TrainingArguments``."""
        if not name.startswith("_"):
            key = ALIASES.get(name, name)
            for section in vars(self).values():
                if dataclasses.is_dataclass(section) and key in section.__dataclass_fields__:
                    return getattr(section, key)
        # name and obj as Python's own lookup sets them: a callback's error says which of its reads failed
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def to_flat(self) -> dict[str, Any]:
        """Every key at the top level, as ``shardtune train`` reads it back (secrets left out)."""
        return {k: v for section in dataclasses.fields(self) for k, v in
                dataclasses.asdict(getattr(self, section.name)).items() if k not in SECRET_KEYS}


def published_defaults() -> TrainConfig:
    """``TrainConfig()`` as a user without SHARDTUNE_* environment variables gets it (predict_memory reads one):
    the defaults docs/config.md, --help-keys and the JSON Schema show."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SHARDTUNE_")}
    try:
        return TrainConfig()
    finally:
        os.environ.update(saved)


def section_classes() -> dict[str, type]:
    """Each section's name and its dataclass."""
    return {f.name: type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)}


def all_keys() -> tuple[Declared, ...]:
    """Every key's declaration, section by section."""
    return tuple(d for section, cls in section_classes().items() for d in declared(cls, section))


def known_keys() -> dict[str, str]:
    """Every accepted key and the section that holds it."""
    return {d.name: d.section for d in all_keys()}


SECRET_KEYS = {d.name for d in all_keys() if d.meta.secret}  # never written into config.yaml
# Other tools' names for keys (TRL's max_length), each with the key it means.
ALIASES = {alias: d.name for d in all_keys() for alias in d.meta.aliases}
