"""Pipeline parallel: one stage of consecutive decoder layers per process, micro-batches flowing through them.

Every rank loads the whole model, then keeps only its stage: the first also keeps the embeddings, the last the
final norm and the LM head. The kept modules stay where they were in the model tree (the other stages' layers
become parameterless ``OtherStage`` placeholders), so parameter names, checkpoints and the exported model are
those of the unsplit model, and each stage runs the model's own decoder forward: the family's masks, per-layer-type
position embeddings and layers as one process runs them. A head tied to the input embeddings is held by the first
and the last stage, which add their gradients of it. ``torch.distributed.pipelining`` runs the schedule (GPipe:
all forwards then all backwards; 1F1B: one forward, one backward once the pipeline is full, so fewer
micro-batches' activations are alive).

There is no data parallelism here: every rank reads the same global batch. Only the first stage feeds the token
ids into the pipeline; each stage takes the per-token extras (position ids, the packed-document attention mask)
of the micro-batch the schedule is running from its own copy of the batch, so only hidden states travel between
processes.

The loss and its normalisation stay in ``step.train_step``: the last stage's module ends at the final norm, and
its loss function runs the head fused with the loss (``loss.head_loss_sum``, one chunk of tokens at a time, so no
stage ever holds a micro-batch's whole logits) and returns that sum times the scale ``train_step`` computes for
the whole global batch; gradients are not rescaled by the schedule (``scale_grads=False``).

Evaluation runs the same schedule forward only (``schedule.eval``) through ``step.evaluate``: every rank reads the
same eval batches, the last stage sums the token losses, and the sum over ranks gives every rank the eval loss.
Checkpoints are the usual DCP ones under the unsplit model's names, with the optimizer state keyed by parameter
name (``checkpoint._options``), so a run resumes exactly, also on another number of stages or on one process.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtune.dist import DistInfo, run_and_share
from shardtune.errors import UsageError
from shardtune.train.applied import Applied
from shardtune.train.export import write_export
from shardtune.train.loss import head_loss_sum, logit_transform
from shardtune.train.plan import Plan, unwrap
from shardtune.train.runner import attention_masks, model_inputs, refuse_router_aux_loss, uses_varlen_attention

log = logging.getLogger("shardtune")


def keep_stage(model: nn.Module, bounds: tuple[int, int], *, first: bool, last: bool) -> nn.Module:
    """Drop every module this stage does not run; the kept ones keep their names. Returns ``model``.

    The layers of other stages become ``OtherStage`` placeholders, so ``model.layers`` keeps its length and the
    model's own forward loops over it as on one process. A head tied to the input embeddings stays on the last
    stage as a copy of them (``tied_weight``: the two ends add their gradients of it), the embedding module kept
    there too (it runs only on the first stage) so that the stage's state dict names the weight as one process's
    does: under ``model.embed_tokens`` and ``lm_head``, or (frozen, trainable tensors only) ``lm_head`` alone.
    Where PEFT trains a copy at each end (``_trains_copies``), the last stage keeps only the head's, as if untied.
    """
    causal_lm = unwrap(model)
    inner = causal_lm.model
    refuse_router_aux_loss(causal_lm)
    if not (first and last):
        _refuse_trained_tied_adapters(causal_lm)
        _refuse_scaled_embeddings(causal_lm)
    start, end = bounds
    for i in [*range(start), *range(end, len(inner.layers))]:
        inner.layers[i] = OtherStage()
    if not first and not (last and _is_tied(causal_lm) and not _trains_copies(causal_lm)):
        inner.embed_tokens = None
    if not last:
        inner.norm = nn.Identity()
        causal_lm.lm_head = None
    return model


class OtherStage(nn.Module):
    """Where a decoder layer of another stage was: hands the hidden states on (it holds no parameters)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ARG002
        return hidden_states


def _is_tied(causal_lm: nn.Module) -> bool:
    return bool(getattr(causal_lm.config, "tie_word_embeddings", False))


def _trains_copies(causal_lm: nn.Module) -> bool:
    """A tied head whose ends PEFT trains as two copies of the weight (``lora_modules_to_save`` naming both): one
    process trains each copy with its own gradient, so the stages keep them apart too (as an untied head)."""
    from peft.utils import ModulesToSaveWrapper

    ends = (causal_lm.get_input_embeddings(), causal_lm.get_output_embeddings())
    return any(isinstance(end, ModulesToSaveWrapper) for end in ends)


def _refuse_scaled_embeddings(causal_lm: nn.Module) -> None:
    """Granite (and its MoE kin) scale ``inputs_embeds`` by ``embedding_multiplier`` inside the model's forward,
    which every stage runs on the hidden states it is handed: each stage after the first would scale them again."""
    multiplier = getattr(causal_lm.config, "embedding_multiplier", None)
    if multiplier not in (None, 1, 1.0):
        raise UsageError(f"distributed_type=PP: this {causal_lm.config.model_type} model scales its input embeddings "
                         f"(embedding_multiplier {multiplier}) inside the forward every stage runs, so each stage "
                         f"after the first would scale the hidden states again; use FSDP, DDP or MP")


def _refuse_trained_tied_adapters(causal_lm: nn.Module) -> None:
    """A tied head is supported with its weight frozen or trained whole (``tied_weight``); another trained tensor
    that the embeddings and the head share (PEFT's rows for added or revived tokens follow the embeddings into a
    tied head)
    would be trained apart on the two ends of the pipeline."""
    if not _is_tied(causal_lm):
        return
    embed, head = causal_lm.get_input_embeddings(), causal_lm.get_output_embeddings()
    trained = {end: any(p.requires_grad for p in module.parameters()) for end, module in (("embeddings", embed),
                                                                                           ("head", head))}
    if trained["embeddings"] != trained["head"]:  # a trained copy of one end (PEFT's modules_to_save)
        which = "head" if trained["head"] else "embeddings"
        raise UsageError(f"distributed_type=PP: this model ties its LM head to the input embeddings, and the {which} "
                         f"alone is trained (lora_modules_to_save), which the pipeline's two ends would hold "
                         f"apart; use FSDP, DDP or MP, or leave lora_modules_to_save out")
    in_embed = {id(p) for p in embed.parameters()}
    shared = sorted(name for name, p in head.named_parameters()
                    if id(p) in in_embed and p.requires_grad and p is not embed.weight)
    if shared:
        raise UsageError(f"distributed_type=PP: this model ties its LM head to the input embeddings, and the head "
                         f"shares trained tensors with them ({', '.join(shared)}: PEFT's rows for tokens the "
                         f"tokenizer added, or that the data writes and the base model never trained) that the "
                         f"pipeline's two ends would train apart; use FSDP or DDP")


def tied_weight(model: nn.Module, *, first: bool, last: bool) -> nn.Parameter | None:
    """The trained weight that a tied head shares with the input embeddings, on a stage that holds one end of it
    (the first holds the embeddings, the last the head); None on one stage, a middle stage, when it is frozen, or
    when each end trains its own copy of it (``_trains_copies``)."""
    causal_lm = unwrap(model)
    if not _is_tied(causal_lm) or first == last or _trains_copies(causal_lm):
        return None
    end = causal_lm.get_input_embeddings() if first else causal_lm.get_output_embeddings()
    return end.weight if end.weight.requires_grad else None


class StageModule(nn.Module):
    """What ``PipelineStage`` runs: the model's own decoder forward over this stage's layers (the others are
    ``OtherStage``), from the token ids on the first stage and from the hidden states elsewhere, ending at the
    final norm on the last stage (an identity elsewhere). The family's masks (``runner.attention_masks``: sliding
    windows, one mask per layer type) and position embeddings are what that forward makes of them on one process.

    The head is left to the loss function (``PipelineRunner._loss``), which runs it fused with the loss."""

    def __init__(self, model: nn.Module, *, first: bool, last: bool, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = first, last
        self.compute_dtype = compute_dtype
        self.extras: list[dict[str, Any]] = []
        # Set by the runner before each micro-batch's forward; 0 during the schedule's shape inference.
        self.chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = unwrap(self.model).model
        fed = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with self.autocast(x.device):
            return inner(**fed, **self.extras[self.chunk], use_cache=False).last_hidden_state

    def autocast(self, device: torch.device):
        """The stage's mixed precision (also the head's and the loss's, which run in ``PipelineRunner._loss``)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


class PipelineRunner:
    """Runs one rank's stage through the schedule for each collated batch of a training step."""

    flat_optimizer = True  # each stage holds other parameters: optimizer state keyed by name (checkpoint.py)
    scaler = None  # fp16 is refused under PP (the stages do not scale the loss)

    def __init__(self, model: nn.Module, plan: Plan, info: DistInfo, *, applied: Applied | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.model, self.info = model, info
        self.applied = applied or Applied()  # torch_compile's, Liger's and offloading's records, for summary.json
        self.num_stages = info.world_size
        self.copies = self.num_stages  # every stage reads the same batch: sums over ranks count it once per stage
        self.first, self.last = info.rank == 0, info.rank == info.world_size - 1
        self.microbatches = plan.pipeline_microbatches
        self.module = StageModule(model, first=self.first, last=self.last, compute_dtype=plan.compute_dtype)
        self.varlen, self.masks = uses_varlen_attention(model), attention_masks(model)
        self.tied = tied_weight(model, first=self.first, last=self.last)
        # The two ends of a trained tied head add their gradients of it (every rank creates the group).
        self.ends = _ends_group(info.world_size) if _is_tied(unwrap(model)) else None
        self.stage = PipelineStage(self.module, info.rank, self.num_stages, info.device)
        schedule_cls = ScheduleGPipe if plan.pipeline_schedule.upper() == "GPIPE" else Schedule1F1B
        # The loss is already scaled to the whole global batch (train_step), so the schedule must not average.
        self.schedule = schedule_cls(self.stage, n_microbatches=self.microbatches, loss_fn=self._loss,
                                     scale_grads=False)
        self._scale = 1.0
        self._loss_sums: list[torch.Tensor] = []
        # Set when a micro-batch's forward starts: the shape inference before it also runs the loss, uncounted.
        self._counting = False
        run_chunk = self.stage.forward_one_chunk

        def forward_one_chunk(chunk_id: int, *args, **kwargs):
            self.module.chunk, self._counting = chunk_id, True
            return run_chunk(chunk_id, *args, **kwargs)

        self.stage.forward_one_chunk = forward_one_chunk

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        causal_lm = unwrap(self.model)
        with self.module.autocast(hidden.device):
            micro_sum = head_loss_sum(hidden, labels, causal_lm.get_output_embeddings(),
                                      logit_transform(causal_lm.config))
        if self._counting:
            self._loss_sums.append(micro_sum.detach().double())
        return micro_sum * self._scale

    def forward_backward(self, batches: list[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward every batch through the pipeline; returns the summed token loss (last stage, else 0)."""
        self._scale, self._loss_sums = scale, []
        for batch in batches:
            args, target = self._feed(batch)
            self.schedule.step(*args, target=target, return_outputs=False)
        if self.tied is not None:
            # The embeddings' gradient (first stage) plus the head's (last): both ends step with the same one.
            if self.tied.grad is None:
                self.tied.grad = torch.zeros_like(self.tied)
            dist.all_reduce(self.tied.grad, group=self.ends)
        return self._loss_total()

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Evaluation: forward one batch through the pipeline; returns its summed token loss (last stage, else 0).

        The schedule's ``eval`` runs the same micro-batches without backward; call it under ``torch.no_grad``.
        """
        self._scale, self._loss_sums = 1.0, []
        args, target = self._feed(batch)
        self.schedule.eval(*args, target=target, return_outputs=False)
        return self._loss_total()

    def _feed(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """Hand the stage this batch's per-micro-batch extras; returns the schedule's inputs and target."""
        device = self.info.device
        rows = batch["input_ids"].shape[0]
        if rows % self.microbatches:
            raise UsageError(f"a batch of {rows} rows cannot be split into pipeline_microbatches="
                             f"{self.microbatches}; make per_device_train_batch_size and "
                             f"per_device_eval_batch_size multiples of it")
        # What the model's forward reads besides the tokens, as one process gives it (runner.model_inputs).
        extras = {k: batch[k].chunk(self.microbatches) for k in ("position_ids", "attention_mask")
                  if batch.get(k) is not None}
        self.module.extras = [model_inputs({k: parts[i] for k, parts in extras.items()}, device, varlen=self.varlen,
                                           masks=self.masks) for i in range(self.microbatches)]
        # The schedule learns shapes again after each switch between training and evaluation (running the stage
        # and, for training, the loss once); only the micro-batches' own forwards are counted.
        self.module.chunk, self._counting = 0, False
        args = (batch["input_ids"].to(device),) if self.first else ()
        target = batch["labels"].to(device) if self.last else None
        return args, target

    def _loss_total(self) -> torch.Tensor:
        if not self._loss_sums:
            return torch.zeros((), dtype=torch.float64, device=self.info.device)
        return torch.stack(self._loss_sums).sum()

    def export_final(self, output_dir: str | Path, tokenizer, *, is_peft: bool) -> Path | None:
        return export_stages(output_dir, self.model, tokenizer, is_peft=is_peft, info=self.info)

    def grad_norm_and_clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The norm over every stage's gradients (each rank holds different parameters), clipped to ``max_norm``."""
        # The last stage's copy of a tied head's weight holds the first stage's gradient: counted there once.
        grads = [p.grad for p in params if p.grad is not None and (p is not self.tied or self.first)]
        local = (torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads
                 else torch.zeros((), device=self.info.device))
        squared = local.double().pow(2).reshape(1).to(self.info.device)
        dist.all_reduce(squared)
        norm = squared.sqrt()[0].float()
        if max_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def _ends_group(world_size: int):
    """The process group of the first and the last stage (the whole world for two stages)."""
    return None if world_size <= 2 else dist.new_group([0, world_size - 1])


def split_for_stage(model: nn.Module, plan: Plan, info: DistInfo) -> nn.Module:
    """``parallelize`` for PP: keep this rank's layers (``plan.stage_bounds``) and the ends it owns."""
    if len(plan.stage_bounds) != info.world_size:
        raise UsageError(f"distributed_type=PP needs one stage per process: {len(plan.stage_bounds)} stages for "
                         f"{info.world_size} processes; launch as many processes as the model has layers or fewer")
    if plan.pipeline_schedule.upper() == "1F1B" and plan.pipeline_microbatches < info.world_size:
        # Checked with the config (num_processes) too; here for a launcher that set no num_processes.
        raise UsageError(f"pipeline_schedule 1F1B needs at least one micro-batch per stage: pipeline_microbatches="
                         f"{plan.pipeline_microbatches} for {info.world_size} stages (processes); raise "
                         f"pipeline_microbatches to {info.world_size} or more, or use pipeline_schedule GPipe")
    last = info.world_size - 1
    # The model was loaded into CPU RAM: only this stage's part goes to the device.
    return keep_stage(model, plan.stage_bounds[info.rank], first=info.rank == 0, last=info.rank == last).to(info.device)


def export_stages(output_dir: str | Path, model: nn.Module, tokenizer, *, is_peft: bool,
                  info: DistInfo) -> Path | None:
    """``final/`` for a pipeline run: every stage's tensors gathered to rank 0, written as the unsplit model.

    LoRA/QLoRA gather only the adapters (the frozen base is not exported); a full fine-tune gathers every stage's
    weights into rank 0's CPU RAM (the object gather travels through host memory, see ``dist.init_distributed``).
    """
    # Plain tensors (no DTensor): each stage's own state dict is already complete for its modules. The last
    # stage's copy of a tied head is the first stage's embeddings again: the exported model ties them.
    if is_peft:  # each stage's share of the adapter, as PEFT saves it: LoRA, DoRA's magnitudes, biases and
        # modules_to_save copies, under their saved names
        from peft import get_peft_model_state_dict

        from shardtune.peft_names import embedding_layers_saved

        peft_model = getattr(model, "module", model)
        saved = get_peft_model_state_dict(peft_model, save_embedding_layers=embedding_layers_saved(peft_model))
        state = {k: v.detach().cpu() for k, v in saved.items()}
    else:
        copy = _head_names(model) if info.rank > 0 and _is_tied(unwrap(model)) else set()
        state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in copy}
    gathered: list[Any] = [None] * info.world_size if info.is_main else []
    dist.gather_object(state, gathered if info.is_main else None, dst=0)
    target = Path(output_dir) / "final"

    def write() -> None:
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        write_export(target, model, merged, tokenizer, is_peft, save_adapter=_save_adapter)

    run_and_share(write, runs=info.is_main, what=f"writing {target}")
    return target if info.is_main else None


def _head_names(model: nn.Module) -> set[str]:
    """The state-dict names of the LM head's weight in ``model`` (a stage that holds the head)."""
    head = unwrap(model).get_output_embeddings()
    return {name for name, param in model.named_parameters(remove_duplicate=False)
            if head is not None and param is head.weight}


def _save_adapter(model: nn.Module, merged: dict[str, torch.Tensor], folder: Path) -> None:
    """A PEFT adapter folder holding every stage's adapters.

    PEFT keeps only the adapters of modules this rank's (partial) model has, so its file is replaced by every
    stage's share (``merged``, already under PEFT's saved names: ``get_peft_model_state_dict`` on each stage).
    """
    from safetensors.torch import load_file, save_file

    model.save_pretrained(str(folder), safe_serialization=True)
    path = folder / "adapter_model.safetensors"
    missing = set(load_file(str(path))) - set(merged)
    if missing:  # this stage's own share is in every stage's: a name PEFT saves and the gather left out
        raise RuntimeError(f"pipeline export lost adapter tensors: {sorted(missing)[:3]}")
    save_file({k: v.contiguous() for k, v in merged.items()}, str(path), metadata={"format": "pt"})
