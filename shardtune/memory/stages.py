"""MP and PP stages balanced by memory: the estimator's model-parallel plan for a training job.

``shardtune train`` asks for them before it starts the trainer, which takes them as given (``train(stage_bounds=)``)
and falls back to equal layer counts without them.
"""

from __future__ import annotations

from shardtune.config import TrainConfig


def stage_bounds(cfg: TrainConfig, num_stages: int, batch_size: int) -> tuple[tuple[int, int], ...]:
    """[first, end) decoder layers of each of ``num_stages`` stages for micro-batches of ``batch_size`` rows (PP
    cuts each into the config's pipeline_microbatches, of which a stage holds those its schedule has in flight)."""
    from shardtune.memory.inventory import analysis_for
    from shardtune.memory.recommend import evaluate_setup
    from shardtune.memory.trace_setup import setup_from_config

    # The job's own config: its strategy splits the layers, so the estimate is the model-parallel one.
    setup = setup_from_config(cfg, num_stages, native_bf16=True).with_(per_device_train_batch_size=batch_size)
    analysis = analysis_for(cfg.model.model_name_or_path, cfg)
    breakdown = evaluate_setup(analysis, setup)
    return breakdown.stage_bounds or ((0, analysis.inventory.num_layers),)


def stage_bounds_for_run(cfg: TrainConfig, world_size: int) -> tuple[tuple[int, int], ...] | None:
    """The stages of an MP or PP run (None for the other strategies and for a single stage)."""
    from shardtune.train.model_parallel import stage_count

    stages = stage_count(cfg, world_size)
    return stage_bounds(cfg, stages, cfg.run.per_device_train_batch_size) if stages > 1 else None
