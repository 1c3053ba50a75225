"""`shardtune estimate --time`: the step-time arithmetic on a hand-worked case, the published runs it must
reproduce, and the command as a user runs it."""

import io
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from shardtune.cli import main
from shardtune.hardware import GPUS, TYPICAL_PRICE_PER_GPU_HOUR, Gpu, Link, gpu_by_name, host_link, \
    inter_node_link, intra_node_link
from shardtune.memory import compute, timing
from shardtune.memory.inventory import LoraCount, ModelAnalysis, ModelInventory
from shardtune.memory.recommend import evaluate_setup
from shardtune.memory.setup import LOSSES, Setup, validate
from tests.setups import CHECKED_AT_ARGS, checked_setup
from shardtune.memory.timing import Links, count_data_tokens, step_time

# --- The arithmetic, worked by hand ------------------------------------------------------------------------------

LAYERS, HIDDEN, INTER, VOCAB, SEQ = 2, 64, 128, 100, 32
LAYER = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN  # q, k, v, o; gate, up, down; two norms
EMBED = VOCAB * HIDDEN
PARAMS = 2 * EMBED + LAYERS * LAYER + HIDDEN  # embeddings, untied head, final norm
TINY = ModelInventory(
    name="hand", model_type="llama", parameters=PARAMS, num_layers=LAYERS, hidden_size=HIDDEN,
    intermediate_size=INTER, num_heads=4, num_kv_heads=4, head_dim=16, vocab_size=VOCAB, tied_embeddings=False,
    embedding_params=EMBED, head_params=EMBED, other_params=HIDDEN, layer_params=(LAYER,) * LAYERS,
    layer_linear_params=(LAYER - 2 * HIDDEN,) * LAYERS, largest_linear_params=HIDDEN * INTER)
CARD = Gpu("card", 80 << 30, peak_bf16_flops=1e15, memory_bandwidth=2e12)
P = compute.CALIBRATED
LAT = 1e-5  # each link's per-collective latency in these tests (the network's is twice it)
LINKS = Links(intra=Link("fast", "fast", 1e11, latency_s=LAT), inter=Link("net", "net", 1e10, latency_s=2 * LAT),
              host=Link("pcie", "pcie", 2e10))
WEIGHTS = LAYERS * (LAYER - 2 * HIDDEN) + VOCAB * HIDDEN  # every matmul weight: the layers' linears and the head


def hidden_behind(comm: float, compute_s: float) -> float:
    """What the docs state: comm hides behind up to overlap of compute, and 1 - overlap of it always shows."""
    return max(comm - P.overlap * compute_s, (1 - P.overlap) * comm)


def micro_seconds(setup: Setup, lora: LoraCount | None = None) -> float:
    return compute.microbatch(TINY, setup, CARD, 1e15, lora).seconds


def test_microbatch_by_hand():
    """One micro-batch of full fine-tuning with checkpointing, shardtune train's kernels (SDPA with the packed
    rows' mask, eager modules, its chunked loss): matmuls, attention and memory-bound bytes counted by hand."""
    setup = validate(checked_setup(per_device_train_batch_size=3, max_seq_len=SEQ))
    tokens, bandwidth = 3 * SEQ, 2e12 * compute.MEMORY_EFFICIENCY
    streamed = 1 / (P.tile_intensity * bandwidth)  # each FLOP also streams operand tiles
    linear = LAYERS * (LAYER - 2 * HIDDEN)
    flops = 2 * WEIGHTS + 4 * WEIGHTS + 2 * linear  # forward, backward (all trained), each layer's forward again
    attention = 4 * LAYERS * SEQ * HIDDEN * (3.5 + 1)  # QK^T and PV: forward, fused backward (2.5x), recompute
    elementwise = tokens * LAYERS * (2 * HIDDEN + INTER) * P.elementwise_bytes * (1 + 1 / 3)
    loss = tokens * VOCAB * compute.LOSS_BYTES_PER_LOGIT["shardtune"]
    mask = 3 * SEQ * SEQ * LAYERS * 2 * (3 + 1)  # the bf16 mask read by every pass
    # Weights read by forward, backward and recompute; the fp32 gradient accumulated; autocast's bf16 copies.
    weights = WEIGHTS * 2 * 3 + WEIGHTS * 8 + WEIGHTS * 6 * 2
    m = compute.microbatch(TINY, setup, CARD, 1e15)
    assert m.matmul_s == pytest.approx(tokens * flops * (1 / (P.matmul * 1e15) + streamed))
    assert m.attention_s == pytest.approx(tokens * attention * (1 / (P.attention * 1e15) + streamed))
    assert m.memory_s == pytest.approx((elementwise + loss + mask + weights) / bandwidth)


def test_flash_attention_skips_the_keys_behind_a_sliding_window():
    """Flash attention with a layer's sliding window (Mistral v0.1, Gemma 2's sliding layers) multiplies each query
    by at most the window's keys; a kernel that computes the whole square (SDPA with a mask) gains nothing."""
    import dataclasses

    window = 8  # SEQ is 32: query i sees min(i + 1, 8) keys, the window's 8 beyond the first few
    windowed = dataclasses.replace(TINY, attention_windows=(window, None))  # a sliding layer, then a full one
    keys = sum(min(i + 1, window) for i in range(SEQ)) / SEQ  # 7.125, by counting
    assert compute.keys_per_query(SEQ, window, causal=True) == pytest.approx(keys, rel=0.02)  # window - w^2 / 2L
    assert compute.keys_per_query(SEQ, None, causal=True) == SEQ / 2
    assert compute.keys_per_query(window, window, causal=True) == window / 2  # a row within the window: causal
    assert compute.keys_per_query(SEQ, window, causal=False) == SEQ
    flash = validate(checked_setup(per_device_train_batch_size=3, max_seq_len=SEQ,
                                   attn_implementation="flash_attention_2"))
    full, slid = (compute.microbatch(inv, flash, CARD, 1e15).attention_s for inv in (TINY, windowed))
    assert slid / full == pytest.approx((window - window ** 2 / (2 * SEQ) + SEQ / 2) / (2 * SEQ / 2))
    sdpa = validate(checked_setup(per_device_train_batch_size=3, max_seq_len=SEQ))
    assert compute.microbatch(windowed, sdpa, CARD, 1e15) == compute.microbatch(TINY, sdpa, CARD, 1e15)


def test_the_sliding_windows_are_read_as_transformers_runs_them():
    """Mistral v0.1 and Phi-3 slide every layer, Gemma 2 its sliding_attention layer_types (every other layer),
    Qwen2.5 none (use_sliding_window false), Llama none; and a 32k Mistral v0.1 step under flash attention is
    faster than the same shapes without the window."""
    windows = {name: ModelAnalysis(name).inventory.attention_windows
               for name in ("mistral-7b", "phi-3-mini", "gemma-2-9b", "qwen2.5-7b", "llama-3.1-8b")}
    assert windows == {"mistral-7b": (4096,) * 32, "phi-3-mini": (2047,) * 32, "gemma-2-9b": (4096, None) * 21,
                       "qwen2.5-7b": (), "llama-3.1-8b": ()}
    import dataclasses

    mistral = ModelAnalysis("mistral-7b").inventory
    setup = validate(checked_setup(per_device_train_batch_size=1, max_seq_len=32768,
                                   attn_implementation="flash_attention_2"))
    card = GPUS["h100-80gb"]
    slid = compute.microbatch(mistral, setup, card, card.peak_bf16_flops).attention_s
    full = compute.microbatch(dataclasses.replace(mistral, attention_windows=()), setup, card,
                              card.peak_bf16_flops).attention_s
    assert slid / full == pytest.approx((4096 - 4096 ** 2 / (2 * 32768)) / (32768 / 2))  # 0.234: 23% of the keys


@pytest.mark.parametrize("keys, adapters_fused", [({"torch_compile": True}, True),
                                                   ({"use_liger_kernel": True}, False)])
def test_compiled_or_liger_kernels_are_timed_as_fused(keys, adapters_fused):
    """torch_compile (inductor) and use_liger_kernel (Triton) fuse the norms, activations and RoPE: the estimate
    of such a job charges fused_elementwise_bytes where eager modules cost elementwise_bytes. Inductor also fuses
    PEFT's adapter kernels (LORA_BYTES_PER_DIM fused); Liger's kernels leave them eager. Matmuls and attention do
    not move. (An estimate of a recipe setting either had timed eager kernels.)"""
    per_layer = 8 * (4 * (HIDDEN + HIDDEN) + 2 * (HIDDEN + INTER) + (INTER + HIDDEN))  # r=8 on all seven
    lora = LoraCount(8, ("all-linear",), (per_layer,) * LAYERS, 0)
    setup = validate(checked_setup(method="lora", per_device_train_batch_size=3, max_seq_len=SEQ))
    eager = compute.microbatch(TINY, setup, CARD, 1e15, lora)
    fused = compute.microbatch(TINY, setup.with_(**keys), CARD, 1e15, lora)
    tokens, passes = 3 * SEQ, 1 + 1 / 3  # forward, backward, the recomputed forward
    saved = tokens * LAYERS * (2 * HIDDEN + INTER) * (P.elementwise_bytes - P.fused_elementwise_bytes) * passes
    if adapters_fused:
        dims = compute.LORA_BYTES_PER_DIM["eager"] - compute.LORA_BYTES_PER_DIM["fused"]
        saved += tokens * LAYERS * dims * per_layer / 8 * passes  # bytes per unit of in + out, r = 8
    assert (fused.matmul_s, fused.attention_s) == (eager.matmul_s, eager.attention_s)
    assert eager.memory_s - fused.memory_s == pytest.approx(saved / (2e12 * compute.MEMORY_EFFICIENCY))
    # Compiled with a backend that generates no kernels, nothing is fused.
    plain = setup.with_(torch_compile=True, torch_compile_backend="aot_eager")
    assert compute.microbatch(TINY, plain, CARD, 1e15, lora).memory_s == eager.memory_s


def test_ddp_step_by_hand():
    setup = validate(checked_setup(distributed_type="DDP", num_gpus=4, per_device_train_batch_size=3, max_seq_len=SEQ,
                                   gradient_accumulation_steps=2, gradient_checkpointing=False))
    t = step_time(TINY, setup, CARD, LINKS)
    assert t.tokens_per_step == 3 * SEQ * 2 * 4  # rows x tokens x accumulation x GPUs
    # Every weight trains, and all but the input embedding (a lookup) multiply; attention over SEQ tokens.
    flops = 6 * (PARAMS - EMBED) + 12 * LAYERS * HIDDEN * SEQ
    assert t.model_flops_per_token == t.hardware_flops_per_token == flops
    micro = micro_seconds(setup)
    assert t.compute_s == pytest.approx(2 * micro)
    grads = PARAMS * 4  # fp32 gradients of fp32 master weights
    allreduce = 2 * 3 / 4 * grads  # a ring all-reduce sends 2(n-1)/n of the bytes from each GPU
    assert t.comm_bytes == pytest.approx({"intra": allreduce})
    comm = allreduce / 1e11 + 2 * LAT  # one 25 MB bucket: a reduce-scatter and an all-gather's latency
    assert t.comm_s == pytest.approx(comm)
    assert t.exposed_comm_s == pytest.approx(hidden_behind(comm, micro))  # once, in the last backward
    adam = PARAMS * (4 + 4 + 4 + 2 * 8)  # read and write the weight, read the gradient, read and write 2 states
    assert t.optimizer_s == pytest.approx(adam / (2e12 * compute.MEMORY_EFFICIENCY))
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.optimizer_s)
    assert t.mfu == pytest.approx(t.tokens_per_step / t.step_s * flops / (4 * 1e15))


def test_fsdp_lora_across_nodes_by_hand():
    """With LoRA the frozen weights are still gathered, in bf16, forward and backward; only adapters reduce."""
    per_layer = 8 * (4 * (HIDDEN + HIDDEN) + 2 * (HIDDEN + INTER) + (INTER + HIDDEN))  # r=8 on all seven
    lora = LoraCount(8, ("all-linear",), (per_layer,) * LAYERS, 0)
    setup = validate(checked_setup(method="lora", distributed_type="FSDP", fsdp_sharding_strategy="FULL_SHARD",
                                   num_gpus=2, num_nodes=3, per_device_train_batch_size=2, max_seq_len=SEQ,
                                   gradient_accumulation_steps=4))
    t = step_time(TINY, setup, CARD, LINKS, lora)
    adapters = LAYERS * per_layer
    assert t.tokens_per_step == 2 * SEQ * 4 * 6
    model = 6 * adapters + 4 * (PARAMS - EMBED) + 12 * LAYERS * HIDDEN * SEQ  # the input embedding: a lookup
    recompute = 2 * (LAYERS * LAYER + adapters) + 4 * LAYERS * HIDDEN * SEQ  # each layer's forward once more
    assert t.model_flops_per_token == model
    assert t.hardware_flops_per_token == model + recompute
    root, layers = 2 * (2 * EMBED + HIDDEN), 2 * (LAYERS * LAYER + adapters)  # bf16, as FSDP gathers them
    gathered = root + 2 * layers  # forward: everything; backward: the decoder layers again (the root stays)
    grads = 4 * adapters  # fp32 adapters' gradients, reduce-scattered every micro-batch (they stay sharded)
    g, n = 2, 3

    def per_link(nbytes):  # hierarchical: (n-1)/n of the GPU's 1/g slice between nodes, (g-1)/g inside
        return {"intra": (g - 1) / g * nbytes, "inter": (n - 1) / n * nbytes / g}

    expected = {k: 4 * (per_link(gathered)[k] + per_link(grads)[k]) for k in ("intra", "inter")}
    assert t.comm_bytes == pytest.approx(expected)
    # Collectives, every micro-batch: an all-gather per unit (2 layers and the root) forward and per layer
    # backward; a reduce-scatter per unit. Each pays the latency of both links.
    gather_comm = per_link(gathered)["intra"] / 1e11 + per_link(gathered)["inter"] / 1e10 + 5 * 3 * LAT
    reduce_comm = per_link(grads)["intra"] / 1e11 + per_link(grads)["inter"] / 1e10 + 3 * 3 * LAT
    micro = micro_seconds(setup, lora)
    assert t.exposed_comm_s == pytest.approx(4 * hidden_behind(gather_comm + reduce_comm, micro))


def test_hybrid_shard_without_resharding_gathers_its_layers_once_a_micro_batch():
    """fsdp_reshard_after_forward false keeps each layer gathered from its forward to its backward (FSDP2, as
    train/plan.py sets it): HYBRID_SHARD then all-gathers the decoder layers once per micro-batch inside the node,
    not twice; the root is gathered once either way."""
    def intra(**keys) -> float:
        setup = validate(checked_setup(distributed_type="FSDP", fsdp_sharding_strategy="HYBRID_SHARD", num_gpus=2,
                                       num_nodes=3, per_device_train_batch_size=2, max_seq_len=SEQ,
                                       gradient_accumulation_steps=4, **keys))
        return step_time(TINY, setup, CARD, LINKS, None).comm_bytes["intra"]

    layers = 2 * LAYERS * LAYER  # bf16, as FSDP gathers them
    assert intra() - intra(fsdp_reshard_after_forward=False) == pytest.approx((2 - 1) / 2 * layers * 4)
    assert intra(fsdp_reshard_after_forward=True) == intra()


def test_offload_copies_shards_over_pcie_and_steps_on_the_cpu():
    setup = validate(checked_setup(distributed_type="FSDP", fsdp_offload_params=True, num_gpus=2,
                                   per_device_train_batch_size=1, max_seq_len=SEQ))
    t = step_time(TINY, setup, CARD, LINKS)
    fp32_layers, fp32_root = 4 * LAYERS * LAYER, 4 * (2 * EMBED + HIDDEN)
    copied_in = (fp32_root + 2 * fp32_layers) / 2  # the GPU's shard, before each all-gather
    copied_out = 4 * PARAMS / 2  # its gradient shard back to the host
    assert t.comm_bytes["host"] == pytest.approx(copied_in + copied_out)
    # over PCIe: the copies take their bytes at the host link's rate, on top of the collectives the job runs anyway
    plain = step_time(TINY, validate(checked_setup(distributed_type="FSDP", num_gpus=2, per_device_train_batch_size=1,
                                                   max_seq_len=SEQ)), CARD, LINKS)
    assert t.comm_bytes["intra"] == plain.comm_bytes["intra"]
    assert t.comm_s - plain.comm_s == pytest.approx((copied_in + copied_out) / LINKS.host.bytes_per_s)
    # PyTorch's unfused CPU AdamW: ~100 bytes of memory traffic per parameter, at 80% of a server's two sockets
    # of eight DDR4-3200 channels (25.6 GB/s each).
    host = 0.8 * 2 * 8 * 25.6e9
    assert t.optimizer_s == pytest.approx(PARAMS * 100 / host)
    fused = step_time(TINY, setup.with_(optim="adamw_torch_fused"), CARD, LINKS)
    assert fused.optimizer_s == pytest.approx(PARAMS * 28 / host)  # read 4 fp32 values, write 3


def test_model_parallel_is_one_gpus_speed_and_pipeline_idles_for_its_bubble():
    single = step_time(TINY, validate(checked_setup(per_device_train_batch_size=4, max_seq_len=SEQ)), CARD, LINKS)
    mp = step_time(TINY, validate(checked_setup(distributed_type="MP", num_gpus=2, per_device_train_batch_size=4,
                                                max_seq_len=SEQ)), CARD, LINKS,
                   stage_bounds=((0, 1), (1, 2)))
    assert mp.tokens_per_step == single.tokens_per_step  # one process, one batch: no data parallelism
    assert mp.compute_s == pytest.approx(single.compute_s)  # the stages compute one after another
    handover = 4 * SEQ * HIDDEN * 4 * 2  # fp32 residual forward, its gradient back, over one boundary
    assert mp.comm_bytes == pytest.approx({"intra": handover})
    # Each stage updates its own layers' weights, at the same time as the other.
    assert mp.step_s == pytest.approx(mp.compute_s + handover / 1e11 + single.optimizer_s / 2)
    assert mp.mfu == pytest.approx(mp.tokens_per_s * mp.model_flops_per_token / (2 * 1e15))  # both GPUs count
    pp = step_time(TINY, validate(checked_setup(distributed_type="PP", num_gpus=2, per_device_train_batch_size=4,
                                                max_seq_len=SEQ)), CARD, LINKS,
                   stage_bounds=((0, 1), (1, 2)), pipeline_microbatches=4)
    share = (LAYER + VOCAB * HIDDEN) / (2 * LAYER + VOCAB * HIDDEN)  # the last stage runs the head too
    assert pp.compute_s == pytest.approx((4 + 2 - 1) * share * single.compute_s / 4)


# --- Published runs ---------------------------------------------------------------------------------------------
# Trelis Research, "Multi-GPU fine-tuning" (trelis.substack.com/p/multi-gpu-fine-tuning-for-llms): LoRA with
# gradient checkpointing, 1024 rows of 1024 tokens, 4 x RTX 6000 Ada ("A6000 Ada") 48 GB. Their LoRA rank and
# targets are not stated; the FLOPs hardly depend on them (the frozen base dominates).
TRELIS_TOKENS = 1024 * 1024
# A factor of 2 either way: what a model calibrated on a handful of runs, on hardware it has not seen, can promise.
FACTOR = 2.0


def predict(model: str, setup: Setup, gpu: str) -> timing.StepTime:
    analysis = ModelAnalysis(model)
    setup = validate(setup)
    lora = analysis.lora_of(setup)
    card = gpu_by_name(gpu)
    breakdown = evaluate_setup(analysis, setup)
    assert breakdown.fits(card.memory_bytes), f"{model} {setup.label()} must fit {gpu} as it did in the run"
    links = Links(intra_node_link(card), inter_node_link(card), host_link(card))
    return step_time(analysis.inventory, setup, card, links, lora, breakdown.stage_bounds)


def within(predicted: float, published: float, factor: float = FACTOR) -> bool:
    return published / factor <= predicted <= published * factor


def trelis(model: str, batch: int, accumulation: int, strategy: str) -> timing.StepTime:
    base = checked_setup(method="lora", num_gpus=4, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=accumulation, max_seq_len=1024)
    return predict(model, base.with_(distributed_type=strategy), "a6000-ada")


def test_tinyllama_model_parallel_against_ddp_as_published():
    """Published: MP 3 min 53 s at ~24% utilisation, DDP 59 s at ~90% (batch 16, accumulation 2): MP is one of
    four GPUs busy at a time."""
    ddp, mp = trelis("tinyllama-1.1b", 16, 2, "DDP"), trelis("tinyllama-1.1b", 16, 2, "MP")
    published_ratio = (3 * 60 + 53) / 59  # 3.95
    assert within(mp.seconds_for(TRELIS_TOKENS) / ddp.seconds_for(TRELIS_TOKENS), published_ratio, 1.25)


def test_tinyllama_times_as_published():
    """Published: DDP 59 s, MP 3 min 53 s. The model predicts both 2.5-2.8x faster (21 s and 95 s): the RTX 6000
    Ada computes slower than its data sheet's peak says, as Answer.AI's 4 x RTX 6000 Ada run (1.54x too fast,
    bench/results/calibration.md) also shows, and the Trelis figures could not be re-read, so they are not in the
    calibration set (docs/estimator.md). The test holds the known gap to its size, so a change that moves it
    either way is caught (the MP/DDP ratio, above, is as published)."""
    for strategy, published in (("DDP", 59), ("MP", 3 * 60 + 53)):
        predicted = trelis("tinyllama-1.1b", 16, 2, strategy).seconds_for(TRELIS_TOKENS)
        assert 2.0 <= published / predicted <= 3.5, f"{strategy}: predicted {predicted:.0f} s against {published}"


def test_codellama_34b_fsdp_time_as_published():
    """Published: FSDP 30 min at ~100% utilisation (batch 4, accumulation 4). The model predicts 26.5 min, 1.13x
    faster, most of it the all-gathers over PCIe. A factor of 2 either way (FACTOR) also took all-gathers that move
    every byte instead of (G-1)/G of them (34 min): the band holds the known gap to its size, as the model
    parallel test below does, so a change that moves the prediction either way is caught."""
    predicted = trelis("codellama-34b", 4, 4, "FSDP").seconds_for(TRELIS_TOKENS)
    assert within(predicted, 30 * 60)
    assert 1.0 <= 30 * 60 / predicted <= 1.25, f"predicted {predicted / 60:.1f} min against the published 30"


def test_codellama_34b_model_parallel_time_as_published():
    """Published: model parallel 47 min (batch 4, accumulation 4). The model predicts it about 2.0x faster (23
    min): one RTX 6000 Ada computes slower than its data sheet's peak says, as Answer.AI's 4 x RTX 6000 Ada run
    (1.53x too fast, bench/results/calibration.md) also shows, and the Trelis figures could not be re-read, so
    they are not in the calibration set (docs/estimator.md). The test holds the known gap to its size: the
    prediction stays 1.5x to 2.5x faster than published, so a change that moves it either way is caught. (With
    FSDP's time as published and this one too fast, the model ranks MP ahead of FSDP here, where Trelis measured
    FSDP faster.)"""
    predicted = trelis("codellama-34b", 4, 4, "MP").seconds_for(TRELIS_TOKENS)
    assert 1.5 <= 47 * 60 / predicted <= 2.5, f"predicted {predicted / 60:.1f} min against the published 47"


def test_offloaded_full_fine_tune_on_two_4090s_is_tens_of_times_slower_than_one_h100():
    """Issue 19: Llama-3-8B fully fine-tuned with parameter offload on 2 x RTX 4090 took ~72 h, where one H100
    takes an hour or two: 36 to 72 times longer. The H100 run keeps weights and AdamW states in bf16 to fit."""
    offload = predict("llama-3-8b", checked_setup(distributed_type="FSDP", fsdp_offload_params=True, num_gpus=2,
                                                  max_seq_len=2048),
                      "rtx4090")
    h100 = predict("llama-3-8b", checked_setup(torch_dtype="bfloat16", max_seq_len=2048), "h100-80gb")
    assert 36 / FACTOR <= h100.tokens_per_s / offload.tokens_per_s <= 72 * FACTOR


def test_h100_and_a100_speeds_of_tuned_stacks_bound_the_prediction():
    """torchtitan (benchmarks/llama3_h100_202412_torchtitan.md): Llama-3.1-8B, FSDP on 8 H100, local batch 2 of
    8192 tokens, selective checkpointing, eager: 5,762 tokens/s per GPU (33% MFU). torchtitan (docs/performance.md):
    Llama-3-8B on 64 A100 80GB, batch 1 of 8192, selective checkpointing: 2,904 tokens/s per GPU (56.8% MFU).
    shardtune checkpoints whole layers (more recomputation than selective checkpointing): the prediction is for
    that, and must still land within the factor."""
    h100 = predict("llama-3.1-8b", checked_setup(distributed_type="FSDP", num_gpus=8, per_device_train_batch_size=2,
                                                 max_seq_len=8192), "h100-80gb")
    assert within(h100.tokens_per_s / 8, 5762)
    assert 0.33 / FACTOR <= h100.mfu <= 0.46  # LLM Foundry's best H100 bf16 MFU is 46%
    a100 = predict("llama-3-8b", checked_setup(distributed_type="FSDP", num_gpus=8, num_nodes=8,
                                               per_device_train_batch_size=1, max_seq_len=8192),
                   "a100-80gb")
    assert within(a100.tokens_per_s / 64, 2904)
    assert a100.mfu < 0.568  # eager transformers modules stay under torchtitan's tuned figure


def test_a_mixture_of_experts_computes_with_the_experts_its_router_picks():
    """Mixtral-8x7B: a token runs attention, the router and 2 of its 8 experts. transformers 5 stores the experts
    as 3-D tensors, outside the nn.Linear count; the time must come from the routed experts all the same (it was
    negative: the 6 idle experts were subtracted from a count that never held them)."""
    from shardtune import catalog

    c = catalog.load("mixtral-8x7b")
    h, i, layers, kv = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_key_value_heads"]
    head_dim = h // c["num_attention_heads"]
    attention = 2 * h * h + 2 * h * kv * head_dim
    per_layer = attention + c["num_local_experts"] * h + c["num_experts_per_tok"] * 3 * h * i + 2 * h  # + norms
    inv = ModelAnalysis("mixtral-8x7b").inventory
    assert compute.active_linear_params(inv) == layers * per_layer
    for method, nodes in (("lora", 1), ("qlora", 1), ("full", 2)):
        step = predict("mixtral-8x7b", checked_setup(distributed_type="FSDP", num_gpus=8, num_nodes=nodes,
                                                     method=method, per_device_train_batch_size=2,
                                                     max_seq_len=2048), "h100-80gb")
        assert step.compute_s > 0 and 0.05 < step.mfu < 0.6, (method, step.compute_s, step.mfu)


# --- Data, links and prices ---------------------------------------------------------------------------------------

def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _word_tokenizer_folder(tmp_path):
    """A model folder whose tokenizer.json makes one token of each whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["alpha", "beta", "gamma", "delta"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_data_tokens_with_the_models_tokenizer_and_approximately(tmp_path):
    folder = _word_tokenizer_folder(tmp_path)
    rows = [{"text": "alpha beta gamma"},
            {"messages": [{"role": "user", "content": "delta delta"}, {"role": "assistant", "content": "alpha"}]},
            {"prompt": "beta " * 40, "completion": "gamma"}]
    data = _write_rows(tmp_path / "train.jsonl", rows)
    # Every string of a row, one word a token (the roles too); the third row's 41 words are cut at 16.
    words_per_row = [3, 1 + 2 + 1 + 1, min(40 + 1, 16)]
    exact = count_data_tokens(str(data), str(folder), seq_len=16)
    assert (exact.tokens, exact.rows, exact.exact) == (sum(words_per_row), 3, True)
    approx = count_data_tokens(str(data), "llama-3-8b", seq_len=16)
    texts = ["alpha beta gamma", "user\ndelta delta\nassistant\nalpha", "beta " * 40 + "\ngamma"]
    assert approx.tokens == sum(min(math.ceil(len(t) / 4), 16) for t in texts)
    assert not approx.exact and "approximate" in approx.describe()


def test_data_tokens_with_a_tokenizer_the_hub_cache_holds(tmp_path, monkeypatch):
    """A catalog name or a hub id counted --data at about 4 characters a token even where the local Hugging Face
    cache held the model's tokenizer.json: it is now read from there, by the catalog model's Hugging Face id."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    data = _write_rows(tmp_path / "train.jsonl", [{"text": "alpha beta gamma"}, {"text": "delta " * 40}])
    before = count_data_tokens(str(data), "llama-3-8b", seq_len=16)
    assert not before.exact and "'hf download ID tokenizer.json' puts in the cache" in before.describe()
    tokenizer = _word_tokenizer_folder(tmp_path) / "tokenizer.json"
    for repo in ("meta-llama/Meta-Llama-3-8B", "someone/word-model"):
        snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
        shutil.copy(tokenizer, snapshot / "tokenizer.json")
    for model in ("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "someone/word-model"):
        counted = count_data_tokens(str(data), model, seq_len=16)
        assert (counted.tokens, counted.exact) == (3 + 16, True), model  # one token a word, the second row cut


def test_data_tokens_count_only_the_columns_the_trainer_reads(tmp_path, capsys):
    """A data set's other columns (an id, a source, UltraChat's prompt that its messages repeat) train no token:
    --data counted every string of a row, so a chat file with a long metadata column came out several times the
    tokens (and the hours and dollars) it trains on. Each row counts what its format reads; the text field is the
    job's dataset_text_field."""
    folder = _word_tokenizer_folder(tmp_path)
    chat = [{"role": "user", "content": "delta delta"}, {"role": "assistant", "content": "alpha"}]
    rows = [{"prompt_id": "alpha " * 30, "prompt": "delta delta", "messages": chat, "source": "gamma " * 30},
            {"id": "beta " * 30, "prompt": "beta", "completion": "gamma"},
            {"instruction": "alpha", "input": "", "output": "beta", "url": "gamma " * 30},
            {"content": "alpha beta", "meta": "gamma " * 30}]
    data = _write_rows(tmp_path / "train.jsonl", rows)
    from shardtune.data.templates import alpaca_prompt

    # What each row's format reads: an Alpaca row without a chat template trains on the Alpaca prompt around its
    # fields (the preamble's words count), with one as a user and an assistant turn.
    read = [chat, ["beta", "gamma"], [alpaca_prompt("alpha", ""), "beta"], ["alpha beta"]]
    exact = count_data_tokens(str(data), str(folder), seq_len=64, text_field="content")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert exact.tokens == sum(len(tokenizer.encode(_every_string(r)).ids) for r in read)
    approx = count_data_tokens(str(data), "llama-3-8b", seq_len=64, text_field="content")
    assert approx.tokens == sum(math.ceil(len(_every_string(r)) / 4) for r in read)
    read[2] = [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]
    as_chat = count_data_tokens(str(data), str(folder), seq_len=64, text_field="content", alpaca_as_chat=True)
    assert as_chat.tokens == sum(len(tokenizer.encode(_every_string(r)).ids) for r in read) == 13
    # A chat file in CSV holds its messages as JSON text, read as the trainer reads it: the roles and contents.
    with (tmp_path / "chat.csv").open("w", newline="") as f:
        f.write("messages,source\n" + '"' + json.dumps(chat).replace('"', '""') + '",' + "gamma " * 30 + "\n")
    assert count_data_tokens(str(tmp_path / "chat.csv"), str(folder), seq_len=64).tokens == \
        len(tokenizer.encode(_every_string(chat)).ids) == 5
    # The command line reads the text field of the job a --config recipe describes.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: llama-3.2-1b\ndataset_name: d\ndataset_text_field: content\n"
                      "max_seq_len: 64\n")
    assert main(["estimate", "--config", str(recipe), "--gpu", "h100-80gb", "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timing"]["data_tokens"] == approx.tokens


def _every_string(value) -> str:
    """The strings of ``value`` one per line, as the count joins a row's (roles and contents of messages)."""
    if isinstance(value, str):
        return value
    parts = value.values() if isinstance(value, dict) else value
    return "\n".join(t for t in (_every_string(v) for v in parts) if t)


def test_links_default_to_the_cards_own_and_can_be_overridden():
    assert intra_node_link(GPUS["h100-80gb"]).name == "nvlink4"
    assert intra_node_link(GPUS["a100-80gb"]).name == "nvlink3"
    # GeForce cards: no NVLink, and no peer-to-peer over PCIe either: copies go through host memory.
    assert intra_node_link(GPUS["rtx4090"]).name == "pcie4-host"
    assert intra_node_link(GPUS["a6000-ada"]).name == "pcie4"
    assert intra_node_link(GPUS["h100-80gb"], "pcie").name == "pcie5"
    assert intra_node_link(GPUS["a6000"], "nvlink").name == "nvlink-bridge"
    assert inter_node_link(GPUS["h100-80gb"]).name == "infiniband"
    assert inter_node_link(GPUS["rtx4090"], "infiniband-ndr").name == "infiniband"
    assert set(TYPICAL_PRICE_PER_GPU_HOUR) <= set(GPUS)  # priced cards are offered ones


def test_the_docs_list_every_link_the_options_take():
    """docs/estimator.md's rows for --interconnect and --inter-node name every link they accept."""
    from pathlib import Path

    from shardtune.hardware import INTER_NODE_LINKS, INTRA_NODE_LINKS, LINK_ALIASES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "estimator.md").read_text()
    for option, links in (("--interconnect", INTRA_NODE_LINKS), ("--inter-node", INTER_NODE_LINKS)):
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{option} NAME`"))
        named = set(re.findall(r"`([a-z0-9-]+)`", row))
        assert set(links) <= named, f"{option}: the docs leave out {sorted(set(links) - named)}"
        assert named - {option.lstrip("-")} <= set(links) | set(LINK_ALIASES), f"{option}: the docs name others"


def test_a_card_without_a_typical_price_asks_for_yours(capsys):
    """The cards added with their data sheets (L4, T4, B200, ...) have no typical price recorded: the cost
    column says so instead of guessing."""
    unpriced = next(name for name in GPUS if name not in TYPICAL_PRICE_PER_GPU_HOUR and GPUS[name].peak_bf16_flops)
    assert main(["estimate", "llama-3.2-1b", "--gpu", unpriced, "--tokens", "1M", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["timing"]
    assert out["price_per_gpu_hour"] is None and all(row["cost_usd"] is None for row in out["setups"])
    assert "--price-per-gpu-hour" in out["price_source"]


def test_gradients_are_reduced_as_often_as_the_trainer_reduces_them():
    """Over an accumulation of 8 micro-batches the trainer reduce-scatters sharded gradients every micro-batch
    (Strategy.defers_gradient_sync) and all-reduces whole ones (DDP, NO_SHARD) once: the estimate's traffic does the
    same. It charged one reduce-scatter per step to every FSDP sharding, FULL_SHARD's step 10% too fast."""
    from shardtune.strategies import lookup

    def traffic(strategy: str, sharding: str, accum: int) -> dict:
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stdout", out)
            sharded = ["--sharding-strategy", sharding] if strategy == "FSDP" else []
            assert main(["estimate", "llama-3.2-1b", "--num-gpus", "8", "--strategy", strategy, *sharded,
                         "--batch-size", "1", "--gradient-accumulation-steps", str(accum), "--json", "--time",
                         *CHECKED_AT_ARGS]) == 0
        rows = json.loads(out.getvalue())["timing"]["setups"]
        return next(r for r in rows if r["setup"].startswith(strategy if strategy == "DDP" else f"FSDP {sharding}"))

    for strategy, sharding in (("FSDP", "FULL_SHARD"), ("FSDP", "SHARD_GRAD_OP"), ("FSDP", "NO_SHARD"),
                               ("DDP", "FULL_SHARD")):
        one, eight = (traffic(strategy, sharding, accum)["comm_bytes_per_gpu"]["intra"] for accum in (1, 8))
        deferred = lookup(strategy).defers_gradient_sync(sharding)
        assert deferred == (strategy == "DDP" or sharding == "NO_SHARD")
        if deferred:  # the reduction once per step (DDP and NO_SHARD gather nothing: the same bytes over 8)
            assert one == eight > 0, (strategy, sharding)
        else:  # gathers and reduce-scatters, every micro-batch
            assert eight == pytest.approx(8 * one), (strategy, sharding)


def test_a_slower_network_slows_multi_node_fsdp():
    base = ["llama-3-8b", "--num-gpus", "8", "--num-nodes", "4", "--strategy", "fsdp", "--json", *CHECKED_AT_ARGS]
    steps = {}
    for net in ("infiniband", "ethernet-100g"):
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stdout", out)
            assert main(["estimate", *base, "--inter-node", net]) == 0
        rows = json.loads(out.getvalue())["timing"]["setups"]
        steps[net] = next(r["step_s"] for r in rows if r["setup"] == "FSDP FULL_SHARD")
    assert steps["ethernet-100g"] > 2 * steps["infiniband"]


def test_every_loss_the_estimate_accepts_is_timed():
    """Each ``--loss`` choice has its bytes per logit; transformers <= 4.44's shifted copy adds its copy forward
    and the scatter of the gradient back (20 bytes a logit) to the full loss, nothing else."""
    assert set(compute.LOSS_BYTES_PER_LOGIT) == set(LOSSES)
    setup = validate(checked_setup(per_device_train_batch_size=3, max_seq_len=SEQ, loss="full"))
    full, shifted = (compute.microbatch(TINY, s, CARD, 1e15) for s in (setup, setup.with_(loss="full-shifted")))
    extra = 3 * SEQ * VOCAB * 20 / (2e12 * compute.MEMORY_EFFICIENCY)
    assert shifted.memory_s - full.memory_s == pytest.approx(extra)
    assert (shifted.matmul_s, shifted.attention_s) == (full.matmul_s, full.attention_s)


# --- The command ----------------------------------------------------------------------------------------------------

ARGS = ["llama-3-8b", "--num-gpus", "8", "--tokens", "250M", *CHECKED_AT_ARGS]


def test_json_carries_each_setups_time_and_cost(capsys):
    assert main(["estimate", *ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    timing_out = out["timing"]
    assert timing_out["data_tokens"] == 250_000_000 and timing_out["data_tokens_counted"] == "given"
    assert timing_out["price_per_gpu_hour"] == TYPICAL_PRICE_PER_GPU_HOUR["h100-80gb"]
    assert "2026-11" in timing_out["price_source"] and "typical" in timing_out["price_source"]
    assert [s["setup"] for s in timing_out["setups"]] == [s["setup"] for s in out["strategies"]]
    for row in timing_out["setups"]:
        assert row["data_seconds"] == pytest.approx(250_000_000 / row["tokens_per_s"])
        assert row["cost_usd"] == pytest.approx(row["data_seconds"] / 3600 * 8 * timing_out["price_per_gpu_hour"])
        # MFU: the model's FLOPs per second over the 8 GPUs' bf16 peak (the hardware table's).
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["model_flops_per_token"]
                                           / (8 * GPUS["h100-80gb"].peak_bf16_flops))


def test_small_models_carry_the_host_bound_caution_with_the_measured_ratio(capsys):
    """A 1B model's estimate cautions that eager kernel launches can bound its step, quoting shardtune's own H200
    run: the ratio it quotes is the calibration point's measured speed against this estimate of the same job."""
    from shardtune.memory.calibration import load_points
    from shardtune.memory.report import SMALL_MODEL_MEASURED

    job = ["estimate", "llama-3.2-1b", "--method", "lora", "--lora-r", "16", "--gpu", "h200", "--time",
           "--batch-size", "4", "--seq-len", "2048"]
    assert main([*job, "--json"]) == 0
    timing_out = json.loads(capsys.readouterr().out)["timing"]
    predicted = timing_out["setups"][0]["tokens_per_s"]
    measured = next(p for p in load_points() if p.id == "shardtune-h200-1b-lora").tokens_per_s()
    assert f"ran {predicted / measured:.1f}x slower than predicted" in SMALL_MODEL_MEASURED
    assert "1.2 B parameters" in timing_out["caution"] and SMALL_MODEL_MEASURED in timing_out["caution"]
    assert main(job) == 0
    assert "caution: with 1.2 B parameters" in capsys.readouterr().out
    assert main(["estimate", "llama-3.1-8b", "--method", "lora", "--gpu", "h200", "--time", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timing"]["caution"] is None
    # The demo's 0.87M-parameter model was "with 0.0B parameters"
    from shardtune.demo.base import BASE_MODEL_DIR

    assert main(["estimate", str(BASE_MODEL_DIR), "--seq-len", "128", "--gpu", "h200", "--time", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1e5 < out["parameters"] < 1e6
    assert f"caution: with {out['parameters'] / 1e3:.1f} k parameters" in out["timing"]["caution"]


def time_rows_at_80_columns(args: list[str]) -> tuple[str, list[str]]:
    """``estimate ARGS`` printed on an 80-column terminal: the whole text, and the time table's setup rows."""
    with pytest.MonkeyPatch.context() as mp:
        out = io.StringIO()
        mp.setattr("rich.console.Console", lambda *a, **k: Console(file=out, width=80, color_system=None))
        assert main(["estimate", *args]) == 0
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    table = text[text.index("Time and cost side by side"):]
    return table, [line for line in table.splitlines() if re.match(r"^ ?(DDP|FSDP|model|single)", line)]


def test_table_reads_at_80_columns_and_shows_the_price_as_typical(capsys):
    assert main(["estimate", *ARGS, "--price-per-gpu-hour", "2.5"]) == 0
    given = capsys.readouterr().out
    assert "$2.50 per GPU-hour (--price-per-gpu-hour)" in given
    table, rows = time_rows_at_80_columns(ARGS)
    assert len(rows) == 5 and all("…" not in r for r in rows)
    assert "typical on-demand list price (2026-11" in table


def test_a_setup_at_a_smaller_micro_batch_keeps_the_figures_whole_at_80_columns(capsys):
    """The recommended setup at a smaller micro-batch is labelled "FSDP SHARD_GRAD_OP b16x4 *": at 80 columns its
    label squeezed every figure column, to "16.7…" seconds, "tokens…", "9.…" MFU. The label wraps instead, and each
    row shows its --json figures."""
    args = ["llama-3.1-8b", "--num-gpus", "4", "--gpu", "h100-80gb", "--batch-size", "64", "--time"]
    assert main(["estimate", *args, "--json"]) == 0
    setups = json.loads(capsys.readouterr().out)["timing"]["setups"]
    table, rows = time_rows_at_80_columns(args)
    assert "…" not in table and "tokens/s" in table and "b16x4" in table
    assert len(rows) == len(setups) == 6
    for row, setup in zip(rows, setups, strict=True):
        mfu = f"{setup['mfu']:.0%}" if setup["mfu"] >= 0.1 else f"{setup['mfu']:.1%}"
        assert f" {setup['tokens_per_s']:,.0f} " in row and f" {mfu} " in row


def test_the_longest_job_keeps_the_tables_columns_in_years_and_short_dollars(capsys):
    """At the most tokens --tokens takes, on 126 GPUs (the most model parallel runs on: one per decoder layer) at
    $10 per GPU-hour, model parallel's 169 tokens/s takes some 190,000 years and $2 trillion: each row still reads
    whole at 80 columns, its time in years and its cost as $1.23M / $4.56B / $7.89T, the figures the --json rows
    give."""
    args = ["llama-3.1-405b", "--gpu", "h200", "--num-gpus", "126", "--tokens", "1000T", "--price-per-gpu-hour", "10",
            *CHECKED_AT_ARGS]
    assert main(["estimate", *args, "--json"]) == 0
    setups = json.loads(capsys.readouterr().out)["timing"]["setups"]
    _, rows = time_rows_at_80_columns(args)
    assert len(rows) == len(setups) == 5 and all("…" not in r for r in rows)
    units = {"M": 1e6, "B": 1e9, "T": 1e12}
    for row, setup in zip(rows, setups, strict=True):
        years, cost = re.search(r"(\S+) y +\$(\S+)$", row.rstrip()).groups()
        assert float(years) == pytest.approx(setup["data_seconds"] / (365.25 * 86400), rel=5e-3)
        assert float(cost[:-1]) * units[cost[-1]] == pytest.approx(setup["cost_usd"], rel=5e-3)
    assert [row.rstrip()[-6:] for row in rows] == ["$30.1B", "$20.8B", "$22.8B", " $191B", "$2.07T"]
    assert rows[-1].startswith(" model parallel") and " 169 " in rows[-1] and "1.88e+05 y" in rows[-1]


def test_plot_writes_the_time_and_cost_chart_beside_the_memory_one(tmp_path, capsys, monkeypatch):
    """The time chart's bars are the --json rows' hours and dollars, setup by setup in their order, and each PNG
    written is the figure drawn (its size in pixels)."""
    from tests.pictures import drawn_size, keep_saved_figures, png_size

    drawn = keep_saved_figures(monkeypatch)
    assert main(["estimate", *ARGS, "--json", "--plot", str(tmp_path / "setups.png")]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["timing"]["setups"]
    assert "setups-time.png" in captured.err and sorted(drawn) == ["setups-time.png", "setups.png"]
    time_chart, _ = drawn["setups-time.png"]
    for ax, key, unit in zip(time_chart.axes, ("data_seconds", "cost_usd"), (3600, 1), strict=True):
        heights = [bar.get_height() for bar in ax.patches if bar.get_gid() == "setup"]
        assert heights == pytest.approx([row[key] / unit for row in rows], rel=1e-12)
    for name, (fig, dpi) in drawn.items():
        assert png_size(tmp_path / name) == drawn_size(fig, dpi), name


@pytest.mark.parametrize("args, message", [
    (["--gpu-memory", "40", "--time"], "peak FLOPs"),
    (["--gpu", "a10g", "--time"], "--gpu-spec tflops="),  # a table card without a published tensor-core peak
    (["--gpu", "t4", "--time"], "does not compute bf16; give --mixed-precision fp16"),
    (["--gpu", "rtx4090", "--interconnect", "nvlink"], "has no NVLink"),
    (["--interconnect", "carrier-pigeon"], "unknown interconnect"),
    (["--tokens", "lots"], "not a token count"),
    (["--tokens", "1e30"], "'1e30' is more than 1,000T tokens"),  # past any data set: a typo, not a job
    (["--tokens", "inf"], "'inf' is more than 1,000T tokens"),
    (["--data", "missing.jsonl"], "--data missing.jsonl: no such file"),  # it said 'not a data file' of a .jsonl
    (["--data", tempfile.gettempdir()], "a folder, not a data file; give its training file"),  # train takes folders
    (["--data", __file__], "not a data file"),
])
def test_bad_time_options_are_one_line_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "shardtune", "estimate", "llama-3-8b", *CHECKED_AT_ARGS, *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_time_of_a_catalog_model_imports_no_torch_transformers_or_numpy(tmp_path):
    """Counted, not timed: a fresh interpreter running ``estimate --time`` on a catalog model imports, beside the
    standard library, only shardtune, rich and yaml (the catalog holds the model's numbers; nothing is built)."""
    from tests.fresh import run_fresh

    ran = run_fresh(["estimate", "llama-3.1-70b", "--method", "lora", "--num-gpus", "8", "--num-nodes", "2", "--time",
                     "--tokens", "1B"], tmp_path / "fresh")
    assert (ran["rc"], ran["packages"]) == (0, ["rich", "shardtune", "yaml"])


def test_measured_speeds_are_shown_beside_the_predicted_ones(tmp_path, capsys, monkeypatch):
    """--time with --measured: each setup the bench file measured gets its measured tokens/s and the ratio, with
    a caution where the file's model and device differ from the estimate's."""
    from shardtune.cli import main

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"model": "tiny", "device": "cpu (2 cores)", "num_processes": 2, "method": "lora",
                                 "results": [{"strategy": "DDP", "tokens_per_s": 1000.0},
                                             {"strategy": "FSDP", "tokens_per_s": 500.0}]}))
    argv = ["estimate", "llama-3.1-8b", "--method", "lora", "--num-gpus", "2", "--gpu", "h100-80gb",
            "--measured", str(bench), "--tokens", "1M"]
    assert main([*argv, "--json"]) == 0
    rows = {r["setup"]: r for r in json.loads(capsys.readouterr().out)["timing"]["setups"]}
    ddp, fsdp = rows["DDP"], rows["FSDP FULL_SHARD"]
    assert ddp["measured_tokens_per_s"] == 1000.0 and fsdp["measured_tokens_per_s"] == 500.0
    assert ddp["predicted_over_measured"] == pytest.approx(ddp["tokens_per_s"] / 1000.0)
    assert "measured_tokens_per_s" not in rows["FSDP FULL_SHARD + CPU offload"]  # offload was not measured
    monkeypatch.setenv("COLUMNS", "80")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Tokens/s predicted against measured (--measured)" in out
    assert f"{ddp['tokens_per_s']:,.0f}" in out and f"{ddp['predicted_over_measured']:.2f}" in out
    assert "Caution: measured with tiny, predicted for llama-3.1-8b" in out
    assert "Caution: measured on cpu (2 cores)" in out
    # Measured with the estimate's own model on CUDA GPUs, as many as it predicts for: the figures compare, no caution.
    # The model named as the bench names it, its size after the name (a local folder as its folder's name).
    from shardtune.bench.strategies import model_label
    from shardtune.demo import run as demo_run

    demo = Path(demo_run.__file__).parent / "base_model"
    for model, measured_with in (("llama-3.1-8b", "llama-3.1-8b"), ("llama-3.1-8b", model_label("llama-3.1-8b")),
                                 (str(demo), model_label(str(demo)))):
        bench.write_text(json.dumps({"model": measured_with, "device": "cuda (NVIDIA H100 80GB HBM3)",
                                     "num_processes": 2, "method": "lora",
                                     "results": [{"strategy": "DDP", "tokens_per_s": 1000.0}]}))
        assert main(["estimate", model, *argv[2:], "--seq-len", "128"]) == 0
        out = capsys.readouterr().out
        assert "Tokens/s predicted against measured (--measured)" in out and f"measured with {measured_with}" in out
        assert "Caution: measured" not in out and "Caution: the speeds were measured with" not in out, out


def test_the_jobs_epochs_and_max_steps_price_the_run(tmp_path, capsys, monkeypatch):
    """A recipe's num_train_epochs and max_steps were dropped: --time priced one pass over --data whatever the
    recipe said (and estimate's refusal of --num_train_epochs pointed at --config, where it did nothing)."""
    monkeypatch.chdir(tmp_path)
    data = _write_rows(tmp_path / "train.jsonl", [{"text": "alpha beta " * 300}] * 50)

    def timing(args, recipe_lines=()):
        files = []
        if recipe_lines:
            (tmp_path / "r.yaml").write_text("\n".join(["model_name_or_path: llama-3-8b", "use_peft_lora: true",
                                                        "dataset_name: train.jsonl", *recipe_lines]) + "\n")
            files = ["--config", "r.yaml"]
        else:
            files = ["llama-3-8b", "--method", "lora"]
        assert main(["estimate", *files, *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["timing"]

    one = timing(["--data", str(data)], ["num_train_epochs: 1"])
    three = timing(["--data", str(data)], ["num_train_epochs: 3"])
    assert three["data_tokens"] == 3 * one["data_tokens"] and three["num_train_epochs"] == 3
    for a, b in zip(one["setups"], three["setups"], strict=True):
        assert b["data_seconds"] == pytest.approx(3 * a["data_seconds"]) and b["trained_tokens"] == 3 * a[
            "trained_tokens"]
    # The same job from the command line, its tokens given: --num-train-epochs multiplies them.
    given = timing(["--tokens", f"{one['data_tokens']}", "--num-train-epochs", "3"])
    assert [s["data_seconds"] for s in given["setups"]] == pytest.approx([s["data_seconds"] for s in three["setups"]])
    # max_steps trains that many optimizer steps of each setup's global batch, whatever the data holds.
    steps = timing(["--data", str(data)], ["num_train_epochs: 3", "max_steps: 100"])
    assert steps["max_steps"] == 100 and "max_steps 100" in steps["data"]
    for row in steps["setups"]:
        assert row["data_seconds"] == pytest.approx(100 * row["step_s"])
        assert row["trained_tokens"] == 100 * row["tokens_per_step"]
    # The recipe's own data file, with --time alone: counted as --data counts it.
    assert timing(["--time"], ["num_train_epochs: 3"])["setups"] == three["setups"]
    # eval_split_ratio 0.1 holds 5 of the 50 rows out for evaluation: they were priced as trained.
    held = timing(["--data", str(data)], ["num_train_epochs: 1", "eval_split_ratio: 0.1"])
    assert held["data_tokens"] == round(one["data_tokens"] * 45 / 50)
    assert "in 45 rows of train.jsonl" in held["data"] and "holds out 5 more rows for evaluation" in held["data"]
    assert main(["estimate", "llama-3-8b", "--num-train-epochs", "2"]) == 2
    assert "--num-train-epochs 2 multiplies the data's tokens: give the data with --data FILE" in \
        capsys.readouterr().err
