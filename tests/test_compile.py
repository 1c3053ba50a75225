"""torch_compile: each decoder layer compiled (inductor on CPU), the same losses as eager, no recompilation per packed
batch, one warning and an eager run where the backend cannot compile, and the keys of Transformers and Accelerate.

The FSDP run compiles with inductor, which shares torch's on-disk cache (/tmp/torchinductor_$USER): the first run
on a machine pays the C++ compilation of the layer's kernels (about a minute on 2 busy cores), later ones reuse
them. The recompilation count is dynamo's, so the 20-step run counts it with the eager backend, which compiles no
code.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.trainutil import flags, losses, run_shardtune, tiny_workspace

REL_TOL = 1e-4
LORA_CHECKPOINTED = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--gradient_checkpointing",
                     "True"]
FAILING_BACKEND = "shardtune_test_failing_backend"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "compile", rows=600)


def common(root, out: str, steps: int) -> list[str]:
    return ["--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"), "--splits",
            "train", "--max_seq_len", "128", "--packing", "True", "--max_steps", str(steps), "--logging_steps", "1",
            "--learning_rate", "1e-2", "--seed", "7", "--save_strategy", "no", "--disable_tqdm", "True",
            "--predict_memory", "False", "--output_dir", str(root / out)]


def assert_same(reference: list[float], other: list[float]) -> None:
    assert len(reference) == len(other)
    for step, (a, b) in enumerate(zip(reference, other), start=1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: {a} vs {b}"


def test_fsdp_lora_checkpointing_losses_equal_with_and_without_compile(assets):
    found = {}
    for name, extra in (("eager", []), ("compiled", ["--torch_compile", "True"])):
        args = flags(*common(assets, f"fsdp_{name}", 3), *LORA_CHECKPOINTED, "--distributed_type", "FSDP",
                     "--per_device_train_batch_size", "2", *extra)
        result = run_shardtune(["launch", "--num_processes", "2", "train", *args], assets)
        assert result.returncode == 0, result.stderr[-3000:]
        found[name] = losses(assets / f"fsdp_{name}")
    assert_same(found["eager"], found["compiled"])
    record = json.loads((assets / "fsdp_compiled" / "summary.json").read_text())["compile"]
    assert record["fallback"] is None and record["layers"] == 2, record
    assert record["compiles"] >= 1 and record["recompiles"] <= record["recompile_bound"], record


class Lengths:
    """Records the padded length of every micro-batch the loop runs."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs):
        self.seen += [batch["input_ids"].shape[1] for batch in micro_batches]


def test_twenty_packed_steps_compile_once_whatever_their_lengths(assets, restore_logging):
    """Guards and recompilations are dynamo's, whichever backend turns the graph into code: the eager backend
    counts them without inductor's C++ compilation (the FSDP test above runs inductor)."""
    from shardtune.train.loop import train

    lengths = Lengths()
    cfg = load_train_config(flags(*common(assets, "twenty", 20), *LORA_CHECKPOINTED,
                                  "--per_device_train_batch_size", "2", "--torch_compile_backend", "eager"))
    record = train(cfg, callbacks=[lengths])["compile"]
    assert len(set(lengths.seen)) >= 3, lengths.seen  # the packed batches do change length
    # Both layers run one graph (their parameters are its inputs), marked dynamic in the sequence from the first
    # call: no length of the 20 steps compiles again.
    assert record["graphs"] == 1 and record["compiles"] == 1, record
    assert record["recompiles"] == 0 <= record["recompile_bound"], record


def _register_failing_backend() -> None:
    from torch._dynamo import list_backends, register_backend

    if FAILING_BACKEND in list_backends(exclude_tags=()):
        return

    @register_backend(name=FAILING_BACKEND)
    def failing(graph_module, example_inputs):
        raise RuntimeError("this backend exploded on purpose")


def test_a_backend_that_fails_warns_once_and_the_run_goes_on_eager(assets, restore_logging, capsys):
    from shardtune.train.loop import train

    _register_failing_backend()
    train(load_train_config(common(assets, "eager3", 3)))
    summary = train(load_train_config(flags(*common(assets, "failing", 3), "--torch_compile_backend",
                                            FAILING_BACKEND)))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "cannot compile" in line]
    assert len(warnings) == 1, warnings
    assert "exploded on purpose" in warnings[0] and "training goes on eager" in warnings[0], warnings
    assert "exploded on purpose" in summary["compile"]["fallback"] and summary["steps"] == 3
    assert_same(losses(assets / "eager3"), losses(assets / "failing"))


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden):
        return self.proj(hidden).relu()


class TwoLayers(torch.nn.Module):
    _no_split_modules = ["Layer"]  # as transformers models name their decoder layer

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, hidden):
        return self.layers[1](self.layers[0](hidden))


def test_each_layer_compiles_in_place_and_nothing_compiles_on_fake_tensors():
    """``shardtune estimate`` and ``--dry_run`` trace the step under FakeTensorMode: nothing is compiled there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardtune.train.compile import apply_compile
    from shardtune.train.plan import Plan

    plan = Plan(strategy="NO", compile_backend="eager")
    with FakeTensorMode():
        fake = TwoLayers()
    assert apply_compile(fake, plan) is None and "forward" not in vars(fake.layers[0])
    model = TwoLayers()
    keys = list(model.state_dict())
    x = torch.randn(2, 5, 8, requires_grad=True)  # as every layer's input in training, so one graph serves both
    expected = model(x)
    report = apply_compile(model, plan)
    assert report.layers == 2 and all("forward" in vars(layer) for layer in model.layers)
    assert list(model.state_dict()) == keys  # checkpoints and exports see the same names
    assert torch.equal(model(x), expected) and report.counts()["compiles"] == 1
    model(torch.randn(2, 9, 8, requires_grad=True))  # another sequence length: the same graph
    assert report.counts()["recompiles"] == 0


BASE = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]


def test_transformers_keys_turn_compile_on_and_bad_values_are_refused():
    assert not load_train_config(BASE).run.torch_compile
    run = load_train_config([*BASE, "--torch_compile", "true"]).run
    assert (run.torch_compile, run.torch_compile_backend, run.torch_compile_mode) == (True, "inductor", None)
    run = load_train_config([*BASE, "--torch_compile_mode", "max-autotune"]).run  # Transformers' rule
    assert (run.torch_compile, run.torch_compile_backend, run.torch_compile_mode) == (True, "inductor",
                                                                                      "max-autotune")
    with pytest.raises(UsageError, match="torch_compile_backend='inductr' is not a torch.compile backend; did you "
                                         "mean 'inductor'"):
        load_train_config([*BASE, "--torch_compile_backend", "inductr"])
    with pytest.raises(UsageError, match="torch_compile_mode='fastest' is not one of"):
        load_train_config([*BASE, "--torch_compile", "true", "--torch_compile_mode", "fastest"])
    with pytest.raises(UsageError, match="torch_compile_mode='max-autotune' applies to the inductor backend only"):
        load_train_config([*BASE, "--torch_compile_backend", "eager", "--torch_compile_mode", "max-autotune"])


def test_accelerate_dynamo_settings_act_through_the_same_keys(tmp_path):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_mode: default\n"
                   "  dynamo_use_dynamic: false\n  dynamo_use_regional_compilation: true\n")
    run = load_train_config(["--config_file", str(acc), *BASE]).run
    assert (run.torch_compile, run.torch_compile_backend, run.torch_compile_mode) == (True, "aot_eager", "default")
    # The recipe above the Accelerate file wins, as for every key; and the launcher flag's spelling works alone.
    assert not load_train_config(["--config_file", str(acc), *BASE, "--torch_compile", "false"]).run.torch_compile
    assert load_train_config([*BASE, "--dynamo_backend", "inductor"]).run.torch_compile_backend == "inductor"
    acc.write_text("dynamo_config:\n  dynamo_backend: 'NO'\n  dynamo_mode: max-autotune\n")
    assert not load_train_config(["--config_file", str(acc), *BASE]).run.torch_compile
    acc.write_text("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_fullgraph: true\n")
    with pytest.raises(UsageError, match=rf"{acc}, line 1: dynamo_use_fullgraph=True: shardtune compiles each "
                                         rf"decoder layer"):
        load_train_config(["--config_file", str(acc), *BASE])
    acc.write_text("dynamo_config:\n  dynamo_backend: NOT_A_BACKEND\n")
    with pytest.raises(UsageError, match="torch_compile_backend='not_a_backend' is not a torch.compile backend"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_a_bad_backend_name_exits_2_before_anything_runs(assets):
    result = run_shardtune(["train", *common(assets, "bad_backend", 1), "--torch_compile_backend", "indctor"], assets)
    assert result.returncode == 2 and "torch_compile_backend='indctor'" in result.stderr, result.stderr[-2000:]
    assert not (assets / "bad_backend").exists()


class BreakingLayer(Layer):
    """A layer whose whole forward runs inside a context manager dynamo cannot trace, as activation offloading's
    saved_tensors_hooks were: dynamo compiles the frame but hands no graph to the backend."""

    def forward(self, hidden):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return self.proj(hidden).relu()


class TracedLayer(Layer):
    """A layer dynamo traces whole (its own code object, so no other test's compiled graph serves it)."""

    def forward(self, hidden):
        return self.proj(hidden).tanh()


def _two(layer: type) -> TwoLayers:
    model = TwoLayers()
    model.layers = torch.nn.ModuleList([layer(), layer()])
    model._no_split_modules = [layer.__name__]
    return model


def test_layers_that_compile_to_no_graph_are_said_to_run_eager():
    from shardtune.train.compile import apply_compile
    from shardtune.train.plan import Plan

    model = _two(BreakingLayer)
    report = apply_compile(model, Plan(strategy="NO", compile_backend="eager"))
    model(torch.randn(2, 5, 8, requires_grad=True)).sum().backward()
    counts = report.counts()
    assert counts["compiles"] >= 1 and counts["backend_graphs"] == 0 and report.compiled_nothing()
    assert "ran eager" in report.describe()
    working = _two(TracedLayer)
    report = apply_compile(working, Plan(strategy="NO", compile_backend="eager"))
    working(torch.randn(2, 5, 8, requires_grad=True))
    assert report.counts()["backend_graphs"] >= 1 and not report.compiled_nothing()
    assert "ran eager" not in report.describe()
