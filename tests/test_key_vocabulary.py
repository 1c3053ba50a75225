"""Every key shardtune accepts acts, or is refused (exit 2, naming the key) where it would change what runs.

A key acts where product code outside the config package reads it from the config: ``cfg.<section>.<key>``, a
section held in a name whose annotation or assignment says so (``run: RunConfig``, ``d = cfg.distributed``) or
that a call passes it to (``load_tokenizer(path, cfg.data)``), a section's property that product code reads
(``cfg.model.pure_bf16`` reads ``torch_dtype``), or the flat config read by key (the launcher's
``pick("machine_rank", ...)``). Code in shardtune/config/ declares, loads and checks keys: a key read only there
changes nothing, unless it is a listed one accepted only at the value that runs (every other value refused, tested
here) or one translated into other keys at load (tested here).

Walks the whole vocabulary: the train keys (TrainConfig), the TrainingArguments/TRL and Accelerate keys accepted
as no-ops (config/no_ops.py), and, in tests/test_deepspeed.py, every DeepSpeed key shardtune maps.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main
from shardtune.config import load_train_config
from shardtune.config.no_ops import NO_OPS
from shardtune.config.schema import RunConfig, TrainConfig, known_keys, section_classes
from shardtune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
# Where keys are declared, loaded and validated: a key read only here changes nothing that runs.
CONFIG_CODE = ("shardtune/config/",)
NOT_ACTING = {"validate"}  # a section's method that checks every key acts on none of them
FLAT_READERS = {"pick"}  # the flat config read by key: the launcher's pick("machine_rank", default), pick.whole(...)

# Keys accepted only at the value that is what shardtune runs; every other value is refused (tested below).
REFUSED = {"hub_strategy": ("checkpoint", "hub_strategy='checkpoint' is not accepted"),
           "fsdp_version": ("3", "fsdp_version=3 is not accepted"),
           "fsdp_backward_prefetch": ("BACKWARD_POST", "fsdp_backward_prefetch='BACKWARD_POST' is not accepted"),
           "save_safetensors": ("false", "save_safetensors=false asks for pickled .bin weights")}
# Keys that config loading translates into other keys (config/deepspeed.py), checked below by what they become.
TRANSLATED_AT_LOAD = {"deepspeed"}


def _annotated_section(annotation: ast.expr | None, types: dict[str, str]) -> str | None:
    """The section an annotation names (``RunConfig``, ``RunConfig | None``, ``"RunConfig"``), "*" for the whole
    TrainConfig, None for anything else."""
    for node in ast.walk(annotation) if annotation is not None else ():
        name = node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str) and name.split(" ")[0] in types:
            return types[name.split(" ")[0]]
    return None


class ConfigReads(ast.NodeVisitor):
    """The (section, attribute) pairs one module reads off config sections, and the keys it reads from the flat
    config by name."""

    def __init__(self, types: dict[str, str], attribute_sections: dict[str, str],
                 passed: dict[tuple[str, str], str], shared: dict[str, dict[str, str]]) -> None:
        self.types, self.attribute_sections = types, attribute_sections  # class name -> section; obj.attr -> section
        self.passed = passed  # (function name, "#position" or keyword) -> the section some call passes there
        # learnt from every module: function name -> the section it returns (load_train_config -> the whole
        # config); field name -> the section a field annotated with one holds (a Job's cfg: TrainConfig)
        self.returns, self.fields = shared["returns"], shared["fields"]
        self.sections = set(types.values())
        self.names: dict[str, str] = {}  # local name -> section, in the function being read
        self.reads: set[tuple[str, str]] = set()
        self.flat: set[str] = set()

    def section_of(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            # cfg.run is a section only off the whole config: a wandb run's .run, a job's .data, torch.optim are not
            if node.attr in self.sections and node.attr != "*":
                return node.attr if self.section_of(node.value) == "*" else None
            return self.attribute_sections.get(node.attr) or self.fields.get(node.attr)
        if isinstance(node, ast.Call):
            func = node.func
            return self.returns.get(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
        return None

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if returned := _annotated_section(node.returns, self.types):
            self.returns[node.name] = returned
        outer = dict(self.names)
        positional = [a for a in [*node.args.posonlyargs, *node.args.args] if a.arg not in ("self", "cls")]
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            where = f"#{positional.index(arg)}" if arg in positional else arg.arg
            section = (_annotated_section(arg.annotation, self.types) or self.passed.get((node.name, where))
                       or self.passed.get((node.name, arg.arg)))
            self.names.pop(arg.arg, None)
            if section:
                self.names[arg.arg] = section
        self.generic_visit(node)
        self.names = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v)
        elif (section := self.section_of(value)) and isinstance(target, ast.Name):
            self.names[target.id] = section
        elif section and isinstance(target, ast.Attribute):  # self.settings = cfg.checkpoint
            self.attribute_sections[target.attr] = section

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self.bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        section = _annotated_section(node.annotation, self.types)
        if section and isinstance(node.target, ast.Name):
            self.names[node.target.id] = section  # also a class field: obj.<field> holds that section
            self.fields[node.target.id] = section

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and (section := self.section_of(node.value)):
            self.reads.add((section, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        # pick("key", default), or one of the picker's typed readers: pick.whole("key", ...)
        reader = name in FLAT_READERS or (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                                          and func.value.id in FLAT_READERS)
        if reader and node.args and isinstance(node.args[0], ast.Constant):
            self.flat.add(str(node.args[0].value))
        # A section handed to a function (load_tokenizer(path, cfg.data)) is read there under the parameter's name.
        given = [*((f"#{i}", a) for i, a in enumerate(node.args)), *((k.arg, k.value) for k in node.keywords)]
        for where, arg in given:
            if name and where and (section := self.section_of(arg)):
                self.passed[name, where] = section
        self.generic_visit(node)


SECTIONS = {**section_classes(), "*": TrainConfig}  # "*": the whole config, whose properties read several sections


def method_reads(sections: dict[str, type]) -> dict[tuple[str, str], set[str]]:
    """The keys each section's method or property reads (``self.<key>``, ``self.<section>.<key>``, other methods
    followed), by (section, method name)."""
    direct: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for section, cls in sections.items():
        for klass in cls.__mro__[:-1]:
            for node in ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body:
                if isinstance(node, ast.FunctionDef) and node.name not in NOT_ACTING:
                    direct[section, node.name] = {
                        (sub.value.attr, sub.attr) if isinstance(sub.value, ast.Attribute) else (section, sub.attr)
                        for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                        and (isinstance(sub.value, ast.Name) and sub.value.id == "self"
                             or isinstance(sub.value, ast.Attribute) and sub.value.attr in sections)}

    def keys(method: tuple[str, str], seen: frozenset[tuple[str, str]]) -> set[str]:
        found = set()
        for read in direct[method] - seen:
            found |= keys(read, seen | {method}) if read in direct else {read[1]}
        return found
    return {method: keys(method, frozenset()) for method in direct}


@functools.cache
def product_modules() -> tuple[ast.Module, ...]:
    """Every module of shardtune/ outside the config code, parsed."""
    return tuple(ast.parse(path.read_text()) for path in sorted((ROOT / "shardtune").rglob("*.py"))
                 if not path.relative_to(ROOT).as_posix().startswith(CONFIG_CODE))


@functools.cache
def keys_read_by_product_code() -> frozenset[str]:
    """The schema's keys that code outside shardtune/config/ reads from a config (read once per session)."""
    return frozenset(keys_read_from_sections(SECTIONS))


def keys_read_from_sections(sections: dict[str, type]) -> set[str]:
    """The keys of ``sections`` that code outside shardtune/config/ reads from a config."""
    types = {klass.__name__: name for name, cls in sections.items() for klass in cls.__mro__[:-1]}
    keys = {f.name for name, cls in sections.items() if name != "*" for f in dataclasses.fields(cls)}
    methods = method_reads(sections)
    modules = product_modules()
    attribute_sections: list[dict[str, str]] = [{} for _ in modules]
    passed: dict[tuple[str, str], str] = {}
    shared: dict[str, dict[str, str]] = {"returns": {}, "fields": {}}

    def learnt() -> tuple[int, ...]:
        return len(passed), sum(map(len, attribute_sections)), *map(len, shared.values())

    while True:  # again until no pass learns more: attributes methods assign, sections passed on through calls
        before = learnt()
        scans = [ConfigReads(types, attributes, passed, shared) for attributes in attribute_sections]
        for scan, tree in zip(scans, modules):
            scan.visit(tree)
        if learnt() == before:
            break
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in sections.items()}
    found: set[str] = set()
    for scan in scans:
        for section, attr in scan.reads:  # a section's own field, or what its method or property reads
            found |= methods.get((section, attr), {attr} & fields[section])
        found |= scan.flat
    return found & keys


def test_every_train_key_is_read_by_the_code_that_runs():
    """A key no code reads is accepted and changes nothing: the defect this test exists for."""
    unread = sorted(set(known_keys()) - keys_read_by_product_code() - set(REFUSED) - TRANSLATED_AT_LOAD)
    assert not unread, f"accepted but read by nothing outside shardtune/config/: {unread}; make each act, or " \
                       f"refuse it (config/no_ops.py)"


@dataclasses.dataclass
class PlantedRunConfig(RunConfig):
    """RunConfig with keys no product code reads from a config: one nobody mentions, and some named like attributes
    product code reads off other objects: tensors (``x.shape``), a tracker's run (``self.run.id``), a job's data
    (``job.data.train``), ``torch.optim.SGD``, a LoRA count (``lora.total``)."""

    a_key_only_the_schema_mentions: bool = False
    shape: int = 0
    id: str = ""
    train: bool = False
    SGD: bool = False
    total: int = 0


def test_the_reader_scan_reports_a_key_only_the_schema_mentions():
    """The scan itself: planted keys are reported, and so are the run keys read only inside shardtune/config/."""
    planted = {**SECTIONS, "run": PlantedRunConfig}
    run_keys = {f.name for f in dataclasses.fields(PlantedRunConfig)}
    assert run_keys - keys_read_from_sections(planted) == {"a_key_only_the_schema_mentions", "shape", "id", "train",
                                                             "SGD", "total", "hub_strategy",
                                                             "save_safetensors"}


def test_the_reader_scan_follows_sections_into_names_attributes_and_properties():
    """Each way product code reads a key, with keys that product code reads only that way."""
    read = keys_read_by_product_code()
    assert {"save_strategy",  # self.settings = cfg.checkpoint, then self.settings.save_strategy
            "torch_dtype",  # cfg.model.pure_bf16, a property reading it
            "bf16", "fp16", "mixed_precision",  # cfg.mixed_precision, TrainConfig's property
            "machine_rank", "rdzv_backend",  # the launcher's pick.whole("machine_rank", ...), pick("rdzv_backend", ...)
            "add_special_tokens"} <= read  # load_tokenizer(path, cfg.data) -> configure_tokenizer(tokenizer, cfg)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_key_accepted_at_one_value_refuses_every_other(key, capsys, tmp_path, monkeypatch):
    """The keys the scan lets through because they are refused: every value but the one that runs exits 2."""
    monkeypatch.chdir(tmp_path)  # the output_dir, were the value let through
    value, message = REFUSED[key]
    assert main(["train", *BASE, f"--{key}", value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert key not in keys_read_by_product_code()  # else it belongs with the keys that act, not here


def test_deepspeed_is_translated_into_the_keys_that_run(tmp_path):
    """The key the scan lets through because loading translates it: a ZeRO-2 file becomes FSDP SHARD_GRAD_OP."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    plain, mapped = load_train_config(BASE), load_train_config([*BASE, "--deepspeed", str(ds)])
    assert (plain.distributed.distributed_type, plain.distributed.fsdp_sharding_strategy,
            plain.run.gradient_accumulation_steps) == (None, "FULL_SHARD", 1)
    assert (mapped.distributed.distributed_type, mapped.distributed.fsdp_sharding_strategy,
            mapped.run.gradient_accumulation_steps) == ("FSDP", "SHARD_GRAD_OP", 4)
    # the scan's exemption is a key, and needed: no product code reads it, loading has translated it
    assert TRANSLATED_AT_LOAD <= set(known_keys()) and not TRANSLATED_AT_LOAD & keys_read_by_product_code()


def test_no_op_keys_are_not_train_keys_and_are_documented():
    doc = (ROOT / "docs" / "config.md").read_text()
    section = doc.split("## Accepted, changing nothing", 1)[1]
    for key in NO_OPS:
        assert key not in known_keys(), f"{key} is both a train key and a no-op"
        assert f"| `{key}` |" in section, f"{key} is not listed in docs/config.md"


def test_no_op_keys_load_with_the_values_that_change_nothing(tmp_path):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndebug: false\ndowncast_bf16: 'no'\ngpu_ids: all\n"
                   "main_training_function: main\nsame_network: true\nenable_cpu_affinity: false\nuse_cpu: false\n"
                   "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\ndynamo_config:\n  dynamo_backend: NO\n"
                   "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 1\n"
                   "distributed_type: FSDP\nnum_processes: 2\n")
    cfg = load_train_config(["--config_file", str(acc), *BASE, "--do_train", "true", "--do_eval", "true",
                             "--remove_unused_columns", "false", "--dataloader_num_workers", "4",
                             "--include_num_input_tokens_seen", "true", "--logging_nan_inf_filter", "false",
                             "--average_tokens_across_devices", "true", "--dataloader_drop_last", "true",
                             "--assistant_only_loss", "true", "--completion_only_loss", "true", "--model_revision",
                             "main"])
    assert (cfg.distributed.distributed_type, cfg.distributed.num_processes) == ("FSDP", 2)


# An acting value of each no-op that has one: refused in one line naming the key.
ACTING = {"compute_environment": "AMAZON_SAGEMAKER", "downcast_bf16": "yes", "tpu_env": ["X=1"],
          "tpu_use_cluster": True, "tpu_use_sudo": True, "tpu_name": "pod", "tpu_zone": "us-central2-b",
          "commands": ["python x.py"], "command_file": "cmds.sh", "use_cpu": True, "gpu_ids": "0,1",
          "megatron_lm_config": {"megatron_lm_tp_degree": 2},
          "ipex_config": {"ipex": True}, "mpirun_config": {"mpirun_hostfile": "hosts"},
          "fp8_config": {"backend": "TE"}, "parallelism_config": {"parallelism_config_tp_size": 2},
          "fsdp_offload_optimizer": True, "assistant_only_loss": False, "completion_only_loss": False,
          "model_revision": "v1.0", "average_tokens_across_devices": False, "dataloader_drop_last": False,
          "lora_task_type": "SEQ_CLS", "task_type": "SEQ_CLS", "peft_type": "IA3",
          "load_in_8bit": True, "use_8bit_quantization": True, "ignore_bias_buffers": True,
          "layers_to_transform": [0, 1], "layers_pattern": "layers", "exclude_modules": ["k_proj"],
          "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"q_proj": 4}, "fan_in_fan_out": True,
          "llm_int8_enable_fp32_cpu_offload": True, "llm_int8_skip_modules": ["lm_head"], "quant_method": "gptq",
          "use_loftq": True, "use_loftq_callback": True, "use_unsloth": True, "tokenizer_name_or_path": "tok/",
          "dataset_streaming": True,
          "truncation_mode": "keep_end", "packing_strategy": "wrapped", "loss_type": "dft", "pad_to_multiple_of": 8,
          "router_aux_loss_coef": 0.001, "pad_token": "<pad>",
          "dataset_kwargs": {"skip_prepare_dataset": True}}


# TRL 1.16's SFTConfig defaults of its keys that are no-ops here (its own fields; TrainingArguments' are above).
TRL_SFT_DEFAULTS = {"truncation_mode": "keep_start", "packing_strategy": "bfd", "loss_type": "nll",
                    "padding_free": False, "shuffle_dataset": False, "pad_to_multiple_of": "auto",
                    "router_aux_loss_coef": None, "eos_token": None, "pad_token": None,
                    "dataset_kwargs": None, "chat_template_path": None, "completion_only_loss": None}
# (its assistant_only_loss false trains every token of a conversation: refused here, naming train_on_prompt)


def test_a_trl_recipe_with_sftconfigs_defaults_written_out_loads(tmp_path):
    """A recipe holding TRL's SFTConfig defaults (packing_strategy bfd, loss_type nll, truncation_mode keep_start,
    ...) asks for what runs here: it was refused key by key as unknown. The values that mean other behaviour stay
    refused (ACTING above); padding_free and shuffle_dataset change speed or order only."""
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({**TRL_SFT_DEFAULTS, "model_name_or_path": "m", "dataset_name": "d.jsonl",
                                      "output_dir": "o", "packing": True}))
    cfg = load_train_config([str(recipe)])
    assert cfg.data.packing and cfg.run.output_dir == "o"
    for key, value in {"padding_free": True, "shuffle_dataset": True, "router_aux_loss_coef": 0.0,
                       "dataset_kwargs": {"skip_prepare_dataset": False}}.items():
        recipe.write_text(yaml.safe_dump({key: value, "model_name_or_path": "m", "dataset_name": "d.jsonl"}))
        assert load_train_config([str(recipe), "--output_dir", "o"]).data.packing is False, key
    # TRL's former dataset_kwargs of PEFT's SFT example: add_special_tokens (BOS once, here either way) loads; an
    # append_concat_token that would act is refused naming the key that does it; skip_prepare_dataset true refused
    for kwargs in ({"add_special_tokens": True, "append_concat_token": False}, {"add_special_tokens": False}):
        recipe.write_text(yaml.safe_dump({"dataset_kwargs": kwargs, "model_name_or_path": "m", "dataset_name": "d"}))
        assert load_train_config([str(recipe), "--output_dir", "o"]).data.append_concat_token is False
    for kwargs, says in (({"append_concat_token": True}, "give TRL's former append_concat_token entry as the key "
                                                         "append_concat_token"),
                         ({"skip_prepare_dataset": True}, r"skip_prepare_dataset true is not run")):
        recipe.write_text(yaml.safe_dump({"dataset_kwargs": kwargs, "model_name_or_path": "m", "dataset_name": "d"}))
        with pytest.raises(UsageError, match=rf"line 1: dataset_kwargs=.* would change what runs .*{says}"):
            load_train_config([str(recipe), "--output_dir", "o"])
    # TRL's chat_template_path: a Jinja file acts (data/ reads it); a tokenizer folder, a missing file or a named
    # chat_template_format beside it are refused naming the key
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    for path, also, says in ((tmp_path / "t.jinja", {}, None),
                             (tmp_path, {}, "only a Jinja template file \\(.jinja or .j2\\) is read here"),
                             (tmp_path / "gone.jinja", {}, "chat_template_path '.*gone.jinja' is not a file"),
                             (tmp_path / "t.jinja", {"chat_template_format": "chatml"}, "both name the chat template")):
        recipe.write_text(yaml.safe_dump({"chat_template_path": str(path), **also, "model_name_or_path": "m",
                                          "dataset_name": "d", "output_dir": "o"}))
        if says is None:  # (training False: the paths a job reads are checked, as before a run starts)
            assert load_train_config([str(recipe)], training=False).data.chat_template_path == str(path)
        else:
            with pytest.raises(UsageError, match=says):
                load_train_config([str(recipe)], training=False)
    recipe.write_text(yaml.safe_dump({**TRL_SFT_DEFAULTS, "eos_token": "<|im_end|>", "model_name_or_path": "m",
                                      "dataset_name": "d.jsonl", "output_dir": "o"}))
    assert load_train_config([str(recipe)]).data.eos_token == "<|im_end|>"  # TRL's eos_token acts here


def test_the_values_a_no_op_key_publishes_are_the_ones_it_accepts():
    """docs/config.md and the JSON Schema list each no-op key's accepted values (Inert.values): every one of them
    is accepted, and the acting value below is not among them."""
    for key, entry in NO_OPS.items():
        assert all(entry.inert(value) for value in entry.inert.values or ()), key
        if key in ACTING and entry.inert.values is not None:
            assert ACTING[key] not in entry.inert.values, key


def test_every_no_op_with_acting_values_lists_one_here():
    assert sorted(ACTING) == sorted(key for key, entry in NO_OPS.items() if entry.instead)


@pytest.mark.parametrize("key", sorted(ACTING))
def test_an_acting_value_of_a_no_op_key_is_refused(tmp_path, monkeypatch, key):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # use_cpu acts only where a GPU is visible
    acc = tmp_path / "accelerate.yaml"
    acc.write_text(json.dumps({key: ACTING[key], "distributed_type": "NO"}))  # JSON is YAML
    # (assistant_only_loss / completion_only_loss false ask for what train_on_prompt true does: they name it)
    with pytest.raises(UsageError, match=rf"{acc}, line 1: {key}=.* (would change what runs .*: |asks for .*: set "
                                         rf"that instead)"):
        load_train_config(["--config_file", str(acc), *BASE])


def test_accelerates_multi_cpu_file_loads_where_no_gpu_is_visible(tmp_path, monkeypatch):
    """accelerate config writes use_cpu: true into every MULTI_CPU file; where torch sees no GPU that asks for what
    runs anyway, so the file loads as it is (it was refused, naming a fix that could not help)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                   "mixed_precision: 'no'\nuse_cpu: true\nmachine_rank: 0\nnum_machines: 1\n")
    cfg = load_train_config(["--config_file", str(acc), *BASE])
    assert (cfg.distributed.distributed_type, cfg.distributed.num_processes) == ("DDP", 2)


def test_disable_tqdm_and_logging_first_step_act_in_a_run(tmp_path_factory, monkeypatch, capsys):
    """The loop's progress bar is enabled by default on rank 0 and disabled with --disable_tqdm true; the first
    step is logged with --logging_first_step true beside every logging_steps-th and the last, and under
    logging_strategy epoch beside each epoch's end; unset, it logs the first step under steps only. Without the
    bar, whose postfix was the only place the console showed the training loss, each record is a log line."""
    import shardtune.train.loop as loop
    from tests.trainutil import logging_restored, tiny_workspace

    work = tiny_workspace(tmp_path_factory, "disable-tqdm", rows=24)
    shown = []  # whether each run's bar draws (tqdm's own disable flag on the bar the loop got)
    bar = loop.progress_bar

    def recorded(total, initial, on):
        made = bar(total, initial, on)
        shown.append(not made.disable)
        return made

    monkeypatch.setattr(loop, "progress_bar", recorded)
    logged, printed = {}, {}
    for value in ("false", "true"):
        out = work / f"run-{value}"
        with logging_restored():
            assert main(["train", "--model_name_or_path", str(work / "model"), "--dataset_name",
                         str(work / "chat.jsonl"), "--output_dir", str(out), "--max_steps", "3", "--logging_steps",
                         "2", "--save_strategy", "no", "--predict_memory", "false", "--disable_tqdm", value,
                         *([] if value == "false" else ["--logging_first_step", "false"])]) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logged[value] = [r["step"] for r in records if "loss" in r]
        lines = re.findall(r"step (\d+): loss ([\d.]+), lr ", capsys.readouterr().err)
        printed[value] = [(int(step), float(loss)) for step, loss in lines]
        assert printed[value] in ([], [(r["step"], round(r["loss"], 4)) for r in records if "loss" in r]), value
    assert shown == [True, False]
    assert logged == {"false": [1, 2, 3], "true": [2, 3]}
    assert printed["false"] == [] and [step for step, _ in printed["true"]] == [2, 3]
    # logging_strategy epoch: each epoch's end (24 rows at 8 a step: 3 steps an epoch), and with logging_first_step
    # true the first step beside them, as Transformers logs it (unset: not under epoch), logged once where an epoch
    # ends on it.
    for first, every in (("true", "3"), ("false", "3"), (None, "3"), ("true", "1")):
        out = work / f"epoch-{first}-{every}"
        given = [] if first is None else ["--logging_first_step", first]
        with logging_restored():
            assert main(["train", "--model_name_or_path", str(work / "model"), "--dataset_name",
                         str(work / "chat.jsonl"), "--output_dir", str(out), "--max_steps", "6", "--logging_strategy",
                         "epoch", "--per_device_train_batch_size", str(24 // int(every)), "--save_strategy", "no",
                         "--predict_memory", "false", *given]) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logged[first, every] = [r["step"] for r in records if "loss" in r]
    assert logged["true", "3"] == [1, 3, 6]
    assert logged["false", "3"] == logged[None, "3"] == [3, 6]
    assert logged["true", "1"] == [1, 2, 3, 4, 5, 6]


def test_keys_that_used_to_be_ignored_now_act(tmp_path, capsys):
    """ddp_find_unused_parameters reaches DDP's plan, save_safetensors false is refused (logging_first_step and
    disable_tqdm act in a run: the test above)."""
    from shardtune.train.plan import make_plan

    cfg = load_train_config([*BASE, "--num_processes", "2", "--ddp_find_unused_parameters", "true"])
    from shardtune.dist import DistInfo

    import torch

    info = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    plan = make_plan(cfg.distributed, info, param_dtype=None, gradient_checkpointing=False, use_reentrant=False)
    assert plan.strategy == "DDP" and plan.find_unused_parameters
    with pytest.raises(UsageError, match="save_safetensors=false asks for pickled .bin weights"):
        load_train_config([*BASE, "--save_safetensors", "false"])


def written_training_arguments(tmp_path) -> dict:
    """What a TrainingArguments left at its defaults writes out (to_json_string), as a recipe would hold it."""
    from transformers import TrainingArguments

    return json.loads(TrainingArguments(output_dir=str(tmp_path / "o")).to_json_string())


def test_transformers_defaults_are_the_installed_ones(tmp_path):
    """Every TrainingArguments key refused here as having no counterpart loads at the installed Transformers'
    default, and that default is the one TRANSFORMERS_DEFAULTS holds (a new Transformers shows up here)."""
    from shardtune.config.loading import OTHER_TOOLS_KEYS, UNKNOWN_ELSEWHERE
    from shardtune.config.no_ops import TRANSFORMERS_DEFAULTS

    written = written_training_arguments(tmp_path)
    assert set(TRANSFORMERS_DEFAULTS) == (set(OTHER_TOOLS_KEYS) | set(UNKNOWN_ELSEWHERE)) & set(written)
    assert {key: written[key] for key in TRANSFORMERS_DEFAULTS} == TRANSFORMERS_DEFAULTS


def test_a_written_out_training_arguments_loads_but_for_what_would_run_otherwise(tmp_path):
    """A recipe written out from TrainingArguments held 40 keys with no counterpart here, each refused as unknown,
    though at Transformers' defaults they ask for what runs here (no label smoothing, the data resumed where it
    stopped, no evaluation metrics, ...). They load now. What stays refused is what Transformers' defaults would run
    otherwise: the incomplete last batch of an epoch kept; without it the recipe loads as it is. Its hub_strategy
    every_save (a hub upload at every save) does nothing without push_to_hub, as in Transformers: accepted there,
    refused with push_to_hub true. Its hub_token is written out as '<HUB_TOKEN>', hiding the value: that says none.
    activation_checkpointing, Transformers 5's name of gradient_checkpointing, sets it (false, as written)."""
    written = written_training_arguments(tmp_path)
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump({**written, "model_name_or_path": "m", "dataset_name": "d.jsonl"}))
    with pytest.raises(UsageError) as refused:
        load_train_config([str(recipe)])
    assert re.findall(r"line \d+: (\w+)=", str(refused.value)) == ["dataloader_drop_last"]
    assert (written["hub_strategy"], written["push_to_hub"]) == ("every_save", False)
    with pytest.raises(UsageError, match=r"line \d+: hub_strategy='every_save' is not accepted: push_to_hub uploads"):
        load_train_config([str(recipe), "--dataloader_drop_last", "true", "--push_to_hub", "true"])
    del written["dataloader_drop_last"]
    assert written["hub_token"] == "<HUB_TOKEN>" and written["activation_checkpointing"] is False
    recipe.write_text(yaml.safe_dump({**written, "model_name_or_path": "m", "dataset_name": "d.jsonl"}))
    cfg = load_train_config([str(recipe)])
    assert (cfg.run.output_dir, cfg.optim.lr_scheduler_type, cfg.run.hub_token, cfg.run.gradient_checkpointing) == \
        (str(tmp_path / "o"), "linear", None, False)
    assert load_train_config([*BASE, "--activation_checkpointing", "false"]).run.gradient_checkpointing is False
    cfg = load_train_config([*BASE, "--activation_checkpointing_kwargs", '{"use_reentrant": true}'])
    assert (cfg.run.gradient_checkpointing, cfg.run.use_reentrant) == (True, True)
    with pytest.raises(UsageError, match="activation_checkpointing=true and gradient_checkpointing=false disagree"):
        load_train_config([*BASE, "--activation_checkpointing", "true", "--gradient_checkpointing", "false"])


@pytest.mark.parametrize("key, value, says", [
    ("label_smoothing_factor", 0.1, "unknown key 'label_smoothing_factor'; the loss here is plain cross-entropy"),
    ("ignore_data_skip", True, "unknown key 'ignore_data_skip': Transformers' TrainingArguments key"),
    ("log_level_replica", "info", "unknown key 'log_level_replica'; ranks other than 0 print errors, and warnings"),
    ("include_for_metrics", ["inputs"], "unknown key 'include_for_metrics': Transformers' TrainingArguments key"),
    ("eval_do_concat_batches", False, "unknown key 'eval_do_concat_batches'"),
    ("fsdp", "full_shard", "here FSDP is distributed_type FSDP"),
    ("accelerator_config", {"split_batches": True}, "unknown key 'accelerator_config'")])
def test_a_transformers_key_at_another_value_than_its_default_is_refused(tmp_path, key, value, says):
    recipe = tmp_path / "args.yaml"
    recipe.write_text(yaml.safe_dump({key: value, "model_name_or_path": "m", "dataset_name": "d.jsonl"}))
    with pytest.raises(UsageError, match=re.escape(says)):
        load_train_config([str(recipe), "--output_dir", "o"])


@pytest.mark.parametrize("value", ["true", "false"])
def test_prediction_loss_only_loads_either_way(value):
    """Transformers' prediction_loss_only true (evaluate returns the loss alone) asks for what evaluation does here,
    yet it was refused as having no counterpart; only its default, false, loaded. Both load now."""
    cfg = load_train_config(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o",
                             "--eval_strategy", "steps", "--prediction_loss_only", value])
    assert cfg.run.eval_strategy == "steps"
