"""Activation offloading (train/offload.py): the checkpointed layers' inputs go to host memory and come back intact.

On CPU the hooks run as they do on a GPU, saving a copy, so these tests check what offloading must not change (the
losses of a whole run, one process and FSDP2 on two gloo processes with LoRA) and what it must move (every
checkpointed layer's input, batch x seq x hidden x layers x bytes a step). The estimator's side: the formula keeps
the inputs of two layers on the GPU and counts the rest in host memory; the trace sees the same drop.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from shardtune.config import load_train_config
from shardtune.errors import UsageError

REL_TOL = 1e-5
VOCAB = 300


def _llama(num_layers: int = 3):
    from transformers import AutoModelForCausalLM

    from shardtune.testing.tiny import tiny_llama_config

    config = tiny_llama_config(VOCAB, pad_token_id=0)
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _batch(seed: int, rows: int = 3, length: int = 40) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=gen)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).expand(rows, -1)}


def test_each_step_moves_every_checkpointed_layer_input_and_frees_it():
    """Bytes packed to host per step = batch x seq x hidden x layers x 4 (fp32), and nothing is held afterwards."""
    from shardtune.dist import DistInfo
    from shardtune.train.offload import offload_checkpointed_inputs
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan

    model = _llama(num_layers=3)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    model, runner = parallelize(model, Plan(strategy="NO", gradient_checkpointing=True), info)
    offloader = offload_checkpointed_inputs(model)
    rows, length = 3, 40
    expected = rows * length * model.config.hidden_size * model.config.num_hidden_layers * 4
    moved = []
    for step in range(2):
        before = offloader.packed_bytes
        runner.forward_backward([_batch(step, rows, length)], scale=1.0)
        moved.append(offloader.packed_bytes - before)
        assert offloader.held == 0  # the graph is gone, and with it every host copy
    assert moved == [expected, expected]
    with torch.no_grad():  # evaluation saves nothing for backward: nothing moves
        runner.eval_loss_sum(_batch(5))
    assert offloader.packed_bytes == 2 * expected


def test_compiled_layers_with_offloading_compile_their_math_and_keep_the_numbers():
    """torch_compile with activation_offloading: dynamo cannot trace the offloader's saved_tensors_hooks, so the
    layers' compiled forwards broke into graphs that held none of their matmuls and ran eager. The checkpointed
    function is compiled now: the backend sees every layer's projections, the inputs still move, the numbers hold."""
    from torch._dynamo import list_backends, register_backend

    from shardtune.dist import DistInfo
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan

    linears: list[int] = []  # per graph the backend compiles: its linear projections
    if "shardtune_test_counting" not in list_backends(exclude_tags=()):
        @register_backend(name="shardtune_test_counting")
        def counting(graph_module, example_inputs):
            linears.append(sum(node.target is torch._C._nn.linear for node in graph_module.graph.nodes))
            return graph_module.forward

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    found = {}
    for name, backend in (("eager", None), ("compiled", "shardtune_test_counting")):
        model, runner = parallelize(_llama(num_layers=2), Plan(strategy="NO", gradient_checkpointing=True,
                                                               activation_offloading=True,
                                                               compile_backend=backend), info)
        loss = runner.forward_backward([_batch(0)], scale=1.0)
        grads = [p.grad.clone() for p in model.parameters()]
        found[name] = loss, grads, runner.applied.offloader.packed_bytes
    assert max(linears, default=0) == 7, linears  # q, k, v, o, gate, up, down: the layer's math, in one graph
    (loss, grads, moved), (loss_c, grads_c, moved_c) = found["eager"], found["compiled"]
    assert torch.allclose(loss, loss_c, rtol=REL_TOL) and moved == moved_c > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, grads_c))


def test_offloading_without_checkpointing_is_refused_naming_the_fix(tmp_path):
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(UsageError, match="activation_offloading=true .* set gradient_checkpointing true"):
        load_train_config([*base, "--activation_offloading", "true", "--gradient_checkpointing", "false"])
    cfg = load_train_config([*base, "--activation_offloading", "true", "--distributed_type", "FSDP",
                             "--gradient_checkpointing", "false", "--fsdp_activation_checkpointing", "true"])
    assert cfg.run.activation_offloading
    assert load_train_config([*base, "--activation_offloading", "true"]).run.activation_offloading  # the default


def test_runs_with_offloading_or_liger_on_cpu_have_the_same_losses(tmp_path, restore_logging, capfd):
    """``shardtune train`` in this process, checkpointing on: with activation_offloading (which moved the layers'
    inputs to the host), and with use_liger_kernel (on a CPU: one warning, transformers' modules), the losses equal
    the plain run's; summary.json says what each switch did."""
    from shardtune.testing.tiny import make_model_folder
    from shardtune.train.liger import CPU_MESSAGE
    from shardtune.train.loop import train
    from tests.trainutil import losses, write_chat_data

    model = make_model_folder(tmp_path / "model")
    data = write_chat_data(tmp_path / "chat.jsonl", rows=200)
    found, logged, said = {}, {}, {}
    for name, extra in (("ref", []), ("offload", ["--activation_offloading", "true"]),
                        ("liger", ["--use_liger_kernel", "true"])):
        out = tmp_path / name
        train(load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                                 "--max_seq_len", "64", "--packing", "true", "--max_steps", "3", "--logging_steps",
                                 "1", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
                                 "--gradient_checkpointing", "true", "--save_strategy", "no",
                                 "--predict_memory", "false", "--output_dir", str(out), *extra]))
        found[name] = losses(out)
        logged[name] = capfd.readouterr().err.count(CPU_MESSAGE)
        summary = json.loads((out / "summary.json").read_text())
        said[name] = summary["liger"], summary["activation_offloading"]
    assert logged == {"ref": 0, "offload": 0, "liger": 1}
    # 3 steps of 4 packed rows of 64 tokens, each of the 2 layers' fp32 inputs (hidden 64) moved once per step
    moved = {"layers": 2, "bytes_moved": 3 * 2 * 4 * 64 * 64 * 4}
    assert said == {"ref": (None, None), "offload": (None, moved),
                    "liger": ({"kernels": [], "fallback": CPU_MESSAGE}, None)}
    assert len(found["ref"]) == 3 and found["ref"][0] != found["ref"][-1]
    for name in ("offload", "liger"):
        for a, b in zip(found["ref"], found[name]):
            assert abs(a - b) <= REL_TOL * abs(a), (name, found)


def _fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from shardtune.config import LoraConfig
    from shardtune.dist import DistInfo, shutdown
    from shardtune.train.model import apply_lora
    import shardtune.train.parallelize as parallelize_module
    from shardtune.train.parallelize import parallelize
    from shardtune.train.plan import Plan

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    lora = LoraConfig(use_peft_lora=True, lora_r=4, lora_alpha=8, lora_target_modules="all-linear")
    offloaders = []
    install = parallelize_module.offload_checkpointed_inputs
    parallelize_module.offload_checkpointed_inputs = lambda m: offloaders.append(install(m))
    result = {}
    for offloading in (False, True):
        model = apply_lora(_llama(num_layers=3), lora, seed=1)
        model, runner = parallelize(model, Plan(strategy="FSDP", gradient_checkpointing=True,
                                                activation_offloading=offloading), info)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        step_losses = []
        for step in range(2):
            loss = runner.forward_backward([_batch(10 * step + rank)], scale=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss)
            step_losses.append(loss.item())
        result[str(offloading)] = step_losses
    result["packed"] = [o.packed_bytes for o in offloaders]  # the offloading run's: its layers' inputs moved
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown()  # not destroy_process_group alone: see test_dist_shutdown (SIGABRT at exit)


@pytest.mark.timeout(180)
def test_fsdp2_two_processes_lora_checkpointing_same_losses_with_offloading(tmp_path):
    """FSDP2 FULL_SHARD on 2 gloo ranks, LoRA on every linear layer, checkpointing: two optimizer steps with and
    without offloading give the same global losses."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["False"][0] != found["False"][-1]  # the adapters train: a test that could fail
        assert len(found["packed"]) == 1 and found["packed"][0] > 0, found  # only the offloading run offloaded
        for a, b in zip(found["False"], found["True"]):
            assert abs(a - b) <= REL_TOL * abs(a), found


def _formula(**changes):
    from shardtune.memory.formula import estimate
    from shardtune.memory.inventory import ModelAnalysis
    from shardtune.memory.setup import validate
    from tests.setups import checked_setup

    analysis = ModelAnalysis("llama-3.2-1b")
    setup = validate(checked_setup(method="lora", per_device_train_batch_size=4, max_seq_len=4096, **changes))
    lora = analysis.lora(setup.lora_r, setup.lora_target_modules)
    return analysis.inventory, estimate(analysis.inventory, setup, lora)


def test_formula_moves_all_but_two_layer_inputs_to_host_memory():
    """Backward through the last layer (the peak without offloading) loses (layers - 2) checkpointed inputs; host
    RAM holds all of them. Each input is tokens x hidden in the residual stream's dtype (fp32 for LoRA under
    autocast: the trainer casts the embeddings' output up)."""
    from shardtune.memory.formula import OFFLOADED_LAYERS_ON_GPU

    inv, kept = _formula()
    _, offloaded = _formula(activation_offloading=True)
    layer_input = 4 * 4096 * inv.hidden_size * 4
    assert kept.phase == "backward (last layer)" and offloaded.total < kept.total
    assert kept.phases[kept.phase] - offloaded.phases[kept.phase] == \
        pytest.approx((inv.num_layers - OFFLOADED_LAYERS_ON_GPU) * layer_input, rel=1e-6)
    assert (kept.cpu_bytes_per_node, offloaded.cpu_bytes_per_node) == (0, inv.num_layers * layer_input)
    with pytest.raises(UsageError, match="--activation-offloading .* use it with --gradient-checkpointing"):
        _formula(activation_offloading=True, gradient_checkpointing=False)


def test_estimate_reads_the_key_from_a_recipe_and_the_formula_follows_the_trace(tmp_path):
    """``--config recipe`` carries activation_offloading into the Setup; the trace of that job (the trainer's own
    step under fake tensors, the offloaded inputs freed) holds less than the same job without offloading, by at
    least one layer input, and the formula is within the 7% of tests/test_trace_formula.py of it."""
    from shardtune.cli.estimate import config_argv
    from shardtune.memory.trace_setup import formula_and_trace, setup_from_config
    from shardtune.testing.tiny import make_model_folder

    model = make_model_folder(tmp_path / "model", num_layers=6)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndataset_name: d\noutput_dir: o\ngradient_checkpointing: true\n"
                      "activation_offloading: true\nuse_peft_lora: true\nbf16: true\nmax_seq_len: 128\n"
                      "per_device_train_batch_size: 8\n")
    setup = setup_from_config(load_train_config(config_argv([str(recipe)])), 1)
    assert setup.activation_offloading and setup.gradient_checkpointing
    offloaded = formula_and_trace(str(model), setup)
    kept = formula_and_trace(str(model), setup.with_(activation_offloading=False))
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    assert kept.traced_tensors - offloaded.traced_tensors >= 8 * 128 * hidden * 4  # fp32 residual (autocast)
    assert kept.formula_tensors > offloaded.formula_tensors
    assert abs(offloaded.formula_tensors / offloaded.traced_tensors - 1) <= 0.07, offloaded
