"""The training loss: the sum of next-token cross-entropies over the target tokens, never the whole logits at once.

Sums, not means: the step divides by the target tokens of the whole global batch (``step.train_step``), which is
what keeps the loss independent of how the batch is split into processes and accumulation steps.

The loss is fused with the LM head (``head_loss_sum``): the final hidden states go through the head one chunk of
tokens at a time, each chunk's logits are upcast to fp32, scored and dropped, and backward recomputes them one
chunk at a time. A [batch, seq, vocab] tensor never exists, in training or in evaluation. ``FusedLossForward``
lets the model's own forward do it, so the head runs inside the root module's forward (FSDP2 has gathered the
embeddings, the final norm and the head there) and the loss is that forward's output (FSDP2 gathers them again
from the loss's backward hook). ``token_loss_sum`` scores logits that already exist (the tests' reference, the
demo, a model whose forward cannot skip its logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# IGNORE_INDEX: the label of a token that is no target
from shardtune.data.encode import IGNORE as IGNORE_INDEX

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

# No torch at import: the estimator reads these, and ``shardtune estimate`` of a catalog model imports no torch.
LOSS_CHUNKS = 8  # token_loss_sum's chunks; head_loss_sum runs at least this many
# head_loss_sum: one chunk's logits hold at most this many values (128 MiB in fp32): 256 tokens of a 128k
# vocabulary, 1024 of a 32k one (rows enough for a GPU matmul, by the usual rule; not yet timed on one here).
LOSS_CHUNK_VALUES = 2**25
_ROWS_MULTIPLE = 64  # chunks of whole tiles for the matmul
# A batch's key for its ``target_index``, given where its labels hold no values (the trace's fake tensors).
TARGET_INDEX = "target_index"


def loss_chunk_tokens(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk of ``head_loss_sum`` for a micro-batch of ``num_tokens``: at least ``LOSS_CHUNKS``
    chunks, at most ``LOSS_CHUNK_VALUES`` logits in one, a multiple of 64 tokens."""
    by_values = LOSS_CHUNK_VALUES // max(vocab_size, 1) // _ROWS_MULTIPLE * _ROWS_MULTIPLE
    by_count = -(-num_tokens // (LOSS_CHUNKS * _ROWS_MULTIPLE)) * _ROWS_MULTIPLE
    return max(_ROWS_MULTIPLE, min(by_values, by_count))


def num_targets(labels: torch.Tensor) -> int:
    """Target positions after the shift by one (labels[:, 1:])."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _chunk_loss_sum(logit_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logit_chunk.float().flatten(0, 1), target_chunk.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the target positions of existing logits, upcast one chunk at a time.

    Chunking alone does not help backward, which would keep every chunk's fp32 log-softmax; so each chunk is
    checkpointed: its fp32 tensors are freed after forward and recomputed one chunk at a time in backward.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    logits = logits[:, :-1]
    targets = labels[:, 1:]
    total = logits.new_zeros((), dtype=torch.float32)
    for logit_chunk, target_chunk in zip(logits.chunk(LOSS_CHUNKS, dim=1), targets.chunk(LOSS_CHUNKS, dim=1)):
        if logit_chunk.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, logit_chunk, target_chunk, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(logit_chunk, target_chunk)
    return total


# What transformers' forwards (5.x) do to the head's output before their loss, by model_type prefix: multiply by
# a config field, or divide by it. Gemma-style soft-capping (``final_logit_softcapping``) comes after the scale.
_LOGIT_SCALES = (("cohere", "logit_scale", False), ("granite", "logits_scaling", True),
                 ("hyperclovax", "logits_scaling", False), ("muse_", "output_multiplier", False))


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's forward applies to the head's output (scaling, soft-capping), as a function; None if nothing.

    Applied to each chunk's fp32 logits: transformers applies it in the compute dtype, so under bf16 the fused
    loss is the more precise one (as transformers' own fp32 soft-capping in some models).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or ""
    scale = 1.0
    for prefix, field, divides in _LOGIT_SCALES:
        value = getattr(text, field, None)
        if model_type.startswith(prefix) and value is not None:
            scale = 1.0 / value if divides else float(value)
    cap = getattr(text, "final_logit_softcapping", None)
    if scale == 1.0 and cap is None:
        return None
    import functools

    return functools.partial(_scale_and_cap, scale=scale, cap=cap)


def _scale_and_cap(logits: torch.Tensor, *, scale: float, cap: float | None) -> torch.Tensor:
    import torch

    if scale != 1.0:
        logits = logits * scale
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _head_chunk_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module,
                         transform: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    import torch.nn.functional as F

    logits = head(hidden).float()
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position of ``labels`` [batch, seq], flattened: position t predicts label t+1, and the
    last position of each row predicts nothing (IGNORE_INDEX)."""
    import torch

    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1).flatten()


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """The flat positions of ``labels`` [batch, seq] whose prediction has a target, for ``head_loss_sum`` (every
    position, which it then takes without gathering, where rounding up reaches them all).

    Their number is rounded up to a whole number of ``_ROWS_MULTIPLE`` rows with positions that have no target
    (they add 0 to the loss and its gradients): the head's matmuls then see the same row counts however a batch
    is split (one process, DDP, a pipeline's micro-batches), and a micro-batch without any target still has a
    loss in the graph, so every rank's backward hooks run. Computed from the labels' values, so it must be given
    to the trace, whose labels have none (``memory/trace.py``).
    """
    import torch

    targets = shifted_targets(labels)
    keep = targets != IGNORE_INDEX
    wanted = -(-int(keep.sum()) // _ROWS_MULTIPLE) * _ROWS_MULTIPLE or _ROWS_MULTIPLE
    if wanted >= targets.numel():
        return torch.arange(targets.numel(), device=labels.device)
    # The positions with a target first, then the first ones without (a stable sort keeps them in order).
    order = torch.sort((~keep).to(torch.uint8), stable=True).indices
    return order[:wanted].sort().values


def head_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module,
                  transform: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                  chunk_tokens: int | None = None, index: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropies of the final hidden states [batch, seq, hidden] under ``head``.

    Only the positions that have a target go through the head (``target_index``; ``index`` gives them where the
    labels hold no values, as in the trace): prompts, padding and each
    row's last position are never projected to the vocabulary, the largest matmul of a small model. The head (any
    module: a Linear, PEFT's LoRA wrapper of it, a head tied to the embeddings) runs on one chunk of those at a
    time inside a checkpoint: forward keeps only the chunk's hidden states, and backward recomputes the chunk's
    logits, so at most one chunk's logits (and their fp32 upcast and gradients) are alive at once. Values and
    gradients are those of ``token_loss_sum`` on the full logits, up to summation order.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    targets = shifted_targets(labels).to(hidden.device)
    hidden = hidden.flatten(0, 1)  # a view: shifting the labels, not the hidden states, copies nothing
    index = target_index(labels) if index is None else index
    if index.numel() < hidden.shape[0]:
        index = index.to(hidden.device)
        hidden, targets = hidden.index_select(0, index), targets.index_select(0, index)
    vocab_size = getattr(head, "out_features", None) or head.weight.shape[0]  # nn.Linear's, PEFT's LoRA layer's
    rows = chunk_tokens or loss_chunk_tokens(hidden.shape[0], vocab_size)
    total = hidden.new_zeros((), dtype=torch.float32)
    for hidden_chunk, target_chunk in zip(hidden.split(rows), targets.split(rows)):
        if torch.is_grad_enabled():
            total = total + checkpoint(_head_chunk_loss_sum, hidden_chunk, target_chunk, head, transform,
                                       use_reentrant=False)
        else:
            total = total + _head_chunk_loss_sum(hidden_chunk, target_chunk, head, transform)
    return total


class FusedLossForward:
    """A causal LM's own forward, plus the keyword ``loss_labels``: with it, ``.loss`` is ``head_loss_sum`` of the
    final hidden states (``loss_index``: their ``target_index``, where the labels hold no values), and ``.logits``
    only the last position's (transformers' ``logits_to_keep=1``).

    Installed as the model's ``forward`` (``install_fused_loss``), so that it runs inside whatever wraps the model
    (PEFT, DDP, FSDP2's root hooks) and every family's forward keeps its own inputs. Without ``loss_labels`` it is
    the model's forward unchanged. The first call checks that the head's output is the logits up to
    ``logit_transform``: a family that changes the hidden states or the logits in another way stops the run,
    rather than training on a different loss.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        import inspect

        self.causal_lm = causal_lm
        self.forward = causal_lm.forward  # the class's forward, bound
        # What transformers and PEFT read of the forward (generate looks for logits_to_keep) stays the model's.
        self.__signature__ = inspect.signature(self.forward)
        self.transform = logit_transform(causal_lm.config)
        self.checked = False

    def __call__(self, *args: Any, loss_labels: torch.Tensor | None = None, loss_index: torch.Tensor | None = None,
                 **kwargs: Any):
        if loss_labels is None:
            return self.forward(*args, **kwargs)
        seen: dict[str, torch.Tensor] = {}
        head = self.causal_lm.get_output_embeddings()

        def keep_hidden(_module, _args, output) -> None:
            seen["hidden"] = output.last_hidden_state

        def keep_head(_module, args, output) -> None:
            seen["head_input"], seen["head_output"] = args[0], output

        hooks = [self.causal_lm.get_decoder().register_forward_hook(keep_hidden),
                 head.register_forward_hook(keep_head)]
        try:
            out = self.forward(*args, logits_to_keep=1, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        if not self.checked:
            self._check(seen, out.logits)
            self.checked = True
        out.loss = head_loss_sum(seen["hidden"], loss_labels, head, self.transform, index=loss_index)
        return out

    def _check(self, seen: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
        import torch

        with torch.no_grad():
            last = seen["hidden"][:, -1:].float()
            if not bool(torch.isfinite(last).all()):
                return  # NaN/inf weights or input: the step stops on the non-finite loss, with its own message
            same_input = bool((seen["head_input"].float() - last).abs().max() <= 1e-3 * last.abs().max())
            ours = seen["head_output"].float()
            if self.transform is not None:
                ours = self.transform(ours)
            # transformers transforms in the compute dtype: bf16 rounding stays far below 2% of each logit. A
            # non-finite logit is left to the step, which stops on a non-finite loss with its own message.
            largest = ours.nan_to_num(0.0, 0.0, 0.0).abs().max()
            same_logits = bool(torch.isclose(logits.float(), ours, rtol=0.02, atol=1e-4 * largest,
                                             equal_nan=True).all())
        if not (same_input and same_logits):
            model_type = getattr(self.causal_lm.config, "model_type", type(self.causal_lm).__name__)
            where = "its hidden states before the head" if not same_input else "its logits after the head"
            raise RuntimeError(f"model_type {model_type}: its forward changes {where} in a way shardtune's fused "
                               f"cross-entropy does not reproduce (train/loss.py logit_transform); please report it")


def install_fused_loss(model: nn.Module) -> bool:
    """Give the transformers model inside ``model`` (under DDP, PEFT or neither) the ``loss_labels`` keyword.

    False, and nothing changed, when its forward cannot skip its logits (no ``logits_to_keep``, as in older
    remote code); then the runner scores the full logits (``token_loss_sum``).
    """
    import inspect

    from shardtune.train.plan import unwrap

    causal_lm = unwrap(model)
    if isinstance(causal_lm.forward, FusedLossForward):
        return True
    if "logits_to_keep" not in inspect.signature(causal_lm.forward).parameters:
        return False
    if causal_lm.get_output_embeddings() is None or not hasattr(causal_lm, "get_decoder"):
        return False
    causal_lm.forward = FusedLossForward(causal_lm)
    return True
