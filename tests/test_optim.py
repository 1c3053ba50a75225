"""The optimizer the trainer builds works with the loss scaler it pairs it with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.config import OptimConfig
from shardtune.train.optim import build_optimizer, build_scheduler


def _scaled_step(optimizer: torch.optim.Optimizer, model: nn.Module, scaler) -> None:
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    from shardtune.dist import shutdown

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    shutdown()


def test_fsdp_fp16_gets_an_optimizer_its_sharded_scaler_can_step(one_process_group):
    """On CUDA AdamW is fused, but FSDP's ShardedGradScaler passes a [1]-shaped found_inf that fused AdamW cannot
    take: with sharded_scaler the trainer builds the multi-tensor AdamW. (Fused AdamW also runs on CPU tensors,
    so the CUDA choice is exercised here with CPU parameters.)"""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    on_cuda = build_optimizer(model, OptimConfig(), torch.device("cuda"))
    assert on_cuda.defaults["fused"]
    with pytest.raises(RuntimeError, match="shape"):
        _scaled_step(on_cuda, model, ShardedGradScaler("cpu"))  # why the choice exists
    model.zero_grad()
    paired = build_optimizer(model, OptimConfig(), torch.device("cuda"), sharded_scaler=True)
    assert not paired.defaults["fused"]
    before = model.weight.detach().clone()
    _scaled_step(paired, model, ShardedGradScaler("cpu"))
    assert not torch.equal(before, model.weight)  # the step was taken


def test_an_overflowed_fp16_step_leaves_the_learning_rate_schedule_where_it_was():
    """The loss scaler skips an update whose gradients overflowed; the schedule must not advance for it."""
    from transformers import AutoModelForCausalLM

    from shardtune.dist import DistInfo
    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.plan import Plan
    from shardtune.train.runner import LocalRunner
    from shardtune.train.step import StepContext, train_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(64, num_layers=1))
    cfg = OptimConfig(learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="linear")
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    ids = torch.randint(1, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(12).expand(2, 12)}

    def step(init_scale: float) -> None:
        runner = LocalRunner(model, Plan(strategy="NO"), info)
        runner.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        ctx = StepContext(model=model, optimizer=optimizer, scheduler=scheduler, runner=runner, info=info,
                          max_grad_norm=0.0, pad_token_id=0)
        train_step(ctx, [batch])

    before = [p.detach().clone() for p in model.parameters()]
    step(init_scale=3e38)  # the scaled gradients overflow: no update
    assert scheduler.last_epoch == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step(init_scale=1.0)
    assert scheduler.last_epoch == 1 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_adamw_steps_fsdp2_shards_locally_exactly_as_torchs_adamw_steps_dtensors(one_process_group, monkeypatch):
    """The trainer's AdamW (LocalShardAdamW) hands torch's multi-tensor kernel the local shards of FSDP2's DTensor
    parameters: the same parameters and moments as torch's AdamW stepping the DTensors, bit for bit, with the
    state still DTensors (what DCP saves per rank)."""
    import copy

    import torch.optim.adam as adam_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from shardtune.train.optim import param_groups

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))]
    models.append(copy.deepcopy(models[0]))
    for model in models:
        fully_shard(model, mesh=mesh)
    cfg = OptimConfig(learning_rate=1e-2, weight_decay=0.1)
    ours = build_optimizer(models[0], cfg, torch.device("cpu"))
    theirs = torch.optim.AdamW(param_groups(models[1], cfg.weight_decay), lr=cfg.learning_rate, foreach=True,
                               betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    kernel, seen = adam_module._multi_tensor_adam, []
    monkeypatch.setattr(adam_module, "_multi_tensor_adam",
                        lambda params, *args, **kwargs: seen.append(type(params[0])) or kernel(params, *args, **kwargs))
    initial = [p.full_tensor().clone() for p in models[0].parameters()]
    handed = []
    for model, optimizer in zip(models, (ours, theirs)):
        seen.clear()
        for step in range(3):
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        handed.append(set(seen))
    assert handed == [{torch.Tensor}, {DTensor}]  # what the kernel was given: local shards, against DTensors
    for a, b, before in zip(models[0].parameters(), models[1].parameters(), initial):
        assert isinstance(a, DTensor) and torch.equal(a.full_tensor(), b.full_tensor())
        assert not torch.equal(a.full_tensor(), before)  # the steps were taken
    for a, b in zip(ours.state.values(), theirs.state.values()):
        assert a.keys() == b.keys() and isinstance(a["exp_avg"], DTensor)
        assert all(torch.equal(torch.as_tensor(a[k].full_tensor() if isinstance(a[k], DTensor) else a[k]),
                               torch.as_tensor(b[k].full_tensor() if isinstance(b[k], DTensor) else b[k])) for k in a)


def rates(steps: int, **settings) -> list[float]:
    """The rate each of ``steps`` steps trains at, under build_scheduler's schedule of learning_rate 1."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, OptimConfig(learning_rate=1.0, **settings), total_steps=steps)
    found = []
    for _ in range(steps):
        found.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return found


def test_schedule_settings_left_unset_are_transformers_defaults():
    """What a recipe that names the schedule and none of its settings runs, as Transformers runs it: one cosine
    decay to 0 for cosine_with_restarts, a linear decay to 1e-7 for polynomial (the declared lr_end and power are
    Transformers' defaults), for inverse_sqrt a timescale of the warm-up steps, or 10000 without warm-up, and for
    warmup_stable_decay its curves and floor (its decay's length has no default there, nor here)."""
    import inspect
    import math

    from transformers.optimization import get_polynomial_decay_schedule_with_warmup

    given = inspect.signature(get_polynomial_decay_schedule_with_warmup).parameters
    assert (OptimConfig().lr_end, OptimConfig().power) == (given["lr_end"].default, given["power"].default)
    assert rates(5, lr_scheduler_type="cosine_with_restarts") == pytest.approx(
        [(1 + math.cos(math.pi * k / 5)) / 2 for k in range(5)], rel=1e-12)
    assert rates(5, lr_scheduler_type="polynomial") == pytest.approx(
        [1e-7 + (1 - 1e-7) * (5 - k) / 5 for k in range(5)], rel=1e-12)
    # a timescale of 2: 1 / sqrt(k / 2) from the end of warm-up (k = 2) on
    assert rates(5, lr_scheduler_type="inverse_sqrt", warmup_steps=2) == pytest.approx(
        [0, 0.5, 1, (2 / 3) ** 0.5, (2 / 4) ** 0.5], rel=1e-12)
    assert rates(3, lr_scheduler_type="inverse_sqrt") == pytest.approx(
        [(10000 / (10000 + k)) ** 0.5 for k in range(3)], rel=1e-12)
    # cosine_warmup_with_min_lr without warmup_lr_rate: warm-up step k at (k + 1) / warm-up steps, then the cosine
    # down to min_lr_rate counted from the first step after warm-up
    assert rates(5, lr_scheduler_type="cosine_warmup_with_min_lr", min_lr_rate=0.2, warmup_steps=2) == pytest.approx(
        [0.5, 1, *(0.2 + 0.8 * (1 + math.cos(math.pi * k / 3)) / 2 for k in range(1, 4))], rel=1e-12)
    # warmup_stable_decay: a linear warm-up from 0 and half a cosine wave down to 0, the stable steps what the
    # warm-up and decay leave: 1 warm-up step, 7 - 1 - 4 = 2 stable, then (1 + cos(pi k/4)) / 2
    from transformers.optimization import get_wsd_schedule

    wsd = inspect.signature(get_wsd_schedule).parameters
    o = OptimConfig()
    assert (o.warmup_type, o.decay_type, o.min_lr_ratio) == tuple(wsd[name].default for name in
                                                                  ("warmup_type", "decay_type", "min_lr_ratio"))
    assert rates(7, lr_scheduler_type="warmup_stable_decay", num_decay_steps=4, warmup_steps=1) == pytest.approx(
        [0, 1, 1, *((1 + math.cos(math.pi * k / 4)) / 2 for k in range(4))], rel=1e-12)


def test_min_lr_is_the_floor_min_lr_rate_names_as_a_share():
    """Transformers' cosine_with_min_lr reads min_lr, a rate, as min_lr_rate = min_lr / learning_rate."""
    for schedule in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        by_rate = rates(6, lr_scheduler_type=schedule, min_lr_rate=0.25, warmup_steps=1)
        assert rates(6, lr_scheduler_type=schedule, min_lr=0.25, warmup_steps=1) == pytest.approx(by_rate, rel=1e-12)
        assert by_rate != pytest.approx(rates(6, lr_scheduler_type=schedule, min_lr_rate=0.0, warmup_steps=1))


def test_a_plateau_resumed_with_another_learning_rate_keeps_its_cuts_and_floor():
    """A checkpoint's plateau cut the rate twice (x 0.25); resumed with learning_rate 2 the rate is 0.5, not 2 nor
    the checkpoint's 0.25, and never below min_lr. A step schedule resumed from a plateau's checkpoint continues at
    the step the run had reached."""
    from shardtune.train.optim import load_schedule_state
    from shardtune.train.resume import apply_learning_rate

    def plateau(lr: float, **settings):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
        return optimizer, build_scheduler(optimizer, OptimConfig(learning_rate=lr, lr_scheduler_type=
                                                                 "reduce_lr_on_plateau", plateau_factor=0.5,
                                                                 plateau_patience=0, **settings), total_steps=10)

    optimizer, scheduler = plateau(1.0)
    for loss in (3.0, 3.0, 3.0):  # the first sets the best, each later one cuts
        scheduler.step(loss)
    assert optimizer.param_groups[0]["lr"] == 0.25
    saved = scheduler.state_dict()
    for lr, floor, expected in ((2.0, None, 0.5), (2.0, 0.8, 0.8), (1.0, None, 0.25)):
        resumed_optimizer, resumed = plateau(lr, **({} if floor is None else {"min_lr": floor}))
        load_schedule_state(resumed, saved, steps_done=7, same_metric=True)
        apply_learning_rate(resumed_optimizer, resumed, lr)
        assert (resumed_optimizer.param_groups[0]["lr"], resumed.get_last_lr()[0]) == (expected, expected)
        assert (resumed.best, resumed.num_bad_epochs) == (3.0, 0)
    resumed_optimizer, resumed = plateau(1.0)  # another metric: afresh, at learning_rate
    load_schedule_state(resumed, saved, steps_done=7, same_metric=False)
    apply_learning_rate(resumed_optimizer, resumed, 1.0)
    assert (resumed_optimizer.param_groups[0]["lr"], resumed.best) == (1.0, float("inf"))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    linear = build_scheduler(optimizer, OptimConfig(learning_rate=1.0), total_steps=10)
    load_schedule_state(linear, saved, steps_done=7, same_metric=True)
    apply_learning_rate(optimizer, linear, 1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3, rel=1e-12)  # (10 - 7) / 10


def test_each_plateau_setting_acts_as_torchs_argument_of_its_name():
    """plateau_factor, _patience, _threshold, _threshold_mode, _cooldown, _eps and min_lr each change the rates a
    run of evaluations gives, and give the rates torch's ReduceLROnPlateau gives with that argument."""
    from shardtune.train.optim import plateau_step

    metrics = [10.0, 9.8, 9.6, 9.5, 9.5, 9.5, 9.5, 9.5]
    names = {"plateau_factor": "factor", "plateau_patience": "patience", "plateau_threshold": "threshold",
             "plateau_threshold_mode": "threshold_mode", "plateau_cooldown": "cooldown", "plateau_eps": "eps",
             "min_lr": "min_lr"}
    base = {"plateau_factor": 0.5, "plateau_patience": 0, "plateau_threshold": 0.05}

    def ours(**settings) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_scheduler(optimizer, OptimConfig(learning_rate=1.0, lr_scheduler_type="reduce_lr_on_plateau",
                                                           **settings), total_steps=10)
        out = []
        for metric in metrics:
            plateau_step(scheduler, metric)
            out.append(optimizer.param_groups[0]["lr"])
        return out

    def torchs(**settings) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        reference = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **{names[k]: v for k, v in settings.items()})
        out = []
        for metric in metrics:
            reference.step(metric)
            out.append(optimizer.param_groups[0]["lr"])
        return out

    plain = ours(**base)
    assert plain == torchs(**base)
    for name, value in (("plateau_factor", 0.2), ("plateau_patience", 2), ("plateau_threshold", 0.001),
                        ("plateau_threshold_mode", "abs"), ("plateau_cooldown", 2), ("min_lr", 0.3)):
        settings = {**base, name: value}
        assert ours(**settings) == torchs(**settings) != plain, name
    # eps: a cut smaller than it is not made (here the floor leaves one of 0.01)
    floored = {**base, "min_lr": 0.99}
    assert ours(**floored, plateau_eps=0.1) == torchs(**floored, plateau_eps=0.1) != ours(**floored)


def test_weight_decay_falls_on_the_parameters_transformers_trainer_decays():
    """The decayed set is the Trainer's (get_decay_parameter_names), each trainable parameter once: a tied Llama
    trained whole, and one with DoRA adapters and a trained final norm. DoRA's 1-D magnitude vectors decay there;
    here they did not (only matrices decayed), so a recipe with weight_decay trained them otherwise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from shardtune.testing.tiny import tiny_llama_config
    from shardtune.train.optim import param_groups

    config = tiny_llama_config(300)
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    dora = get_peft_model(AutoModelForCausalLM.from_config(tiny_llama_config(300)),
                          LoraConfig(r=4, target_modules="all-linear", use_dora=True, modules_to_save=["norm"]))
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    for model in (tied, dora):
        theirs = Trainer(model=model, args=args).create_optimizer().param_groups
        ours = param_groups(model, 0.1)
        assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in theirs]
    names = {id(p): n for n, p in dora.named_parameters()}
    assert any("lora_magnitude_vector" in names[id(p)] for p in ours[0]["params"])
    assert any(names[id(p)].endswith("norm.modules_to_save.default.weight") for p in ours[1]["params"])
