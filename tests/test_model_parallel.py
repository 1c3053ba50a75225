"""Naive model parallel: stages come from the estimator's memory plan, and the losses are those of one device."""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.config import load_train_config
from shardtune.dist import DistInfo
from shardtune.errors import UsageError
from shardtune.memory.stages import stage_bounds, stage_bounds_for_run
from shardtune.train.model_parallel import equal_bounds, mp_devices, place_stages
from shardtune.train.plan import make_plan
from tests.trainutil import write_chat_data

STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("mp")
    model = make_model_folder(root / "model", num_layers=4)
    data = write_chat_data(root / "chat.jsonl", rows=600)
    return root, model, data


def config(assets, out: str, extra: list[str]):
    root, model, data = assets
    return load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                              "--max_seq_len", "64", "--packing", "True", "--max_steps", str(STEPS),
                              "--logging_steps", "1", "--learning_rate", "1e-2", "--save_strategy", "no",
                              "--per_device_train_batch_size", "4", "--output_dir", str(root / out), *extra])


def single(world_size: int = 1) -> DistInfo:
    return DistInfo(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size,
                    device=torch.device("cpu"))


def test_equal_bounds_cover_every_layer_once():
    for layers, stages in ((4, 2), (7, 3), (3, 3)):
        bounds = equal_bounds(layers, stages)
        assert [i for a, b in bounds for i in range(a, b)] == list(range(layers))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_stages_follow_the_estimator_memory_plan(assets):
    """On a model whose memory plan is not the equal split (its head and embeddings outweigh a layer): the stages
    `shardtune train` places are the estimator's."""
    from shardtune.testing.tiny import make_model_folder

    root, _, data = assets
    uneven = make_model_folder(root / "uneven", num_layers=4, hidden_size=16, intermediate_size=32)
    cfg = config((root, uneven, data), "plan", ["--distributed_type", "MP", "--mp_devices", "cpu,cpu",
                                                "--gradient_checkpointing", "false"])
    bounds = stage_bounds_for_run(cfg, world_size=1)  # what `shardtune train` hands the trainer
    assert bounds == stage_bounds(cfg, 2, 4) != equal_bounds(4, 2)
    plan, _ = place_stages(make_plan(cfg.distributed, single(), param_dtype=None, gradient_checkpointing=False,
                                     use_reentrant=False), cfg, single(), bounds)
    assert plan.stage_bounds == bounds
    assert plan.devices == ("cpu", "cpu")
    # The same split as `shardtune estimate --strategy mp` reports for this job.
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.recommend import evaluate_setup
    from tests.setups import checked_setup

    analysis = ModelAnalysis(str(uneven))
    setup = checked_setup(method="full", distributed_type="MP", num_gpus=2, per_device_train_batch_size=4,
                          max_seq_len=64, gradient_checkpointing=False, mixed_precision="no")
    assert plan.stage_bounds == evaluate_setup(analysis, setup).stage_bounds
    assert [i for a, b in plan.stage_bounds for i in range(a, b)] == list(range(4))


def test_mp_losses_equal_one_device(assets):
    from shardtune.train.loop import train

    class Split:  # what the MP run set up: its stages, and the hooks that move each layer's inputs
        def on_train_begin(self, args, state, control, *, model, plan, **kwargs) -> None:
            self.found = (plan.strategy, plan.stage_bounds, plan.devices,
                          [len(layer._forward_pre_hooks) for layer in model.model.layers])

    root, split = assets[0], Split()
    train(config(assets, "one", []))
    mp_config = config(assets, "mp", ["--distributed_type", "MP", "--mp_devices", "cpu,cpu"])
    train(mp_config, [split])
    # train() given no stage bounds (`shardtune train` passes the estimator's) splits the layers evenly
    assert split.found == ("MP", equal_bounds(4, 2), ("cpu", "cpu"), [1, 1, 1, 1])
    read = lambda out: [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    one, mp = read("one"), read("mp")
    assert len(one) == len(mp) == STEPS
    for a, b in zip(one, mp):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]) and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4
    assert one[0]["loss"] != one[-1]["loss"]  # it trained


def test_split_moves_each_stage_and_hooks_its_inputs(assets):
    from transformers import AutoModelForCausalLM

    from shardtune.train.model_parallel import split_across_devices
    from shardtune.train.plan import Plan

    model = AutoModelForCausalLM.from_pretrained(str(assets[1]))
    ids = torch.randint(0, 100, (2, 16))
    expected = model(input_ids=ids).logits
    plan = Plan(strategy="MP", stage_bounds=((0, 3), (3, 4)), devices=("cpu", "cpu"))
    split = split_across_devices(model, plan)
    hooked = [len(layer._forward_pre_hooks) for layer in split.model.layers]
    assert hooked == [1, 1, 1, 1]
    assert torch.allclose(split(input_ids=ids).logits, expected)
    # On two devices that differ (meta stands in for a second GPU): the last stage's weights are moved, and its
    # hook moves what the layer receives, positional and keyword tensors, to its device; the first stage's stays.
    split = split_across_devices(AutoModelForCausalLM.from_pretrained(str(assets[1])),
                                 Plan(strategy="MP", stage_bounds=((0, 3), (3, 4)), devices=("cpu", "meta")))
    layers = split.model.layers
    assert [{p.device.type for p in layer.parameters()} for layer in layers] == [{"cpu"}] * 3 + [{"meta"}]
    hidden, positions = torch.zeros(2, 16, 8), torch.arange(16)
    for layer, device in ((layers[0], "cpu"), (layers[3], "meta")):
        (hook,) = layer._forward_pre_hooks.values()
        args, kwargs = hook(layer, (hidden,), {"position_ids": positions})
        assert (args[0].device.type, kwargs["position_ids"].device.type) == (device, device)


def test_mp_rejects_several_processes_and_bad_devices(assets, monkeypatch):
    cfg = config(assets, "x", ["--distributed_type", "MP"])
    plan = make_plan(cfg.distributed, single(2), param_dtype=None, gradient_checkpointing=False, use_reentrant=False)
    with pytest.raises(UsageError, match="one process"):
        place_stages(plan, cfg, single(2))
    with pytest.raises(UsageError, match="mp_devices"):
        mp_devices("gpu0")
    # The GPUs visible are set here, so that the same checks run with or without CUDA: cuda:N exists for N < count.
    for count in (0, 1, 2):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert mp_devices(None) == (tuple(f"cuda:{i}" for i in range(count)) or ("cpu",))
        assert mp_devices("cpu,cpu") == ("cpu", "cpu")
        for index in range(3):
            if index < count:
                assert mp_devices(f"cuda:{index}") == (f"cuda:{index}",)
                continue
            with pytest.raises(UsageError) as exc:
                mp_devices(f"cuda:{index}")
            assert str(exc.value) == (f"mp_devices: cuda:{index} does not exist ({count} GPU(s) visible); check "
                                      f"CUDA_VISIBLE_DEVICES")
        if count < 2:
            with pytest.raises(UsageError, match=f"cuda:{count} does not exist"):
                mp_devices("cuda:0,cuda:1")
        if count:  # plain "cuda" is the first GPU
            assert mp_devices("cuda,cpu") == ("cuda", "cpu")
        else:
            with pytest.raises(UsageError, match=r"^mp_devices: cuda does not exist \(0 GPU"):
                mp_devices("cuda,cpu")


def test_the_step_runs_on_the_first_stage_device_not_local_ranks():
    """mp_devices cuda:2,cuda:3: the batch, the logits and the loss sums go to cuda:2, not to LOCAL_RANK's cuda:0.
    The meta device stands in for the first stage's GPU."""
    import torch

    from shardtune.dist import DistInfo
    from shardtune.train.model_parallel import step_info
    from shardtune.train.plan import Plan

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    moved = step_info(info, Plan(strategy="MP", devices=("meta", "cpu")))
    assert moved.device == torch.device("meta") and (moved.rank, moved.world_size) == (0, 1)
    assert step_info(info, Plan(strategy="MP")).device == torch.device("cpu")
    # and it is the device the trainer gets: placing MP's stages over mp_devices hands back the first one's
    import dataclasses

    from shardtune.config.schema import TrainConfig
    from shardtune.train.model_parallel import place_stages

    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, distributed_type="MP",
                                                                   mp_devices="meta,cpu"))
    plan, placed = place_stages(Plan(strategy="MP"), cfg, info, bounds=((0, 3), (3, 4)))
    assert plan.devices == ("meta", "cpu") and placed.device == torch.device("meta")


@pytest.mark.parametrize("schedule, in_flight", [("1F1B", [4, 3, 2, 1]), ("GPipe", [8, 8, 8, 8])])
def test_pipeline_stages_hold_the_micro_batches_their_schedule_keeps_in_flight(schedule, in_flight):
    """PP cuts the batch into pipeline micro-batches: a stage keeps the checkpointed inputs of those its schedule has
    in flight (GPipe every one; 1F1B, stages - s at stage s) and recomputes one micro-batch at a time. The estimate
    counted the whole batch on every stage, recompute and loss included, as if GPipe ran one micro-batch of it:
    Llama-3.1-8B LoRA, 8 rows of 2048 tokens, 4 stages, one row per pipeline micro-batch."""
    from shardtune.memory.formula import Activations, _Stages, dtypes
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.recommend import evaluate_setup
    from shardtune.memory.setup import Setup, validate

    analysis = ModelAnalysis("llama-3.1-8b")
    job = dict(method="lora", num_gpus=4, per_device_train_batch_size=8, max_seq_len=2048,
               gradient_checkpointing=True, pipeline_schedule=schedule)
    setup = validate(Setup.of(distributed_type="PP", **job))
    one = setup.with_(distributed_type="NO", num_gpus=1)
    stages = _Stages.of(analysis.inventory, setup, one, analysis.lora_of(setup))
    assert [stages.in_flight(s) for s in range(4)] == in_flight
    act = Activations(analysis.inventory, one, dtypes(one))
    per_layer = 2048 * act.layer_checkpointed()  # one row's checkpointed input of a layer
    assert stages.transient == 2048 * act.layer_backward_temporaries() + act.layer_recomputed_bytes(2048)
    for stage, (a, b) in enumerate(((0, 8), (8, 16), (16, 24))):  # the last holds the head and the loss too
        assert stages.parts(a, b, stage)["activations"] == pytest.approx(
            (b - a) * per_layer * in_flight[stage] + stages.transient)
    # The balanced split costs each stage as parts() counts it, and the estimate reports its fullest stage.
    breakdown = evaluate_setup(analysis, setup)
    totals = [sum(stages.parts(a, b, s).values()) for s, (a, b) in enumerate(breakdown.stage_bounds)]
    assert len(breakdown.stage_bounds) == 4
    assert breakdown.tensors == pytest.approx(max(totals), rel=1e-9, abs=8)
    # Each GPU's peak is reported (--json's stages, the text's peak GiB), not the fullest's alone: its tensors and
    # the allocator's reserve on them, the fullest's equal to the estimate's total.
    from shardtune.memory.formula import allocator_reserve

    each = [round(total) + allocator_reserve(setup, stages.parts(a, b, s)["activations"],
                                             stages.parts(a, b, s)["grads"])
            for s, ((a, b), total) in enumerate(zip(breakdown.stage_bounds, totals))]
    assert list(breakdown.stage_totals) == pytest.approx(each, abs=8) and len(set(each)) > 1
    assert max(breakdown.stage_totals) == pytest.approx(breakdown.total, abs=8)
    assert f"(peak GiB: {', '.join(f'{n / 2**30:.2f}' for n in breakdown.stage_totals)})" in breakdown.stage_note
    # MP runs the whole batch as one micro-batch: its activations are the batch's, on every stage.
    mp = validate(Setup.of(distributed_type="MP", **job))
    mp_stages = _Stages.of(analysis.inventory, mp, one, analysis.lora_of(mp))
    assert [mp_stages.in_flight(s) for s in range(4)] == [1, 1, 1, 1]
    assert mp_stages.parts(0, 8, 0)["activations"] == pytest.approx(8 * 8 * per_layer + mp_stages.transient)


def test_pp_last_stage_holds_a_tied_head_as_its_own_copy(tmp_path, capsys):
    """PP keeps a head tied to the embeddings on the last stage as its own tensor, trained there (gradient, optimizer
    state) as an untied head is. The estimate counted it on the first stage only: `shardtune estimate --strategy pp`
    refused tied models, and the stages `shardtune train` places (the same plan) gave the last stage too many
    layers (Llama-3.2-1B in full: 6 and 10). A tied model and its untied twin now hold the same bytes per stage."""
    from transformers import LlamaConfig

    from shardtune.cli import main
    from shardtune.memory.formula import _Stages
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.recommend import evaluate_setup
    from shardtune.memory.setup import Setup, validate

    sizes = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4)
    folders = {tied: tmp_path / ("tied" if tied else "untied") for tied in (True, False)}
    for tied, folder in folders.items():
        LlamaConfig(**sizes, tie_word_embeddings=tied).save_pretrained(folder)
    for method in ("full", "lora"):
        setup = validate(Setup.of(distributed_type="PP", method=method, num_gpus=2, per_device_train_batch_size=4,
                                  max_seq_len=512, gradient_checkpointing=True))
        one = setup.with_(distributed_type="NO", num_gpus=1)
        found = {}
        for tied, folder in folders.items():
            analysis = ModelAnalysis(str(folder))
            assert analysis.inventory.tied_embeddings == tied
            stages = _Stages.of(analysis.inventory, setup, one, analysis.lora_of(setup))
            breakdown = evaluate_setup(analysis, setup)
            found[tied] = ([stages.parts(a, b, s) for s, (a, b) in enumerate(((0, 4), (4, 8)))],
                           breakdown.stage_bounds, breakdown.total)
        (tied_parts, tied_bounds, tied_total), (parts, bounds, total) = found[True], found[False]
        for tied_stage, stage in zip(tied_parts, parts):
            assert tied_stage == pytest.approx(stage, rel=1e-12)
        assert (tied_bounds, tied_total) == (bounds, total)
    # and the command estimates it: the untied twin's figures
    totals = []
    for folder in folders.values():
        assert main(["estimate", str(folder), "--strategy", "pp", "--num-gpus", "2", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        totals.append(report["per_gpu"]["total"])
        # each stage's layers and peak: together every layer once, the fullest the per-GPU total
        layers = [s["layers"] for s in report["stages"]]
        assert len(layers) == 2 and layers[0][0] == 0 and layers[0][1] + 1 == layers[1][0] and layers[1][1] == 7
        assert max(s["bytes"] for s in report["stages"]) == pytest.approx(totals[-1], abs=8)
    assert totals[0] == totals[1]


@pytest.mark.parametrize("tied", [True, False])
def test_mp_estimate_counts_the_head_on_the_gpu_the_split_puts_it_on(tmp_path, tied):
    """MP keeps a head tied to the embeddings, with the final norm, and so the logits and the loss, on the first
    device; an untied head goes to the last. The estimate counted them on the last GPU either way: for
    Llama-3.2-1B in full (8 rows of 4096 tokens, 2 GPUs) about 2 GiB on the wrong GPU, and the stages train places
    gave the first GPU 7 layers of 16 where 5 fit the plan. Each stage now holds its layers and the ends it runs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.memory.formula import PARTS, _Stages
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.setup import Setup, validate
    from shardtune.train.model_parallel import split_across_devices
    from shardtune.train.plan import Plan

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    bounds, devices = ((0, 2), (2, 4)), ("cpu", "meta")  # meta stands in for a second GPU
    split = split_across_devices(AutoModelForCausalLM.from_config(config),
                                 Plan(strategy="MP", stage_bounds=bounds, devices=devices))
    head_stage = devices.index(split.lm_head.weight.device.type)
    assert head_stage == (0 if tied else 1)
    analysis = ModelAnalysis(str(tmp_path))
    setup = validate(Setup.of(distributed_type="MP", method="full", num_gpus=2, per_device_train_batch_size=4,
                              max_seq_len=512, gradient_checkpointing=True))
    stages = _Stages.of(analysis.inventory, setup, setup.with_(distributed_type="NO", num_gpus=1), None)
    for stage, (a, b) in enumerate(bounds):
        ends = [end for end, on in ((stages.first, a == 0), (stages.last, stage == head_stage)) if on]
        want = {c: sum(stages.layer_parts[i][c] for i in range(a, b)) + sum(end[c] for end in ends) for c in PARTS}
        want["activations"] += stages.transient + (stages.last_once if stage == head_stage else 0)
        assert stages.parts(a, b, stage) == pytest.approx(want, rel=1e-12)
