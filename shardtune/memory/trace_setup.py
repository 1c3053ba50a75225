"""``shardtune estimate --trace`` and ``shardtune train --dry_run``: the traced peak, with the formula beside it.

An estimate's Setup becomes the TrainConfig that ``shardtune train`` would run, the trace runs it, and where the
trace cannot follow the step (an operation fake tensors do not support) the answer falls back to the analytic
formula and says why.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shardtune.config import DATASET_PLACEHOLDER, TrainConfig, build_config
from shardtune.config.loading import without_idle_keys
from shardtune.hardware import GIB
from shardtune.memory.setup import Setup
from shardtune.strategies import NO, resolve


def config_from_setup(model: str, setup: Setup) -> TrainConfig:
    """The ``shardtune train`` config of ``setup`` (what --emit-config writes and --trace runs): its config's keys
    that differ from the defaults, the model, its output folder (``output`` where it names none), and the processes
    it launches."""
    flat, defaults = setup.config.to_flat(), TrainConfig().to_flat()
    values: dict[str, Any] = {key: value for key, value in flat.items() if value != defaults[key]}
    values.update(model_name_or_path=model, output_dir=setup.config.run.output_dir or "output",
                  dataset_name=setup.config.data.dataset_name or DATASET_PLACEHOLDER,
                  # MP is one process driving every GPU of the node; the others run one process per GPU.
                  num_processes=1 if setup.strategy.drives_several_devices else setup.world_size,
                  num_machines=setup.num_nodes, distributed_type=setup.strategy.name)
    if setup.config.precision_left_to_hardware:  # the precision train picks on the estimate's GPU, not on this host
        values.update(bf16=setup.mixed_precision == "bf16")
    if setup.attn_implementation == "flash_attention_2":
        # flash_attention_2: use_flash_attn, with sdpa where flash-attn cannot run. The trace (fake tensors, no
        # flash-attn kernels) then follows sdpa, which keeps more than flash does: the batch's 4-D mask per layer
        # and k/v repeated to every head, so a traced flash setup reads high by those.
        values.update(attn_implementation="sdpa", use_flash_attn=True)
    if setup.uses_lora and "lora_alpha" not in values:
        values.update(lora_alpha=2 * setup.lora_r)
    if setup.strategy.pipelined:
        values.update(pipeline_microbatches=setup.microbatches)
    if setup.strategy.drives_several_devices:  # its GPUs by name: "every visible GPU" is a count no file holds
        values.update(mp_devices=",".join(f"cuda:{i}" for i in range(setup.world_size)))
    # QLoRA's 4-bit dtypes follow the precision picked above: the recipe says them (float16 for a T4 in fp16)
    return build_config([(without_idle_keys(values), {})]).with_4bit_dtypes()


def trace_or_formula(cfg: TrainConfig, world_size: int, *, num_nodes: int = 1) -> dict[str, Any]:
    """The traced memory of ``cfg`` as a dict; on an untraceable step, the formula's answer and the reason."""
    from shardtune.memory.trace import TraceUnsupported, trace_training_step

    try:
        result = trace_training_step(cfg, world_size, num_nodes=num_nodes)
    except TraceUnsupported as exc:
        out = formula_for_config(cfg, world_size, num_nodes=num_nodes)
        out.update(source="formula", fallback_reason=str(exc))
        return out
    return result.to_dict() | {"source": "trace"}


def setup_from_config(cfg: TrainConfig, world_size: int, num_nodes: int = 1, *,
                      native_bf16: bool | None = None) -> Setup:
    """The estimator's Setup of the job ``cfg`` describes on ``world_size`` processes (the inverse of
    ``config_from_setup``): the config itself, its strategy resolved as the launch resolves it, the trainer's
    own loss, and its precision as ``shardtune train`` picks it on GPUs that do (or do not: ``native_bf16``)
    compute bf16, or on this machine (None)."""
    strategy = resolve(cfg.distributed.distributed_type, world_size > 1)
    if strategy.drives_several_devices and cfg.distributed.mp_devices:  # one process, a stage on each device
        world_size = len(cfg.distributed.mp_device_names)
    return Setup(cfg, num_gpus=world_size // num_nodes, num_nodes=num_nodes, native_bf16=native_bf16,
                 pipeline_microbatches=cfg.distributed.pipeline_microbatches).with_(distributed_type=strategy)


def formula_for_config(cfg: TrainConfig, world_size: int, *, num_nodes: int = 1) -> dict[str, Any]:
    """The analytic estimate of the job ``cfg`` describes, in the trace's shape."""
    from shardtune.memory.formula import estimate
    from shardtune.memory.inventory import analysis_for

    setup = setup_from_config(cfg, world_size, num_nodes)
    analysis = analysis_for(cfg.model.model_name_or_path, cfg)
    lora = analysis.lora_of(setup)
    breakdown = estimate(analysis.inventory, setup, lora)
    return {"peak_bytes": breakdown.total, "categories": breakdown.per_gpu(), "world_size": world_size,
            "strategy": setup.label(), "parameters": analysis.inventory.parameters}


def render_text(result: dict[str, Any], formula_peak: int | None = None) -> str:
    """A readable block: the peak, its parts and the largest modules."""
    from shardtune.memory.trace import held_bytes

    lines = []
    if result.get("source") == "formula":
        lines.append(f"trace not possible: {result['fallback_reason']}")
        lines.append(f"analytic estimate instead: {result['peak_bytes'] / GIB:.2f} GiB per GPU")
        return "\n".join(lines)
    strategy = "single process" if result["strategy"] == NO.name else result["strategy"]
    lines.append(f"traced peak per GPU: {result['peak_bytes'] / GIB:.3f} GiB of tensors  ({strategy}, "
                 f"world size {result['world_size']}, {result['steps']} steps traced in {result['seconds']:.1f} s)")
    reserved = result.get("reserved_bytes")
    if reserved:
        lines.append(f"reserved from the GPU: {reserved / GIB:.3f} GiB  (the caching allocator's segments, "
                     f"torch.cuda.max_memory_reserved; nvidia-smi adds the CUDA context)")
    if formula_peak:
        against = held_bytes(result)
        error = formula_peak / against - 1 if against else 0.0
        lines.append(f"analytic estimate above (--loss {result.get('formula_loss', 'full')}): "
                     f"{formula_peak / GIB:.3f} GiB, {error:+.1%} against the trace's "
                     f"{'reserved' if reserved else 'tensor'} peak (the trace runs the trainer's own loss)")
    lines.append("at the peak, by category:")
    for name, nbytes in sorted(result["categories"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<26} {nbytes / GIB:10.3f} GiB")
    modules = result.get("modules") or []
    if modules:
        lines.append("peak while each module ran (last step):")
        for item in modules[:12]:
            lines.append(f"  {item['module']:<64} {item['peak_bytes'] / GIB:10.3f} GiB")
        if len(modules) > 12:
            lines.append(f"  ... {len(modules) - 12} more (--json lists all)")
    for note in result.get("notes") or []:
        lines.append(f"note: {note}")
    if "fits" in result:
        needed = held_bytes(result) + result["cuda_context_bytes"]
        verdict = "fits" if result["fits"] else "does NOT fit"
        lines.append(f"by the trace it {verdict}: {needed / GIB:.2f} GiB with the CUDA context against "
                     f"{result['gpu_memory_bytes'] / GIB:.2f} GiB per GPU")
        if not result["fits"] and formula_peak and formula_peak + result["cuda_context_bytes"] <= \
                result["gpu_memory_bytes"]:
            lines.append("warning: the analytic estimate says it fits and the trace says it does not; the trace "
                         "ran the trainer's own step: take a smaller micro-batch (and more accumulation steps) "
                         "until the trace fits")
    return "\n".join(lines)


def trace_for_estimate(model: str, setup: Setup, formula_peak: int, *, gpu_memory: int | None = None,
                       cuda_context: int = 0) -> dict[str, Any]:
    """``--trace``: the traced peak of ``setup`` (or the formula's, with the reason), and the formula's beside it.

    The trace always runs the trainer's loss (``loss.head_loss_sum``); ``formula_peak`` is the estimate's own
    total, for the loss ``--loss`` named. With ``gpu_memory``, ``fits`` says whether the traced reserved memory
    plus ``cuda_context`` fits that GPU: the trace's verdict, which can differ from the formula's.
    """
    from shardtune.memory.trace import held_bytes

    cfg = config_from_setup(model, setup)
    out = trace_or_formula(cfg, setup.world_size, num_nodes=setup.num_nodes)
    out["formula_peak_bytes"] = formula_peak
    out["formula_loss"] = setup.loss
    if gpu_memory and out.get("source") == "trace":
        out.update(gpu_memory_bytes=gpu_memory, cuda_context_bytes=cuda_context,
                   fits=held_bytes(out) + cuda_context <= gpu_memory)
    return out


class Calibration(NamedTuple):
    """The formula and the trace of one setup, in bytes per GPU."""

    formula_tensors: int  # the formula's total without its "allocator cache and workspaces" item
    formula_total: int
    traced_tensors: int  # the trace's peak of tensor bytes
    traced_reserved: int  # the trace's allocations replayed through the caching-allocator model


def formula_and_trace(model: str, setup: Setup) -> Calibration:
    """The calibration pair of ``setup``: tensor bytes against tensor bytes (what ``max_memory_allocated`` would
    report), and what the caching allocator reserves beyond them (the formula's "allocator cache and workspaces"
    item against the trace's replayed allocations).
    """
    from shardtune.memory.formula import estimate
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.trace import trace_training_step

    traced = trace_training_step(config_from_setup(model, setup), setup.world_size, num_nodes=setup.num_nodes)
    analysis = analysis_for(model, setup.config)
    lora = analysis.lora_of(setup)
    breakdown = estimate(analysis.inventory, setup, lora)
    return Calibration(breakdown.tensors, breakdown.total, traced.peak_bytes, traced.reserved_bytes)
