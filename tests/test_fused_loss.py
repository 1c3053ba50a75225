"""The fused linear cross-entropy (train/loss.py) gives the loss and gradients of the loss on full logits.

The reference is ``token_loss_sum`` on the logits of the model's own forward (what the trainer computed before the
loss was fused with the head), which projects every position, itself pinned to ``F.cross_entropy`` and to
transformers' own loss. fp32, packed rows (position ids restarting, prompts and padding labelled IGNORE, so the
fused loss projects only part of them) and chunks of 64 tokens that cross row boundaries; one process, then FSDP2
and DDP on two gloo processes, and a two-stage pipeline.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.data.collate import Collator
from shardtune.data.encode import IGNORE
from shardtune.train import loss as loss_module
from shardtune.train.loss import (
    head_loss_sum,
    install_fused_loss,
    loss_chunk_tokens,
    num_targets,
    token_loss_sum,
)

REL_TOL = 1e-5
VOCAB = 700


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """64-token chunks (the smallest), so a batch of 3 x 48 tokens runs three, the last one short."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_VALUES", 1)


def _head_rows(targets: int, positions: int) -> int:
    """The positions the head should project for ``targets`` targets among ``positions``: the targets, rounded
    up to whole 64-row tiles with positions that have none (train/loss.py target_index), at most every one."""
    return min(-(-targets // 64) * 64 or 64, positions)


def _batch(seed: int = 0, rows: int = 3, length: int = 48) -> dict[str, torch.Tensor]:
    """Packed rows: two or three documents each, a masked prompt in every document, one row padded."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        docs = [12, 20, length - 32] if r != 1 else [30, 10]  # row 1 ends in 8 tokens of padding
        ids = torch.randint(3, VOCAB, (sum(docs),), generator=gen).tolist()
        labels, start = list(ids), 0
        for d in docs:
            labels[start:start + 4] = [IGNORE] * 4  # the document's prompt
            start += d
        out.append({"input_ids": ids, "labels": labels, "seq_lens": docs})
    return Collator(0)(out)


def _llama(**overrides):
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config

    config = tiny_llama_config(VOCAB, pad_token_id=0)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _with_lora(model, targets: str):
    from shardtune.config import LoraConfig
    from shardtune.train.model import apply_lora

    return apply_lora(model, LoraConfig(use_peft_lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                        lora_target_modules=targets), seed=1)


def _other_family(kind: str):
    """Families whose forward scales or soft-caps the head's output (caps and scales that matter at these sizes)."""
    from transformers import (
        AutoModelForCausalLM,
        CohereConfig,
        Gemma2Config,
        GraniteConfig,
    )

    sizes = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0}
    config = {"gemma2": lambda: Gemma2Config(**sizes, head_dim=16, final_logit_softcapping=0.5),
              "cohere": lambda: CohereConfig(**sizes, logit_scale=4.0),
              "granite": lambda: GraniteConfig(**sizes, logits_scaling=0.25)}[kind]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _pinned_model(kind: str):
    return _llama() if kind == "llama" else _other_family(kind)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "cohere", "granite"])
def test_the_reference_loss_is_cross_entropy_and_transformers_own_loss(kind):
    """``token_loss_sum``, the reference of these tests and of the family matrix, and the fused loss, pinned to
    what does not come from shardtune: ``F.cross_entropy`` on the logits shifted by hand, and transformers'
    ``model(labels=...).loss`` (mean over the targets, labels -100 ignored), with its gradients. Packed rows
    (position ids restarting at each document, prompts and padding labelled -100), fp32, to 1e-6."""
    import torch.nn.functional as F

    model, batch = _pinned_model(kind), _batch()
    labels = batch["labels"]
    assert (labels == -100).any() and int((batch["position_ids"] == 0).sum()) > labels.shape[0]
    targets = int((labels[:, 1:] != -100).sum())
    theirs = model(**batch)  # transformers shifts the labels and averages over the targets itself
    theirs.loss.backward()
    their_grads = _grads(model)
    logits = model(**_inputs(batch)).logits
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), labels[:, 1:].reshape(-1),
                              ignore_index=-100, reduction="sum")
    ours = token_loss_sum(logits, labels)
    (ours / targets).backward()
    our_grads = _grads(model)
    assert loss_module.num_targets(labels) == targets
    _assert_close(by_hand, ours, "token_loss_sum against F.cross_entropy", rel=1e-6)
    _assert_close(theirs.loss, ours / targets, "token_loss_sum against transformers' loss", rel=1e-6)
    for name, grad in their_grads.items():
        _assert_close(grad, our_grads[name], f"{name}'s gradient", rel=1e-6)
    assert install_fused_loss(model)
    fused = model(**_inputs(batch), loss_labels=labels).loss
    _assert_close(theirs.loss, fused / targets, "fused loss against transformers' loss", rel=1e-6)


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_close(reference: torch.Tensor, other: torch.Tensor, what: str, rel: float = REL_TOL) -> None:
    error = (other.double() - reference.double()).abs().max().item()
    assert error <= rel * reference.double().abs().max().item(), f"{what}: max difference {error}"


def _compare(model) -> None:
    batch = _batch()
    reference = token_loss_sum(model(**_inputs(batch)).logits, batch["labels"])
    reference.backward()
    expected = _grads(model)
    assert install_fused_loss(model)
    fused = model(**_inputs(batch), loss_labels=batch["labels"]).loss
    fused.backward()
    got = _grads(model)
    _assert_close(reference, fused, "loss")
    assert got.keys() == expected.keys() and expected
    for name in expected:
        _assert_close(expected[name], got[name], name)
    with torch.no_grad():
        _assert_close(reference, model(**_inputs(batch), loss_labels=batch["labels"]).loss, "eval loss")


@pytest.mark.parametrize("kind", ["untied", "tied", "lora_all_linear", "lora_on_head", "lora_on_tied_head"])
def test_fused_loss_and_gradients_equal_the_full_logits_ones(kind):
    tied = kind in ("tied", "lora_on_tied_head")
    model = _llama(tie_word_embeddings=tied)
    if tied:
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if kind.startswith("lora"):
        targets = "all-linear" if kind == "lora_all_linear" else "q_proj,v_proj,down_proj,lm_head"
        model = _with_lora(model, targets)
    _compare(model)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_families_that_scale_or_cap_their_logits(kind):
    _compare(_other_family(kind))


def test_a_logit_transform_the_loss_does_not_know_stops_the_run():
    model = _llama()
    assert install_fused_loss(model)
    # Llama's forward ignores this field; the fused loss would cap: its first call sees the logits differ.
    model.config.final_logit_softcapping = 0.1
    model.forward.transform = loss_module.logit_transform(model.config)
    batch = _batch()
    with pytest.raises(RuntimeError, match="model_type llama: its forward changes its logits after the head"):
        model(**_inputs(batch), loss_labels=batch["labels"])


class _LargestLogits(TorchDispatchMode):
    """The most rows of any vocabulary-wide tensor an op makes (forward and backward)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab and t.dim() <= 3:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_op_makes_more_than_one_chunk_of_logits():
    model = _llama()
    install_fused_loss(model)
    batch = _batch()
    with _LargestLogits(VOCAB) as seen:
        model(**_inputs(batch), loss_labels=batch["labels"]).loss.backward()
    # The head's weight [vocab, hidden] and its gradient are the only other vocabulary-wide tensors.
    projected = _head_rows(num_targets(batch["labels"]), batch["input_ids"].numel())
    assert seen.rows == max(loss_chunk_tokens(projected, VOCAB), model.config.hidden_size)
    assert loss_chunk_tokens(projected, VOCAB) < projected


def test_the_head_runs_only_on_positions_with_a_target():
    """The head projects the positions with a target, and others only to fill its last 64-row tile (prompts,
    padding and each row's last position otherwise never reach it), and the loss and gradients are those of every
    position's logits; a micro-batch without any target still gives a loss in the graph (0, zero
    gradients), so every rank's backward hooks run."""
    torch.manual_seed(0)
    hidden = torch.randn(4, 50, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.randint(0, 11, (4, 50))
    labels[:, :32] = IGNORE  # each row's prompt: 18 targets a row, 72 in all, of 200 positions
    rows_seen = []
    hook = head.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))
    expected = token_loss_sum(head(hidden), labels)
    want_hidden, want_head = torch.autograd.grad(expected, (hidden, head.weight))
    rows_seen.clear()
    fused = head_loss_sum(hidden, labels, head, chunk_tokens=64)
    got_hidden, got_head = torch.autograd.grad(fused, (hidden, head.weight))
    _assert_close(expected, fused, "loss")
    _assert_close(want_hidden, got_hidden, "gradient of the hidden states")
    _assert_close(want_head, got_head, "gradient of the head")
    assert num_targets(labels) == 72 and rows_seen == [64, 64] * 2  # 128 rows: forward, then the recomputation
    none = head_loss_sum(hidden, torch.full_like(labels, IGNORE), head)
    assert none.item() == 0 and none.requires_grad
    assert not torch.autograd.grad(none, hidden)[0].any()
    hook.remove()


def test_mixed_precision_upcasts_each_chunk_like_the_full_logits_loss():
    """bf16 autocast and a bf16 frozen base with fp32 adapters: the same loss as the bf16 logits upcast whole
    (the head's bf16 matmul on a chunk may round differently from the whole one's). A bf16 model outside autocast
    (FSDP2's bf16 compute, pure bf16) too: there no autocast upcasts the cross-entropy, the loss itself must (a
    chunk scored in bf16 moved this loss by 4.6e-3)."""
    batch = _batch()
    for model, autocast in ((_llama(), True), (_with_lora(_llama().to(torch.bfloat16), "all-linear"), True),
                            (_llama().to(torch.bfloat16), False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            reference = token_loss_sum(model(**_inputs(batch)).logits, batch["labels"])
            install_fused_loss(model)
            fused = model(**_inputs(batch), loss_labels=batch["labels"]).loss
        assert fused.dtype == torch.float32
        _assert_close(reference, fused, "bf16 loss", rel=2e-3)


def test_head_loss_sum_ignores_the_last_position_of_each_row():
    hidden = torch.randn(2, 5, 8)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.randint(0, 11, (2, 5))
    expected = token_loss_sum(head(hidden), labels)
    _assert_close(expected, head_loss_sum(hidden, labels, head, chunk_tokens=3), "loss")


def _fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from shardtune.dist import DistInfo, shutdown
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan, unwrap

    loss_module.LOSS_CHUNK_VALUES = 1  # the fixture's 64-token chunks, in this process too
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    errors = {}
    cases = {"tied_full_shard_checkpointed": ("FSDP", True, None, True),
             "lora_on_head": ("FSDP", False, "q_proj,lm_head", False), "ddp_untied_full": ("DDP", False, None, False),
             "ddp_lora_tied_head": ("DDP", True, "all-linear", True)}
    for case, (strategy, tied, lora, checkpointing) in cases.items():
        model = _llama(tie_word_embeddings=tied)
        model.tie_weights()
        if lora:
            model = _with_lora(model, lora)
        model, runner = parallelize(model, Plan(strategy=strategy, gradient_checkpointing=checkpointing), info)
        rows = []
        head = unwrap(model).get_output_embeddings()
        # the positions each call of the head projects
        hook = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
        results, reference_rows = [], 0
        for fused in (False, True):
            runner.fused_loss = fused
            rows.clear()
            loss = runner.forward_backward([_batch(seed=rank)], scale=1.0)
            if not fused:  # the full logits: the model's forward projects every position, once
                reference_rows = sum(rows)
            # fused: the model's own forward (its last position per row), then the chunks, then their recomputation
            projected = sum(rows[1:]) // 2
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                eval_loss = runner.eval_loss_sum(_batch(seed=2 + rank))
            results.append((loss, grads, eval_loss))
        hook.remove()
        (ref_loss, ref_grads, ref_eval), (loss, grads, eval_loss) = results
        # Relative to each tensor's largest entry (LoRA's A starts with a zero gradient: B is zero).
        worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ref_grads.items())
        batch = _batch(seed=rank)
        errors[case] = {"loss": abs(loss.item() / ref_loss.item() - 1), "grads": worst,
                        "eval_loss": abs(eval_loss.item() / ref_eval.item() - 1),
                        "same_names": sorted(grads) == sorted(ref_grads), "tensors": len(grads),
                        "head_rows": projected, "reference_rows": reference_rows,
                        "positions": batch["input_ids"].numel(),
                        "expected_rows": _head_rows(num_targets(batch["labels"]), batch["input_ids"].numel())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(errors, f)
    shutdown()  # not destroy_process_group alone: see test_dist_shutdown (SIGABRT at exit)


@pytest.mark.timeout(180)
def test_fsdp2_two_processes_fused_equals_full_logits(tmp_path):
    """FSDP2 FULL_SHARD on 2 gloo ranks, the root (embeddings, norm, head) resharded after forward: a tied head
    under gradient checkpointing, and LoRA on the head; and DDP on the same 2 ranks, full fine-tuning with an
    untied head and LoRA with a tied one; every gradient (gathered) compared, and an eval loss."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, found in errors.items():
            assert found["same_names"] and found["tensors"] > 0, case
            assert max(found["loss"], found["grads"], found["eval_loss"]) <= REL_TOL, (case, found)
            # the reference ran the full logits (every position), the fused loss the targets (in 64-row tiles) only
            assert found["reference_rows"] == found["positions"], (case, found)
            assert found["head_rows"] == found["expected_rows"] < found["positions"], (case, found)


def _all_positions(labels: torch.Tensor) -> torch.Tensor:
    return torch.arange(labels.numel())


def _pipeline_batch() -> dict[str, torch.Tensor]:
    """Four rows whose first half is prompt: each pipeline micro-batch (two rows) has at most 64 targets of its
    96 positions, so the head projects one 64-row tile of each."""
    batch = _batch(rows=4)
    batch["labels"][:, :24] = IGNORE
    return batch


def _pipeline_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from shardtune.dist import DistInfo, shutdown
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan, unwrap

    loss_module.LOSS_CHUNK_VALUES = 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    select = loss_module.target_index
    errors = {}
    for case, lora in {"pp_full": None, "pp_lora": "all-linear"}.items():
        results = []
        for projected in (_all_positions, select):  # every position (the full head's work), then the targets only
            loss_module.target_index = projected
            model = _llama()
            if lora:
                model = _with_lora(model, lora)
            plan = Plan(strategy="PP", stage_bounds=((0, 1), (1, 2)), pipeline_microbatches=2)
            model, runner = parallelize(model, plan, info)
            rows = []
            if rank == 1:
                unwrap(model).get_output_embeddings().register_forward_hook(
                    lambda _m, args, _out: rows.append(args[0].shape[0]))
            loss = runner.forward_backward([_pipeline_batch()], scale=1.0)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss, grads, sum(rows)))
        loss_module.target_index = select
        (ref_loss, ref_grads, all_rows), (loss, grads, target_rows) = results
        worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ref_grads.items())
        errors[case] = {"loss": abs(loss.item() / ref_loss.item() - 1) if rank == 1 else 0.0, "grads": worst,
                        "same_names": sorted(grads) == sorted(ref_grads), "tensors": len(grads),
                        "rows": [all_rows, target_rows]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(errors, f)
    shutdown()


@pytest.mark.timeout(180)
def test_pipeline_target_only_head_equals_every_position(tmp_path):
    """Two pipeline stages, two micro-batches: the last stage's head projects only the targets of each pipeline
    micro-batch, and the loss and every stage's gradients (full fine-tuning, LoRA) are those of projecting
    every position."""
    import torch.multiprocessing as mp

    mp.spawn(_pipeline_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    labels = _pipeline_batch()["labels"]
    assert all(0 < num_targets(half) <= 64 for half in (labels[:2], labels[2:]))
    for rank in range(2):
        for case, found in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            assert found["same_names"] and found["tensors"] > 0, case
            assert max(found["loss"], found["grads"]) <= REL_TOL, (rank, case, found)
            if rank == 1:  # the head's rows over the schedule's shape inference, forwards and recomputations
                assert found["rows"][1] * 96 == found["rows"][0] * 64, found
